"""The plan of a token store: its source files cut into units (formats.plan_units), which fixes the
store's token order, written to the store folder's plan.json; and the share of it a --part takes."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from hybridpar.config import BAD_RECORD_CHOICES, MAX_BAD_RECORDS, MAX_DOCUMENT_BYTES
from hybridpar.data.formats import UNIT_BYTES, Unit, plan_units
from hybridpar.data.sources import Input, Source, describe_input
from hybridpar.data.store.token_store import DAMAGED, FORMAT, MANIFEST, PLAN, UNITS, VERSION, StoreError
from hybridpar.data.streams import DataFormatError
from hybridpar.data.tokenise import token_dtype
from hybridpar.files import NO_FLOCK_ERRNOS, PathLike, sha256_text, write_text_atomic

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Plan:
    folder: Path
    data: dict  # plan.json
    units: tuple[Unit, ...]

    @property
    def key(self) -> str:
        return self.data["key"]


def plan_of(input: Input, tokenizer, out: PathLike, *, val_fraction: float = 0.0, on_bad_record: str = "error",
            unit_bytes: int = UNIT_BYTES, max_document_bytes: int = MAX_DOCUMENT_BYTES,
            max_bad_records: float = MAX_BAD_RECORDS) -> Plan:
    """The plan of a store of `input` (sources.describe_input) tokenised by `tokenizer` in folder
    `out` (nothing written)."""
    if on_bad_record not in BAD_RECORD_CHOICES:
        raise ValueError(f"data.on_bad_record must be one of {', '.join(BAD_RECORD_CHOICES)}, got {on_bad_record!r}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"the validation fraction must be in [0, 1), got {val_fraction}")
    if not isinstance(unit_bytes, int) or unit_bytes < 1:
        raise ValueError(f"the unit size must be a positive number of bytes, got {unit_bytes!r}")
    if max_document_bytes < 1:
        raise ValueError(f"data.max_document_bytes (--max-document-bytes) must be at least 1, got {max_document_bytes}")
    if not max_bad_records >= 0:  # (NaN too)
        raise ValueError(f"data.max_bad_records (--max-bad-records) must be at least 0, got {max_bad_records}")
    eos_id, vocab_size = int(tokenizer.eos_id), int(tokenizer.vocab_size)
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"the tokenizer has no usable eos piece (eos_id {eos_id}); documents need one between them")
    files, text_field = list(input.files), input.text_field
    units = plan_units(files, text_field, unit_bytes)
    data = {"format": FORMAT + "-plan", "version": VERSION, "sources": input.description,
            "tokenizer_sha256": tokenizer.sha256,
            "vocab_size": vocab_size, "eos_id": eos_id, "dtype": token_dtype(vocab_size).name,
            "text_field": text_field, "val_fraction": val_fraction, "on_bad_record": on_bad_record,
            "max_document_bytes": max_document_bytes,
            "units": [{"file": files.index(u.file), "start": u.start, "stop": u.stop, "bytes": u.nbytes} for u in units]}
    data["key"] = sha256_text(json.dumps(data, sort_keys=True))[:16]
    # Not in the key: the same tokenizer (its sha256) read from another path makes the same store. Absolute,
    # so that a run started in another folder finds it.
    path = getattr(tokenizer, "path", "")
    data["tokenizer_path"] = str(Path(path).absolute()) if path else ""
    # Nor the cap on bad records: it changes no token, only whether the manifest is written (manifest_write).
    data["max_bad_records"] = max_bad_records
    return Plan(Path(out), data, tuple(units))


def make_plan(source: Source, tokenizer, out: PathLike, *, text_field: str = "text", **options) -> Plan:
    """plan_of `source`, written to plan.json (or checked against the one there: a store folder
    holds one store)."""
    plan = plan_of(describe_input(source, text_field), tokenizer, out, **options)
    with preparing(plan):
        pass
    return plan


def cache_folder(input: Input, tokenizer_sha256: str, cache_dir: PathLike, *, val_fraction: float,
                 on_bad_record: str, max_document_bytes: int) -> Path:
    """Where a store of `input` is kept in `cache_dir`: named by a hash of its description (paths,
    sizes, mtimes), the tokenizer and the options, so an edited file makes a new one."""
    key = {"source": input.description, "tokenizer": tokenizer_sha256, "version": VERSION,
           "val_fraction": val_fraction, "on_bad_record": on_bad_record, "max_document_bytes": max_document_bytes}
    return Path(cache_dir) / f"store-{sha256_text(json.dumps(key, sort_keys=True))[:16]}"


def finished_store(folder: PathLike, input: Input, tokenizer_sha256: str, *, val_fraction: float,
                   on_bad_record: str, max_document_bytes: int) -> bool:
    """Whether `folder` holds the complete store of `input`: its manifest there, and its plan.json
    recording exactly this input (each file with the path, size and mtime its description took),
    this tokenizer and these options. No source file is opened, and no plan made."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return False
    made = read_plan(folder) or {}
    wanted = {"version": VERSION, "sources": input.description, "tokenizer_sha256": tokenizer_sha256,
              "text_field": input.text_field, "val_fraction": val_fraction, "on_bad_record": on_bad_record,
              "max_document_bytes": max_document_bytes}
    return all(made.get(key) == value for key, value in wanted.items())


def read_plan(folder: Path) -> Optional[dict]:
    """plan.json of store `folder`, or None (none there, or half of one on a file system without atomic rename)."""
    try:
        return json.loads((Path(folder) / PLAN).read_text())
    except (OSError, ValueError):
        return None


def describe_plan(data: Optional[dict]) -> str:
    """The input a plan.json names, in a few words (its sources, and who wrote it when known)."""
    if not data:
        return "unknown input"
    try:
        files = [f.get("path") or f.get("kind", "?") for f in data["sources"]["files"]]
    except (KeyError, TypeError, AttributeError):
        files = ["unknown input"]
    shown = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    who = data.get("written_by")
    return shown + (f"; {who}" if who else "")


# --- one store, one input at a time ------------------------------------------------------------
#
# Every process that prepares a store holds a shared flock on STORE/prepare.lock while it works (the
# workers of `hybridpar prepare` under their parent's); plan.json is written or replaced only under
# the exclusive lock, i.e. when nobody prepares. So processes of the same input join each other, and
# one of other input is refused at once instead of replacing plan.json under them (which made both
# loop forever). Once the manifest is written, the last process out removes the lock files. A
# preparation refused for its input (DataFormatError: a bad record, no text, an empty part, too many
# bad records) leaves nothing: the same input is refused again whoever runs it, and other input makes
# another plan, so the last process out removes every file of the store (discard_refused).

STORE_LOCK = "prepare.lock"
_SHARED_WAIT = 60.0  # seconds to wait for a shared lock: the exclusive one is held while plan.json is written


@contextlib.contextmanager
def preparing(plan: Plan, own_folder: bool = False) -> Iterator[None]:
    """Hold store `plan.folder` for preparing `plan` (writing its plan.json if the store is new);
    refuses, in one line, a store being prepared, or holding units, of other input. A refusal of the
    input inside (DataFormatError) takes the store's files with it (discard_refused), and the folder
    too if this process made it or `own_folder` (a cache's)."""
    if (plan.folder / MANIFEST).is_file():  # complete: nothing to lock (its lock files are gone)
        there = read_plan(plan.folder)
        if there is None or there.get("key") != plan.key:
            _refuse_other_store(plan, there)
        yield
        return
    if plan.folder.exists() and not plan.folder.is_dir():
        raise StoreError(f"{plan.folder} is a file, not a store folder: give another path (a new folder, or a store's)")
    own_folder = own_folder or not plan.folder.exists()
    fd = _claimed(plan)
    try:
        yield
    except DataFormatError:
        os.close(fd)  # releases the shared lock: the last process out discards the store
        fd = -1
        discard_refused(plan, own_folder)
        raise
    finally:
        if fd >= 0:
            os.close(fd)  # releases the shared lock
            remove_locks(plan.folder)


def _claimed(plan: Plan) -> int:
    """The store's prepare.lock, open and held (shared) for `plan` (_claim): taken anew if a refused
    preparation removed it (discard_refused) while this process waited for it."""
    while True:
        plan.folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(plan.folder / STORE_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # the folder went between the two calls
            continue
        except OSError as err:
            raise StoreError(f"cannot lock {plan.folder / STORE_LOCK} ({err.strerror}): give an --out you may "
                             "write in") from None
        try:
            if _claim(fd, plan):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _claim(fd: int, plan: Plan) -> bool:
    """Take the store lock `fd` for `plan`: True once held; False if its file was removed meanwhile."""
    deadline = time.monotonic() + _SHARED_WAIT
    while True:
        try:
            if _flock(fd, fcntl.LOCK_EX):
                if not _still_there(fd, plan.folder / STORE_LOCK):
                    return False  # (checked again below, under the shared lock)
                _write_plan(plan)  # nobody else prepares: plan.json may be written or replaced
                fcntl.flock(fd, fcntl.LOCK_SH)  # (not atomic: another may slip in between, hence the re-read)
            elif not _flock(fd, fcntl.LOCK_SH):  # someone is writing plan.json: a moment
                if time.monotonic() > deadline:
                    raise StoreError(f"{plan.folder}: waited {_SHARED_WAIT:.0f} s for {STORE_LOCK}, held exclusively "
                                     "by another process writing plan.json: is it stuck? stop it and run again")
                time.sleep(0.05)
                continue
        except OSError as err:
            if err.errno not in NO_FLOCK_ERRNOS:
                raise
            log.warning("%s: this file system has no flock; two preparations of different input into it are not "
                        "told apart", plan.folder)
            _write_plan(plan)
            return True
        if not _still_there(fd, plan.folder / STORE_LOCK):
            return False
        there = read_plan(plan.folder)
        if there is not None and there.get("key") == plan.key:
            return True  # ours: joined
        if (plan.folder / MANIFEST).is_file():
            _refuse_other_store(plan, there)
        raise StoreError(f"{plan.folder} is being prepared from other input ({describe_plan(there)}): give another "
                         "--out (one store a folder), or let that preparation finish first")


def _still_there(fd: int, path: Path) -> bool:
    """Is the open file `fd` still the file at `path`?"""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return os.path.samestat(st, os.fstat(fd))


def _flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _write_plan(plan: Plan) -> None:
    """Under the exclusive store lock: plan.json made `plan`'s if the folder holds no other input."""
    there = read_plan(plan.folder)
    if there is not None and there.get("key") == plan.key:
        return
    if (plan.folder / MANIFEST).is_file():  # a complete store is never replaced
        _refuse_other_store(plan, there)
    if there is not None and any((plan.folder / UNITS).glob("*.json")):
        raise StoreError(f"{plan.folder} holds an unfinished store of other input ({describe_plan(there)}) that nobody "
                         f"is preparing: delete {plan.folder} or give another --out (or run that preparation again "
                         "to finish it)")
    # Nothing there, or a plan nobody made anything of yet.
    data = {**plan.data, "written_by": f"{socket.gethostname()} pid {os.getpid()}"}
    write_text_atomic(plan.folder / PLAN, json.dumps(data, indent=1) + "\n")


def _refuse_other_store(plan: Plan, there: Optional[dict]) -> None:
    there = there or {}
    differs = [k for k in ("sources", "tokenizer_sha256", "text_field", "val_fraction", "on_bad_record",
                           "max_document_bytes")
               if there.get(k) != plan.data[k]] or ["the units"]
    raise StoreError(f"{plan.folder} holds a store of other input ({', '.join(differs)} differ): give another "
                     f"--out, or delete {plan.folder} to prepare it anew")


@contextlib.contextmanager
def damage_to_repair(folder: Path, on_wait: Optional[Callable[[str], None]] = None) -> Iterator[bool]:
    """Whether a job recorded damage in store `folder` (store.record_damage) that nobody repaired yet.
    While True this process holds the record's lock, so that of the processes that start at once (a
    job's ranks) one checks the store and repairs it, and removes the record; the others wait for it
    (`on_wait` hears so every few seconds: a watchdog sees them alive), then find the record gone."""
    path = folder / DAMAGED
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        told = time.monotonic()
        try:
            while not _flock(fd, fcntl.LOCK_EX):
                if on_wait is not None and time.monotonic() - told >= 5.0:
                    on_wait(f"waiting for another process repairing the damaged store {folder}")
                    told = time.monotonic()
                time.sleep(0.1)
            mine = _still_there(fd, path)
        except OSError as err:
            if err.errno not in NO_FLOCK_ERRNOS:
                raise
            mine = True  # no flock: each process checks the store (the repair makes the same units)
        yield mine
    finally:
        os.close(fd)


def remove_locks(folder: Path) -> None:
    """Once the store is complete and nobody holds it: its lock files go (they would stay in the
    finished store). Whoever holds it still removes them when it leaves; new comers see the manifest
    and take no lock."""
    if (folder / MANIFEST).is_file():
        _when_alone(folder, lambda: True)


def discard_refused(plan: Plan, remove_folder: bool) -> None:
    """After `plan`'s preparation was refused for its input: every file of its store goes, by the
    last process to leave it (those still working meet the refusal themselves), and the folder with
    them when `remove_folder` and nothing else is in it. A failure here is logged: the refusal is
    what the user must read."""
    folder, gone = plan.folder, []

    def discard() -> bool:
        there = read_plan(folder)
        if (folder / MANIFEST).is_file() or there is None or there.get("key") != plan.key:
            return False  # completed or taken over meanwhile: not ours to remove
        for path in (folder / UNITS).iterdir() if (folder / UNITS).is_dir() else ():
            if path.suffix != ".lock":  # records, shards, sums and half-written files; the locks go last
                path.unlink()
        (folder / PLAN).unlink()
        gone.append(folder)
        return True

    try:
        _when_alone(folder, discard)
        if gone:
            with contextlib.suppress(FileNotFoundError):
                (folder / UNITS).rmdir()
            if remove_folder and not any(folder.iterdir()):
                folder.rmdir()
    except OSError as err:
        log.warning("%s: the refused store's files could not all be removed (%s)", folder, err)


def _when_alone(folder: Path, work: Callable[[], bool]) -> None:
    """`work()` while nobody else prepares store `folder` (its prepare.lock held exclusively here);
    when it returns True, the store's lock files go too (prepare.lock last, under its own lock)."""
    try:
        fd = os.open(folder / STORE_LOCK, os.O_RDWR)  # never created here: gone means removed already
    except OSError:
        return
    try:
        if not _flock(fd, fcntl.LOCK_EX) or not work():
            return  # another still works (it does this when it leaves)
        for lock in [*folder.glob("*.lock"), *(folder / UNITS).glob("*.lock")]:
            if lock.name != STORE_LOCK:
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
        with contextlib.suppress(FileNotFoundError):
            (folder / STORE_LOCK).unlink()  # last, under its own lock
    except OSError as err:
        if err.errno not in NO_FLOCK_ERRNOS:
            raise
    finally:
        os.close(fd)


def default_workers() -> int:
    """Every core this process may use: the processes of a preparation, the threads of a check."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_part(part: int, parts: int) -> None:
    if parts < 1:
        raise ValueError(f"--part {part}/{parts}: N must be 1 or more (I/N: share I of N, I from 0 to N-1)")
    if not 0 <= part < parts:
        raise ValueError(f"--part {part}/{parts}: the part must be in 0..{parts - 1}")


def part_of(plan: Plan, part: int, parts: int) -> list[int]:
    """The units of part `part` of `parts`: the largest first to the part with the least input so far."""
    check_part(part, parts)
    loads, mine = [0] * parts, []
    for i in sorted(range(len(plan.units)), key=lambda i: (-plan.units[i].nbytes, i)):
        target = loads.index(min(loads))
        loads[target] += plan.units[i].nbytes
        if target == part:
            mine.append(i)
    return sorted(mine)
