"""Preparing a token store, step by step in one order: where it goes and whether it is complete
already, its plan (unit_plan), the work on its units (workers, which builds each with
unit_build), its manifest (manifest_write), the store opened (token_store). Also the store of each of
a run's sources (a raw one's in the cache, or a store as given); `hybridpar prepare`'s arguments and
answer are hybridpar.cli.commands'."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Optional, Sequence

from hybridpar.config import MAX_BAD_RECORDS, MAX_DOCUMENT_BYTES
from hybridpar.data.formats import UNIT_BYTES, Unit
from hybridpar.data.sources import Input, Source, SourceFile, describe_input, source_name
from hybridpar.data.store.integrity import recheck_store
from hybridpar.data.store.manifest_write import finish_store, report_skipped, write_manifest
from hybridpar.data.store.token_store import DAMAGED, MANIFEST, PLAN, StoreError, TokenStore, given_store
from hybridpar.data.store.unit_plan import (Plan, cache_folder, check_part, damage_to_repair, default_workers,
                                            finished_store, part_of, plan_of, preparing, read_plan)
from hybridpar.data.store.workers import work_on
from hybridpar.files import PathLike
from hybridpar.progress import note

MIN_UNIT_MB = 1 / 64  # --unit-mb's floor, 16 KiB: below it a unit's files and record cost more than it spreads


def prepare_store(source: Source, tokenizer, out: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
                  on_bad_record: str = "error", workers: Optional[int] = None, part: tuple[int, int] = (0, 1),
                  report: Optional[bool] = None, unit_bytes: int = UNIT_BYTES, progress_every: float = 5.0,
                  on_progress: Optional[Callable[[str], None]] = None,
                  max_document_bytes: int = MAX_DOCUMENT_BYTES, max_bad_records: float = MAX_BAD_RECORDS
                  ) -> Optional[TokenStore]:
    """Tokenise `source` into the store `out` with `workers` processes (default: every core; 1: in
    this process), doing part `part` = (I, N) of it. Returns the store once it is complete; None when
    other parts are still to come (a part of several). Runs again where it stopped. Another
    preparation of the same input joins this one; one of other input is refused (unit_plan.preparing).
    `on_progress(text)` hears how far the work is, at least every few seconds while it moves (a
    training job's watchdog: a long preparation is progress, not a hang). A complete store is checked
    again, every chunk, and its damaged units are prepared again (integrity.recheck_store). A
    preparation refused for its input leaves nothing behind (unit_plan.discard_refused)."""
    return prepare(describe_input(source, text_field), tokenizer, out, val_fraction=val_fraction,
                   on_bad_record=on_bad_record, workers=workers, part=part, report=report, unit_bytes=unit_bytes,
                   progress_every=progress_every, on_progress=on_progress, max_document_bytes=max_document_bytes,
                   max_bad_records=max_bad_records)


def prepare(input: Input, tokenizer, out: Optional[PathLike] = None, *, cache_dir: Optional[PathLike] = None,
            val_fraction: float = 0.0, on_bad_record: str = "error", workers: Optional[int] = None,
            part: tuple[int, int] = (0, 1), report: Optional[bool] = None, unit_bytes: int = UNIT_BYTES,
            progress_every: float = 5.0, on_progress: Optional[Callable[[str], None]] = None,
            max_document_bytes: int = MAX_DOCUMENT_BYTES, max_bad_records: float = MAX_BAD_RECORDS
            ) -> Optional[TokenStore]:
    """prepare_store of an input (sources.describe_input) into `out`, or into its folder in
    `cache_dir` (unit_plan.cache_folder), where a complete one is used as it is: no source file
    opened, no plan made (unit_plan.finished_store), unless a job recorded damage in it
    (store.record_damage): then it is checked and repaired as `hybridpar prepare` of a complete
    store is, by one of the processes that ask at once, and the record removed."""
    from hybridpar.data.tokenizer import limit_threads

    index, parts = part
    check_part(index, parts)  # every check before anything is written
    if input.store is not None:
        raise ValueError(f"{input.store} is a token store already: train on it (data.source), or prepare raw files")
    options = dict(val_fraction=val_fraction, on_bad_record=on_bad_record, max_document_bytes=max_document_bytes)
    cached = cache_dir is not None
    folder = Path(out) if cache_dir is None else cache_folder(input, tokenizer.sha256, cache_dir, **options)
    with damage_to_repair(folder, on_progress) if cached else contextlib.nullcontext(False) as damaged:
        if cached and not damaged and finished_store(folder, input, tokenizer.sha256, **options):
            return TokenStore(folder, cached=True)
        plan = plan_of(input, tokenizer, folder, unit_bytes=unit_bytes, max_bad_records=max_bad_records, **options)
        limit_threads(tokenizer, 1)  # one thread per process: the workers (or a job's ranks) are the parallelism
        recheck_store(plan, workers=workers, report=report)
        with preparing(plan, own_folder=cached):
            mine = part_of(plan, index, parts)
            share = f" (part {index}/{parts}: {len(mine)} of {len(plan.units)} units)" if parts > 1 else ""
            work_on(plan, mine, tokenizer, workers=workers or default_workers(), wait=parts == 1, report=report,
                    progress_every=progress_every, on_progress=on_progress,
                    what=f"preparing {input.name} into the token store {folder}{share}")
            complete, written = finish_store(plan, input.name)
        if written is not None and report is not False:
            report_skipped(written)  # once, by the process that completed it
        if not complete:
            note(f"part {index}/{parts} of {folder} is done; the store is complete once every part is (the last "
                 f"part to finish writes its manifest, or: hybridpar prepare --merge --out {folder})", enabled=report)
            return None
        (folder / DAMAGED).unlink(missing_ok=True)  # checked and repaired: the next start uses it as it is
    return TokenStore(folder, cached=cached)


def stores_of(inputs: Sequence[Input], tokenizer, cache_dir: PathLike, *, val_fractions: Sequence[float],
              on_bad_record: str, max_document_bytes: int, max_bad_records: float = MAX_BAD_RECORDS,
              on_progress: Optional[Callable[[str], None]] = None) -> list[tuple[TokenStore, Optional[TokenStore]]]:
    """(training part, validation part or None) of each input, split by its val_fraction: a raw
    one's store in `cache_dir`, prepared here if it is not complete (every process that asks at once,
    the ranks of a job, takes units of it; later jobs reuse it), or the token store it names as given
    (store.given_store)."""
    stores = []
    for input, fraction in zip(inputs, val_fractions):
        if input.store is None:
            train = prepare(input, tokenizer, cache_dir=cache_dir, workers=1, val_fraction=fraction,
                            on_bad_record=on_bad_record, on_progress=on_progress,
                            max_document_bytes=max_document_bytes, max_bad_records=max_bad_records)
            stores.append((train, TokenStore(train.folder, "validation", cached=True) if fraction else None))
        else:
            stores.append(given_store(input.store, tokenizer, fraction))
    return stores


def merge_store(out: PathLike) -> TokenStore:
    """`hybridpar prepare --merge`: write the manifest of store `out` once every unit is done (any
    process may; the first writes it). Refuses naming the units still missing."""
    folder = Path(out)
    if not (folder / MANIFEST).is_file():
        data = read_plan(folder)
        if data is None:
            raise StoreError(f"{folder} is not a token store being prepared (no {PLAN}): run hybridpar prepare first")
        files = [SourceFile(f["kind"], Path(f["path"]) if f.get("path") else None) for f in data["sources"]["files"]]
        plan = Plan(folder, data, tuple(Unit(files[u["file"]], u["start"], u["stop"], u["bytes"]) for u in data["units"]))
        with preparing(plan):
            write_manifest(plan, source_name(files))
    return TokenStore(folder)


def cached_store(source: Source, tokenizer, cache_dir: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
                 on_bad_record: str = "error", report: Optional[bool] = None, progress_every: float = 5.0,
                 on_progress: Optional[Callable[[str], None]] = None, max_document_bytes: int = MAX_DOCUMENT_BYTES,
                 max_bad_records: float = MAX_BAD_RECORDS) -> tuple[TokenStore, Optional[TokenStore]]:
    """The store of `source` in `cache_dir` (named by a hash of the input, the tokenizer and the
    options), prepared here if it is not complete: every process that asks at once (the ranks of a
    job) takes units of it, and later jobs reuse it. (training part, validation part or None).
    A complete one is used as it is, no source file opened (unit_plan.finished_store)."""
    store = prepare(describe_input(source, text_field), tokenizer, cache_dir=cache_dir, workers=1,
                    val_fraction=val_fraction, on_bad_record=on_bad_record, report=report,
                    progress_every=progress_every, on_progress=on_progress, max_document_bytes=max_document_bytes,
                    max_bad_records=max_bad_records)
    return store, TokenStore(store.folder, "validation", cached=True) if val_fraction else None
