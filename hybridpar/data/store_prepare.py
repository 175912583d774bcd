"""Preparing a token store: workers (processes of this host), parts (--part I/N of a Slurm array),
waiting for units that other processes hold, progress, and the `hybridpar prepare` command."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import queue
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from hybridpar.config import MAX_DOCUMENT_BYTES
from hybridpar.data.formats import UNIT_BYTES
from hybridpar.data.sources import Source, SourceFile, describe_sources, resolve_sources, source_name
from hybridpar.data.store import MANIFEST, PLAN, VERSION, StoreError, TokenStore
from hybridpar.data.store_build import _claim_and_build, _record, merge_store, report_skipped, unit_holder
from hybridpar.data.store_plan import Plan, check_part, part_of, plan_of, preparing, read_plan
from hybridpar.files import PathLike, sha256_text
from hybridpar.progress import Progress, note

_POLL = 0.5  # seconds between looks at units other processes hold
_TELL_EVERY = 0.5  # seconds between a worker's words on what it read and made inside a unit
# A preparation waiting for units that other processes hold (they are alive: their locks are held)
# says which and who every SAY_WAITING_EVERY seconds, and gives up once none of them has finished
# for WAIT_WITHOUT_PROGRESS seconds (a 64 MB unit takes a minute or two; docs/data.md).
SAY_WAITING_EVERY = 30.0
MIN_UNIT_MB = 1 / 64  # --unit-mb's floor, 16 KiB: below it a unit's files and record cost more than it spreads
WAIT_WITHOUT_PROGRESS = 1800.0


# --- worker processes ----------------------------------------------------------------------------

_WORKER: dict = {}


def _worker_init(plan: Plan, tokenizer, heard) -> None:
    from hybridpar.data.tokenizer import limit_threads

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    limit_threads(1)  # the workers are the parallelism
    _WORKER.update(plan=plan, tokenizer=tokenizer, heard=heard)


def _worker_unit(index: int) -> tuple[int, Optional[dict]]:
    """Build unit `index`, telling the parent (the queue `heard`) of bytes read and tokens made as
    they come, at most every _TELL_EVERY seconds: a unit can take minutes."""
    heard, counts, told = _WORKER["heard"], [0, 0], [time.monotonic()]

    def count(which: int, n: int) -> None:
        counts[which] += n
        if time.monotonic() - told[0] >= _TELL_EVERY:
            tell()

    def tell() -> None:
        if counts != [0, 0]:
            heard.put((index, *counts))
            counts[:] = [0, 0]
        told[0] = time.monotonic()

    try:
        return index, _claim_and_build(_WORKER["plan"], index, _WORKER["tokenizer"],
                                       lambda n: count(0, n), lambda n: count(1, n))
    finally:
        tell()


def default_workers() -> int:
    """Every core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --- the whole store -----------------------------------------------------------------------------

def prepare_store(source: Source, tokenizer, out: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
                  on_bad_record: str = "error", workers: Optional[int] = None, part: tuple[int, int] = (0, 1),
                  report: Optional[bool] = None, unit_bytes: int = UNIT_BYTES, progress_every: float = 5.0,
                  on_progress: Optional[Callable[[str], None]] = None,
                  max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Optional[TokenStore]:
    """Tokenise `source` into the store `out` with `workers` processes (default: every core; 1: in
    this process), doing part `part` = (I, N) of it. Returns the store once it is complete; None when
    other parts are still to come (a part of several). Runs again where it stopped. Another
    preparation of the same input joins this one; one of other input is refused (store_plan.preparing).
    `on_progress(text)` hears how far the work is, at least every few seconds while it moves (a
    training job's watchdog: a long preparation is progress, not a hang)."""
    from hybridpar.data.tokenizer import limit_threads

    started = time.time()
    index, parts = part
    check_part(index, parts)  # every check before anything is written
    plan = plan_of(source, tokenizer, out, text_field=text_field, val_fraction=val_fraction,
                   on_bad_record=on_bad_record, unit_bytes=unit_bytes, max_document_bytes=max_document_bytes)
    limit_threads(1)  # one tokenizer thread per process: the workers (or a job's ranks) are the parallelism
    with preparing(plan):
        if (plan.folder / MANIFEST).is_file():
            return TokenStore(plan.folder)
        mine = part_of(plan, index, parts)
        todo = [i for i in mine if _record(plan, i) is None]
        share = f" (part {index}/{parts}: {len(mine)} of {len(plan.units)} units)" if parts > 1 else ""
        progress = _StoreProgress(plan, mine, report, progress_every, on_progress)
        progress.done = sum(plan.units[i].nbytes for i in mine if i not in todo)
        if todo:
            done_before = len(mine) - len(todo)
            progress.note(f"preparing {source_name(resolve_sources(source))} into the token store {plan.folder}{share}"
                          + (f"; {done_before} units were done before" if done_before else ""))
        with progress:
            _build(plan, todo, tokenizer, workers or default_workers(), progress)
            if parts == 1:
                _wait_for_others(plan, mine, tokenizer, progress)
            progress.summary = f"{progress.rates['tokens']:,.0f} tokens"
        store = merge_store(plan.folder) if all(_record(plan, i) is not None for i in range(len(plan.units))) else None
    if store is not None:
        if report is not False and not (plan.folder / MANIFEST).stat().st_mtime < started:
            report_skipped(store)  # once, by the process that completed it
        return store
    if parts > 1:
        progress.note(f"part {index}/{parts} of {plan.folder} is done; the store is complete once every part is "
                      f"(the last part to finish writes its manifest, or: hybridpar prepare --merge --out {plan.folder})")
    return None


class _StoreProgress(Progress):
    """Bytes of a share's units done (by this process or another), tokens/s, and a word to
    `on_progress` whenever the count moves (throttled)."""

    def __init__(self, plan: Plan, units: Sequence[int], report: Optional[bool], every: float,
                 on_progress: Optional[Callable[[str], None]]) -> None:
        super().__init__(f"preparing {plan.folder}", total=sum(plan.units[i].nbytes for i in units), unit="B",
                         enabled=report, every=every)
        self.rates["tokens"] = 0
        self._on_progress, self._told = on_progress, 0.0

    def update(self, amount: float = 1) -> None:
        super().update(amount)
        self._tell()

    def made(self, tokens: int) -> None:
        """Tokens made here: they move the work on even inside one long unit."""
        self.rates["tokens"] += tokens
        if self.done < (self.total or 0):  # a line is due even when no byte was counted (bytes are told late)
            self.update(0)
        else:
            self._tell()

    def _tell(self) -> None:
        now = time.monotonic()
        if self._on_progress is not None and now - self._told >= 1.0:
            self._told = now
            self._on_progress(f"preparing data, {self.done / max(self.total or 1, 1):.1%} of the input, "
                              f"{self.rates['tokens']:,.0f} tokens made here")


def _build(plan: Plan, todo: list[int], tokenizer, workers: int, progress: "_StoreProgress") -> None:
    """Build the units `todo` (those another process holds are left to it), in this process or in
    `workers` processes; bytes read count as they are read, and a unit done counts whole."""
    seen: dict[int, int] = {}
    closed: set[int] = set()  # units counted whole: a worker's word arriving after its result adds no bytes

    def read(i: int, n: int) -> None:
        if i not in closed:
            seen[i] = seen.get(i, 0) + n
            progress.update(n)

    def done(i: int, record: Optional[dict]) -> None:
        closed.add(i)
        planned = (plan.units[i].nbytes if record is not None else 0) - seen.pop(i, 0)  # what the reads did not count
        if planned:
            progress.update(planned)

    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            done(i, _claim_and_build(plan, i, tokenizer, lambda n, i=i: read(i, n), progress.made))
        return

    context = multiprocessing.get_context("spawn")  # no fork: the caller may hold threads (a training job)
    heard = context.Queue()

    def drain() -> None:
        while True:
            try:
                i, nbytes, tokens = heard.get_nowait()
            except queue.Empty:
                return
            read(i, nbytes)
            progress.made(tokens)

    with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=context,
                                                initializer=_worker_init, initargs=(plan, tokenizer, heard)) as pool:
        pending = {pool.submit(_worker_unit, i) for i in todo}
        while pending:
            finished, pending = concurrent.futures.wait(pending, timeout=_TELL_EVERY,
                                                        return_when=concurrent.futures.FIRST_COMPLETED)
            drain()
            for future in finished:
                done(*future.result())
    drain()


def _wait_for_others(plan: Plan, units: Sequence[int], tokenizer, progress: "_StoreProgress") -> None:
    """Until every unit of `units` is done: units another process holds are waited for, said every
    SAY_WAITING_EVERY s (which, and who holds them); one whose holder died (its lock released, no
    record) is built here. Gives up, in one line, when none has finished in WAIT_WITHOUT_PROGRESS s."""
    left = [i for i in units if _record(plan, i) is None]
    moved = said = time.monotonic()
    while left:
        for i in left:
            _claim_and_build(plan, i, tokenizer, on_tokens=progress.made)  # built here if its holder died
        still = [i for i in left if _record(plan, i) is None]
        progress.update(sum(plan.units[i].nbytes for i in left if i not in still))
        now = time.monotonic()
        moved = now if len(still) < len(left) else moved
        left = still
        if not left:
            return
        if (read_plan(plan.folder) or {}).get("key") != plan.key:
            raise StoreError(f"{plan.folder / PLAN} changed while this process waited for units of it: another "
                             "preparation replaced it; run this one again")
        if now - moved >= WAIT_WITHOUT_PROGRESS:
            raise StoreError(f"{plan.folder}: waited {now - moved:.0f} s for {_held(plan, left)}, and none finished: "
                             "if those processes are stuck, stop them and run again (it goes on where it stopped)")
        if now - said >= SAY_WAITING_EVERY:
            said = now
            note(f"{plan.folder}: waiting for {_held(plan, left)} ({now - moved:.0f} s without one finishing; "
                 f"gives up after {WAIT_WITHOUT_PROGRESS:.0f} s)", enabled=progress.enabled)
        time.sleep(_POLL)


def _held(plan: Plan, units: Sequence[int]) -> str:
    """'units 3, 5 held by host pid 12 (3), host pid 14 (5)': the holders their lock files name."""
    holders: dict[str, list[int]] = {}
    for i in units:
        holders.setdefault(unit_holder(plan, i) or "another process", []).append(i)
    shown = ", ".join(str(i) for i in units[:10]) + (" ..." if len(units) > 10 else "")
    return f"unit{'s' if len(units) > 1 else ''} {shown} held by " + "; ".join(
        f"{who} ({', '.join(str(i) for i in held[:5])}{' ...' if len(held) > 5 else ''})" for who, held in holders.items())


def prepare_command(args) -> int:
    """`hybridpar prepare`: args as cli.py parses them."""
    from hybridpar.data.tokenizer import Tokenizer

    if args.merge:
        store = merge_store(args.out)
        print(f"{store.folder}: complete, {store.n_tokens:,} tokens")
        return 0
    if not args.sources or not args.tokenizer:
        raise ValueError("hybridpar prepare needs the source files or folders and --tokenizer (or --merge --out STORE)")
    try:
        index, parts = (int(x) for x in args.part.split("/"))
    except ValueError:
        raise ValueError(f"--part {args.part}: give I/N, e.g. --part 0/4 for the first of four parts") from None
    check_part(index, parts)
    if args.workers < 0:
        raise ValueError(f"--workers {args.workers}: give a number of processes, or 0 for every core")
    if not args.unit_mb >= MIN_UNIT_MB:  # (NaN too)
        raise ValueError(f"--unit-mb {args.unit_mb:g}: give at least {MIN_UNIT_MB} (16 KiB): smaller units cost more "
                         "in files and bookkeeping than they spread work (the default, 64, suits most corpora)")
    store = prepare_store(list(args.sources), Tokenizer(args.tokenizer), args.out, text_field=args.text_field,
                          val_fraction=args.val_fraction, on_bad_record=args.on_bad_record,
                          workers=args.workers or None, part=(index, parts), report=True,
                          unit_bytes=int(args.unit_mb * 2**20), max_document_bytes=args.max_document_bytes)
    if store is not None:
        print(f"{store.folder}: complete, {store.n_tokens:,} tokens in {store.n_documents:,} documents"
              f"; train on it with --data.source {store.folder}")
    return 0


def cached_store(source: Source, tokenizer, cache_dir: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
                 on_bad_record: str = "error", report: Optional[bool] = None, progress_every: float = 5.0,
                 on_progress: Optional[Callable[[str], None]] = None, max_document_bytes: int = MAX_DOCUMENT_BYTES
                 ) -> tuple[TokenStore, Optional[TokenStore]]:
    """The store of `source` in `cache_dir` (named by a hash of the input, the tokenizer and the
    options), prepared here if it is not complete: every process that asks at once (the ranks of a
    job) takes units of it, and later jobs reuse it. (training part, validation part or None).
    A complete one is used as it is, no source file opened (finished_store)."""
    files = resolve_sources(source)
    options = dict(text_field=text_field, val_fraction=val_fraction, on_bad_record=on_bad_record,
                   max_document_bytes=max_document_bytes)
    folder = cache_folder(files, tokenizer.sha256, cache_dir, **options)
    store = finished_store(folder, files, tokenizer.sha256, **options)
    if store is None:
        store = prepare_store(source, tokenizer, folder, workers=1, report=report, progress_every=progress_every,
                              on_progress=on_progress, **options)
    return store, TokenStore(folder, "validation") if val_fraction else None


def cache_folder(files: Sequence[SourceFile], tokenizer_sha256: str, cache_dir: PathLike, *, text_field: str,
                 val_fraction: float, on_bad_record: str, max_document_bytes: int) -> Path:
    """Where cached_store keeps the store of `files` (resolve_sources'): named by a hash of their
    description (paths, sizes, mtimes), the tokenizer and the options, so an edited file makes a new one."""
    key = {"source": describe_sources(files, text_field), "tokenizer": tokenizer_sha256, "version": VERSION,
           "val_fraction": val_fraction, "on_bad_record": on_bad_record, "max_document_bytes": max_document_bytes}
    return Path(cache_dir) / f"store-{sha256_text(json.dumps(key, sort_keys=True))[:16]}"


def finished_store(folder: PathLike, files: Sequence[SourceFile], tokenizer_sha256: str, *, text_field: str,
                   val_fraction: float, on_bad_record: str, max_document_bytes: int) -> Optional[TokenStore]:
    """The complete store in `folder` if its plan.json records exactly this input: each of `files`
    with the path, size and mtime a stat gives now (no source file is opened, and no plan is made),
    this tokenizer and these options. Else None: prepare_store then makes, finishes or refuses it."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return None
    made = read_plan(folder) or {}
    wanted = {"version": VERSION, "sources": describe_sources(files, text_field), "tokenizer_sha256": tokenizer_sha256,
              "text_field": text_field, "val_fraction": val_fraction, "on_bad_record": on_bad_record,
              "max_document_bytes": max_document_bytes}
    if any(made.get(key) != value for key, value in wanted.items()):
        return None
    return TokenStore(folder)
