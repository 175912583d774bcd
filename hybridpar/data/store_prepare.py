"""Preparing a token store: workers (processes of this host), parts (--part I/N of a Slurm array),
waiting for units that other processes hold, progress, and the `hybridpar prepare` command."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from hybridpar.data.formats import UNIT_BYTES
from hybridpar.data.sources import Source, describe_sources, resolve_sources, source_name
from hybridpar.data.store import MANIFEST, VERSION, TokenStore, unit_record_name
from hybridpar.data.store_build import _claim_and_build, _record, merge_store, report_skipped
from hybridpar.data.store_plan import Plan, make_plan, part_of
from hybridpar.files import PathLike, sha256_text
from hybridpar.progress import Progress

_POLL = 0.5  # seconds between looks at units other processes hold


# --- worker processes ----------------------------------------------------------------------------

_WORKER: dict = {}


def _worker_init(plan: Plan, tokenizer) -> None:
    from hybridpar.data.tokenizer import limit_threads

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    limit_threads(1)  # the workers are the parallelism
    _WORKER.update(plan=plan, tokenizer=tokenizer)


def _worker_unit(index: int) -> tuple[int, Optional[dict]]:
    return index, _claim_and_build(_WORKER["plan"], index, _WORKER["tokenizer"])


def default_workers() -> int:
    """Every core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --- the whole store -----------------------------------------------------------------------------

def prepare_store(source: Source, tokenizer, out: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
                  on_bad_record: str = "error", workers: Optional[int] = None, part: tuple[int, int] = (0, 1),
                  report: Optional[bool] = None, unit_bytes: int = UNIT_BYTES, progress_every: float = 5.0, on_progress: Optional[Callable[[str], None]] = None
                  ) -> Optional[TokenStore]:
    """Tokenise `source` into the store `out` with `workers` processes (default: every core; 1: in
    this process), doing part `part` = (I, N) of it. Returns the store once it is complete; None when
    other parts are still to come (a part of several). Runs again where it stopped.
    `on_progress(text)` hears how far the work is, at least every few seconds while it moves (a
    training job's watchdog: a long preparation is progress, not a hang)."""
    from hybridpar.data.tokenizer import limit_threads

    started = time.time()
    plan = make_plan(source, tokenizer, out, text_field=text_field, val_fraction=val_fraction,
                     on_bad_record=on_bad_record, unit_bytes=unit_bytes)
    limit_threads(1)  # one tokenizer thread per process: the workers (or a job's ranks) are the parallelism
    if (plan.folder / MANIFEST).is_file():
        return TokenStore(plan.folder)
    index, parts = part
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
    if all(_record(plan, i) is not None for i in range(len(plan.units))):
        store = merge_store(plan.folder)
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
        self._tell()

    def _tell(self) -> None:
        now = time.monotonic()
        if self._on_progress is not None and now - self._told >= 1.0:
            self._told = now
            self._on_progress(f"preparing data, {self.done / max(self.total or 1, 1):.1%} of the input, "
                              f"{self.rates['tokens']:,.0f} tokens made here")


def _build(plan: Plan, todo: list[int], tokenizer, workers: int, progress: "_StoreProgress") -> None:
    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            seen = [0]

            def on_bytes(n: int) -> None:
                seen[0] += n
                progress.update(n)

            record = _claim_and_build(plan, i, tokenizer, on_bytes, progress.made)
            planned = (plan.units[i].nbytes if record is not None else 0) - seen[0]  # what the reads did not count
            if planned:
                progress.update(planned)
        return

    def done(i: int, record: Optional[dict]) -> None:
        progress.update(plan.units[i].nbytes if record is not None else 0)
        if record is not None:
            progress.made(sum(record["tokens"]))

    context = multiprocessing.get_context("spawn")  # no fork: the caller may hold threads (a training job)
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=context,
                                                initializer=_worker_init, initargs=(plan, tokenizer)) as pool:
        for future in concurrent.futures.as_completed([pool.submit(_worker_unit, i) for i in todo]):
            done(*future.result())


def _wait_for_others(plan: Plan, units: Sequence[int], tokenizer, progress: "_StoreProgress") -> None:
    """Until every unit of `units` is done: units another process holds are waited for; one whose
    holder died (its lock released, no record) is built here."""
    while True:
        left = [i for i in units if _record(plan, i) is None]
        if not left:
            return
        for i in left:
            _claim_and_build(plan, i, tokenizer, on_tokens=progress.made)  # built here if its holder died
        # every unit recorded so far counts, whoever made it
        progress.update(sum(plan.units[i].nbytes for i in units if (plan.folder / unit_record_name(i)).is_file())
                        - progress.done)
        time.sleep(_POLL)


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
    if args.workers < 0:
        raise ValueError(f"--workers {args.workers}: give a number of processes, or 0 for every core")
    store = prepare_store(list(args.sources), Tokenizer(args.tokenizer), args.out, text_field=args.text_field,
                          val_fraction=args.val_fraction, on_bad_record=args.on_bad_record,
                          workers=args.workers or None, part=(index, parts), report=True,
                          unit_bytes=max(1, int(args.unit_mb * 2**20)))
    if store is not None:
        print(f"{store.folder}: complete, {store.n_tokens:,} tokens in {store.n_documents:,} documents"
              f"; train on it with --data.source {store.folder}")
    return 0


def cached_store(source: Source, tokenizer, cache_dir: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
                 on_bad_record: str = "error", report: Optional[bool] = None, progress_every: float = 5.0,
                 on_progress: Optional[Callable[[str], None]] = None) -> tuple[TokenStore, Optional[TokenStore]]:
    """The store of `source` in `cache_dir` (named by a hash of the input, the tokenizer and the
    options), prepared here if it is not complete: every process that asks at once (the ranks of a
    job) takes units of it, and later jobs reuse it. (training part, validation part or None)."""
    files = resolve_sources(source)
    key = {"source": describe_sources(files, text_field), "tokenizer": tokenizer.sha256, "version": VERSION,
           "val_fraction": val_fraction, "on_bad_record": on_bad_record}
    folder = Path(cache_dir) / f"store-{sha256_text(json.dumps(key, sort_keys=True))[:16]}"
    store = prepare_store(source, tokenizer, folder, text_field=text_field, val_fraction=val_fraction,
                          on_bad_record=on_bad_record, workers=1, report=report, progress_every=progress_every,
                          on_progress=on_progress)
    return store, TokenStore(folder, "validation") if val_fraction else None

