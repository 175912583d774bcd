"""Checking a checkpoint's files against its manifest (checkpoint.checksums): while a load reads
them, and offline (`hybridpar verify`).

On load every file is checked by one rank, its owner: the rank in its name modulo the world size,
which at the same layout is the rank that wrote it and reads it. The manifest records the running
checksum at every stored item's edge, so each item is checked on its own: the fast reader sums the
items it reads whole from the bytes it already holds, and the owner reads again only the items no
read covered (bytes values; parts other ranks read after resharding). Without the fast reader, files
are summed whole in a thread beside the read. The small files every rank reads (.metadata,
params.json, train_state.json) are checked by every rank before anything is read. A checkpoint saved
without a manifest loads unverified, with a note.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Callable, Optional, TextIO

from ..progress import Progress, note
from ..safe_pickle import UnsafePickleError, read_dcp_metadata
from ..diagnostics.liveness import lost_in_collective
from ..mesh.ranks import gather_objects, mark_every_rank, raise_if_any_failed
from .checksums import (MANIFEST, enabled as checksums_enabled, file_checksum, first_difference, intervals,
                        read_manifest, same, sum_range)
from .reader import CheckpointDamagedError, CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8})$")  # a checkpoint of a run's folder (dcp.py writes them)
_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng/rank(\d+)\.pt)$")
_LISTED = 6  # tensors named in a damage message; the rest are counted


def by_items(name: str) -> bool:
    """Files checked stored item by stored item on load (the manifest marks their items' edges)."""
    return name.endswith(".distcp")


def owner(name: str, world: int) -> Optional[int]:
    """The rank that checks file `name` on load; None for the files every rank checks."""
    m = _OWNER.match(name)
    return int(m.group(1) or m.group(2)) % world if m else None


Span = Optional[tuple[int, int]]


def check_file(folder: Path, name: str, want: dict, progress: Optional[Callable[[int], object]] = None
               ) -> Optional[tuple[str, Span]]:
    """Why file `name` is not what the manifest entry `want` records, and the bytes where it differs
    when known; None when it is."""
    path = folder / name
    if not path.is_file():
        return "missing", None
    size = path.stat().st_size
    if size != want["size"]:
        # Shorter: a partial copy, a full disk. Longer: bytes appended after the save.
        kind = "truncated" if size < want["size"] else "longer than saved"
        return f"{kind} (size differs: {size} bytes, the manifest records {want['size']})", None
    if not same(file_checksum(path, progress), want):
        span = first_difference(path, want)  # reads the file again: only once damage is found
        return "checksum mismatch" + (f" in bytes {span[0]}..{span[1]}" if span else ""), span
    return None


def _tensors_in(folder: Path, name: str, span: Span) -> str:
    """What file `name` stores (in bytes `span`, when known), by DCP's metadata (storage_data maps
    each item to its file and bytes). Damaged metadata is never unpickled."""
    if name == ".metadata":
        return ""
    try:
        storage = read_dcp_metadata(folder / ".metadata").storage_data
    except Exception:  # noqa: BLE001 - a damaged .metadata: the file is still named
        return ""
    lo, hi = span or (0, float("inf"))
    fqns = sorted({index.fqn for index, info in storage.items()
                   if info.relative_path == name and info.offset < hi and lo < info.offset + info.length})
    if not fqns:
        return ""
    more = f" and {len(fqns) - _LISTED} more" if len(fqns) > _LISTED else ""
    return f" (the bytes of {', '.join(fqns[:_LISTED])}{more})"


def damaged(folder: Path, name: str, found: tuple[str, Span]) -> CheckpointDamagedError:
    reason, span = found
    what = f"{name} is {reason}" if reason.startswith(("missing", "truncated")) else f"{name}: {reason}"
    return CheckpointDamagedError(
        f"checkpoint {folder} is damaged: {what}{_tensors_in(folder, name, span)}; its bytes are not the ones "
        "saved: load another one (a resumed run sets this checkpoint aside and loads the previous one)")


class LoadCheck:
    """The checks of one load on one rank (see the module): construct before reading anything (checks
    the shared files, raising CheckpointDamagedError), start() as the read starts, join() after it."""

    def __init__(self, folder: Path, rank: int, world: int) -> None:
        self.folder, self.rank, self.world = Path(folder), rank, world
        self.error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._sums: Optional[dict] = None
        try:
            self.manifest = read_manifest(self.folder) if checksums_enabled() else {}
        except ValueError as err:
            raise CheckpointDamagedError(f"checkpoint {self.folder} is damaged: {err}; load another checkpoint") from err
        if self.manifest is None:
            note(f"{self.folder} has no {MANIFEST} (saved before checkpoints recorded checksums): loading it unverified")
            self.manifest = {}
        for name in sorted(n for n in self.manifest if owner(n, world) is None):
            if (found := check_file(self.folder, name, self.manifest[name])) is not None:
                raise damaged(self.folder, name, found)

    def _owned(self) -> list[str]:
        return sorted(n for n in self.manifest if owner(n, self.world) == self.rank)

    def seeds(self) -> dict[tuple[str, int], int]:
        """{(file, offset): running checksum before it} at every item edge of the files this rank
        checks: what a summing reader continues from (fastpaths.dcp_reader)."""
        return {(name, pos): value for name in self._owned() if by_items(name)
                for pos, value, _, _ in intervals(self.manifest[name])}

    def start(self, sums: Optional[dict[tuple[str, int], tuple[int, int]]] = None) -> None:
        """Begin checking beside the read. `sums`: the dict a summing reader fills during it (join()
        then checks item by item); without it, this rank's files are summed whole in a thread."""
        self._sums = sums
        mine = [n for n in self._owned() if sums is None or not by_items(n)]
        if mine:
            self._thread = threading.Thread(target=self._check, args=(mine,), name="ckpt-verify", daemon=True)
            self._thread.start()

    def _check(self, names: list[str]) -> None:
        try:
            for name in names:
                if (found := check_file(self.folder, name, self.manifest[name])) is not None:
                    self.error = damaged(self.folder, name, found)
                    return
        except Exception as err:  # noqa: BLE001 - e.g. a file that cannot be opened: the load fails with it
            self.error = err

    def join(self) -> Optional[BaseException]:
        """The damage found (CheckpointDamagedError) or why checking failed; None when all is intact."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._sums is not None and self.error is None:
            try:
                for name in self._owned():
                    if by_items(name) and (found := self._check_items(name)) is not None:
                        self.error = damaged(self.folder, name, found)
                        break
            except Exception as err:  # noqa: BLE001 - as in _check
                self.error = err
        self._sums = None
        return self.error

    def _check_items(self, name: str) -> Optional[tuple[str, Span]]:
        """File `name` item by item: the reader's sums where it read an item whole, the file's bytes
        (read once more, in order) for the rest."""
        want = self.manifest[name]
        path = self.folder / name
        if not path.is_file() or path.stat().st_size != want["size"]:
            return check_file(self.folder, name, want)  # says missing or which size
        with open(path, "rb", buffering=0) as f:
            for start, seed, stop, expected in intervals(want):
                length, value = self._sums.get((name, start), (None, None))
                if length != stop - start:
                    value = sum_range(f, start, stop, seed)
                if value != expected:
                    return f"checksum mismatch in bytes {start}..{stop}", (start, stop)
        return None


def share_load_failure(error: Optional[BaseException], what: str) -> None:
    """Collective after a load: if any rank failed, every rank raises; when some rank found damage,
    every rank raises CheckpointDamagedError naming all damage found (what other ranks tripped over
    reading those bytes is a symptom). One all-reduce when nothing failed."""
    try:
        raise_if_any_failed(error, what, error_type=CheckpointError)
    except Exception as raised:
        if lost_in_collective(raised):  # the agreement itself lost a peer: no further collective can complete
            raise
        found = gather_objects(str(error) if isinstance(error, CheckpointDamagedError) else None)
        texts = list(dict.fromkeys(t for t in found if t))  # distinct, in rank order
        if not texts:
            raise
        if isinstance(error, CheckpointDamagedError) and len(texts) == 1:
            raise
        raise mark_every_rank(CheckpointDamagedError("\n".join(texts))) from raised


# --- offline: `hybridpar verify PATH` ------------------------------------------------------------

def _structure(folder: Path) -> dict[str, Optional[str]]:
    """Without checksums: every file DCP's .metadata names, and what is wrong with it (None: it
    exists and holds every byte the metadata places in it)."""
    try:
        storage = read_dcp_metadata(folder / ".metadata").storage_data
    except UnsafePickleError as err:
        return {".metadata": err.reason}
    except Exception as err:  # noqa: BLE001 - any failure means .metadata is unusable
        return {".metadata": f"damaged: unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"}
    needed: dict[str, int] = {".metadata": 0, "params.json": 0, "train_state.json": 0}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    verdicts: dict[str, Optional[str]] = {}
    for name, end in sorted(needed.items()):
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        verdicts[name] = ("missing" if size is None else
                          f"damaged: truncated (size differs: {size} bytes, .metadata places data up to byte {end})"
                          if size < end else None)
    return verdicts


def _against_manifest(folder: Path, manifest: dict[str, dict], out: TextIO) -> dict[str, Optional[str]]:
    verdicts: dict[str, Optional[str]] = {}
    total = sum(int(want["size"]) for want in manifest.values())
    with Progress(f"verifying {folder}", total=total, unit="B", enabled=True) as progress:
        for name, want in sorted(manifest.items()):
            found = check_file(folder, name, want, progress.update)
            verdicts[name] = None if found is None else "missing" if found[0] == "missing" else f"damaged: {found[0]}"
            print(f"{name}: {verdicts[name] or 'ok'}", file=out, flush=True)
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST}
    for name in sorted(on_disk - manifest.keys()):
        verdicts[name] = "not in manifest"
        print(f"{name}: not in manifest", file=out)
    return verdicts


def verify_folder(folder: Path, out: Optional[TextIO] = None) -> int:
    """Check checkpoint `folder` in this process: a verdict line per file (to `out`, default stdout)
    and a summary; 0 when all are ok, 1 otherwise."""
    folder, out = Path(folder), out or sys.stdout
    if not folder.is_dir():
        print(f"{folder}: not a folder (give a checkpoint folder such as checkpoints/step-00000100)", file=out)
        return 1
    try:
        manifest = read_manifest(folder)
    except ValueError as err:
        print(f"{MANIFEST}: damaged: {err}", file=out)
        manifest, verdicts = None, {MANIFEST: "damaged"}
    else:
        verdicts = {}
    if manifest is None:
        if not verdicts:
            print(f"{folder}: no {MANIFEST} (saved before checkpoints recorded checksums): checking its structure "
                  "only (every file .metadata names is there, with all its bytes)", file=out)
        for name, verdict in _structure(folder).items():
            verdicts[name] = verdict
            print(f"{name}: {verdict or 'ok (size only: no checksum recorded)'}", file=out)
    else:
        verdicts.update(_against_manifest(folder, manifest, out))
        if verdicts.get(".metadata", "missing") is None:  # never unpickle damaged metadata
            for name, verdict in _structure(folder).items():
                if verdict is not None and verdicts.get(name) is None:
                    verdicts[name] = verdict
                    why = "" if verdict.startswith("refused") else " (the manifest agrees with the file: it was saved so)"
                    print(f"{name}: {verdict}{why}", file=out)
    bad = sorted(name for name, verdict in verdicts.items() if verdict is not None)
    summary = "all ok" if not bad else f"NOT OK: {', '.join(bad)}"
    print(f"{folder}: {len(verdicts) - len(bad)} of {len(verdicts)} files ok; {summary}", file=out)
    return 0 if not bad else 1


def verify_path(path: Path, out: Optional[TextIO] = None) -> int:
    """`hybridpar verify PATH`: one checkpoint folder, or a folder of them (a run's checkpoints/,
    step-NNNNNNNN each), every one checked and reported; 0 when all are ok, 1 otherwise."""
    path, out = Path(path), out or sys.stdout
    steps = sorted((p for p in path.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                   key=lambda p: p.name) if path.is_dir() and not (path / ".metadata").exists() else []
    if not steps:
        if path.is_dir() and not (path / ".metadata").exists() and not (path / MANIFEST).exists():
            # Nothing of a checkpoint at all: a wrong path, not a damaged checkpoint.
            raise ValueError(f"hybridpar verify {path}: not a checkpoint (no .metadata, no {MANIFEST}), nor a folder "
                             "of step-NNNNNNNN checkpoints, nor a token store; give one of those")
        return verify_folder(path, out)
    bad = [step.name for step in steps if verify_folder(step, out)]
    summary = "all ok" if not bad else f"NOT OK: {', '.join(bad)}"
    print(f"{path}: {len(steps) - len(bad)} of {len(steps)} checkpoints ok; {summary}", file=out)
    return 1 if bad else 0
