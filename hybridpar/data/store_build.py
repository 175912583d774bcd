"""Making a token store (hybridpar.data.store) from corpus files, on every core and every node.

The plan (the source files cut into units, formats.plan_units) fixes the store's token order.
Whoever prepares takes units one at a time, each under a lock of its own in the store folder, so
any number of processes can work on one store at once: the workers of `hybridpar prepare`, the
parts of a Slurm array (`--part I/N` takes a fixed share), the ranks of a training job. A unit is
done when its record is written, after its shards; a process killed at any moment leaves at most
unfinished units, which the next run redoes, and a lock the kernel releases with its holder. The
manifest is written last, by whoever finds every unit done (or by `--merge`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import crc32c
import numpy as np

from hybridpar.data.formats import (BAD_RECORD_CHOICES, MAX_DOCUMENT_BYTES, UNIT_BYTES, Tally, Unit, plan_units,
                                    unit_documents)
from hybridpar.data.sources import Source, SourceFile, describe_sources, resolve_sources, source_name
from hybridpar.data.store import (FORMAT, MANIFEST, MAX_SHARD_TOKENS, PLAN, VERSION, StoreError, TokenStore,
                                  shard_name, unit_record_name)
from hybridpar.data.tokenise import PART_NAMES, pieces, token_batches, token_dtype
from hybridpar.files import PathLike, atomic_output, file_lock, sha256_text, write_text_atomic
from hybridpar.progress import Progress

_POLL = 0.5  # seconds between looks at units other processes hold


@dataclasses.dataclass(frozen=True)
class Plan:
    folder: Path
    data: dict  # plan.json
    units: tuple[Unit, ...]

    @property
    def key(self) -> str:
        return self.data["key"]


def make_plan(source: Source, tokenizer, out: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
              on_bad_record: str = "error", unit_bytes: int = UNIT_BYTES,
              max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Plan:
    """The plan of a store of `source` tokenised by `tokenizer` in folder `out`, written to plan.json
    (or checked against the one there: a store folder holds one store)."""
    if on_bad_record not in BAD_RECORD_CHOICES:
        raise ValueError(f"data.on_bad_record must be one of {', '.join(BAD_RECORD_CHOICES)}, got {on_bad_record!r}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"the validation fraction must be in [0, 1), got {val_fraction}")
    if max_document_bytes < 1:
        raise ValueError(f"data.max_document_bytes (--max-document-bytes) must be at least 1, got {max_document_bytes}")
    eos_id, vocab_size = int(tokenizer.eos_id), int(tokenizer.vocab_size)
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"the tokenizer has no usable eos piece (eos_id {eos_id}); documents need one between them")
    files = resolve_sources(source)
    units = plan_units(files, text_field, unit_bytes)
    data = {"format": FORMAT + "-plan", "version": VERSION, "sources": describe_sources(files, text_field),
            "tokenizer_sha256": tokenizer.sha256, "tokenizer_path": str(getattr(tokenizer, "path", "")),
            "vocab_size": vocab_size, "eos_id": eos_id, "dtype": token_dtype(vocab_size).name,
            "text_field": text_field, "val_fraction": val_fraction, "on_bad_record": on_bad_record,
            "max_document_bytes": max_document_bytes,
            "units": [{"file": files.index(u.file), "start": u.start, "stop": u.stop, "bytes": u.nbytes} for u in units]}
    data["key"] = sha256_text(json.dumps(data, sort_keys=True))[:16]
    folder = Path(out)
    existing = folder / PLAN
    other = json.loads(existing.read_text()) if existing.is_file() else {}
    if other.get("key") != data["key"]:
        if (folder / MANIFEST).is_file():  # a complete store is never replaced
            differs = [k for k in ("sources", "tokenizer_sha256", "text_field", "val_fraction", "on_bad_record",
                                   "max_document_bytes")
                       if other.get(k) != data[k]] or ["the units"]
            raise StoreError(f"{folder} holds a store of other input ({', '.join(differs)} differ): give another "
                             f"--out, or delete {folder} to prepare it anew")
        # Nothing there, or an unfinished store of other input: its unit records name the old plan and
        # are not reused.
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(existing, json.dumps(data, indent=1) + "\n")
    return Plan(folder, data, tuple(units))


def part_of(plan: Plan, part: int, parts: int) -> list[int]:
    """The units of part `part` of `parts`: the largest first to the part with the least input so far."""
    if not 0 <= part < parts:
        raise ValueError(f"--part {part}/{parts}: the part must be in 0..{parts - 1}")
    loads, mine = [0] * parts, []
    for i in sorted(range(len(plan.units)), key=lambda i: (-plan.units[i].nbytes, i)):
        target = loads.index(min(loads))
        loads[target] += plan.units[i].nbytes
        if target == part:
            mine.append(i)
    return sorted(mine)


# --- one unit ------------------------------------------------------------------------------------

def _record(plan: Plan, index: int) -> Optional[dict]:
    """Unit `index`'s record if the unit is done (its shards there, at their sizes), else None."""
    path = plan.folder / unit_record_name(index)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("plan") != plan.key:
        return None
    for shard in record["shards"]:
        shard_path = plan.folder / shard["name"]
        if not shard_path.is_file() or shard_path.stat().st_size != shard["size"]:
            return None
    return record


class _ShardWriter:
    """A unit's shards of one part: atomic files of at most MAX_SHARD_TOKENS, summed as written."""

    def __init__(self, folder: Path, unit: int, part: int) -> None:
        self.folder, self.unit, self.part = folder, unit, part
        self.shards: list[dict] = []
        self._context = self._file = None

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._file is None:
                name = shard_name(self.unit, self.part, len(self.shards))
                self._context = atomic_output(self.folder / name, "wb")
                self._file = self._context.__enter__()
                self.shards.append({"name": name, "part": PART_NAMES[self.part], "tokens": 0, "size": 0, "crc32c": 0})
            shard = self.shards[-1]
            take = ids[: MAX_SHARD_TOKENS - shard["tokens"]]
            data = take.tobytes()
            self._file.write(data)
            shard["tokens"] += int(take.size)
            shard["size"] += len(data)
            shard["crc32c"] = crc32c.crc32c(data, shard["crc32c"])
            ids = ids[take.size:]
            if shard["tokens"] >= MAX_SHARD_TOKENS:
                self._close()

    def _close(self, error: Optional[BaseException] = None) -> None:
        if self._context is not None:
            context, self._context, self._file = self._context, None, None
            context.__exit__(type(error) if error else None, error, None)

    def finish(self, error: Optional[BaseException] = None) -> list[dict]:
        self._close(error)
        return self.shards


def build_unit(plan: Plan, index: int, tokenizer, on_bytes=None, on_tokens=None) -> dict:
    """Tokenise unit `index` into its shards, then write its record (the unit is done). Its record.
    `on_bytes(n)` hears of input read, `on_tokens(n)` of each batch of tokens made."""
    data, unit = plan.data, plan.units[index]
    dtype, vocab_size = np.dtype(data["dtype"]), data["vocab_size"]
    tally = Tally()
    writers = [_ShardWriter(plan.folder, index, part) for part in range(2 if data["val_fraction"] else 1)]
    tokens, documents = [0] * len(writers), [0] * len(writers)
    try:
        documents_in = unit_documents(unit, data["text_field"], data["on_bad_record"], tally, on_bytes,
                                      data["max_document_bytes"])
        for batch in token_batches(pieces(documents_in, data["val_fraction"]), tokenizer):
            for part, (ids, ended) in batch.items():
                if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                    raise ValueError(f"the tokenizer produced id {bad}, outside its vocab of {vocab_size}")
                writers[part].write(ids.astype(dtype))
                tokens[part] += int(ids.size)
                documents[part] += ended
                if on_tokens is not None:
                    on_tokens(int(ids.size))
    except BaseException as err:
        for writer in writers:
            writer.finish(err)
        raise
    record = {"plan": plan.key, "unit": index, "file": data["units"][index]["file"], "tokens": tokens,
              "documents": documents, "skipped": tally.skipped,
              "shards": [s for w in writers for s in w.finish()]}
    write_text_atomic(plan.folder / unit_record_name(index), json.dumps(record) + "\n")
    return record


def _claim_and_build(plan: Plan, index: int, tokenizer, on_bytes=None, on_tokens=None) -> Optional[dict]:
    """Build unit `index` unless it is done or another process holds it: its record, or None."""
    lock = plan.folder / (unit_record_name(index) + ".lock")
    try:
        with file_lock(lock, timeout=0, purpose="preparing a unit"):
            return _record(plan, index) or build_unit(plan, index, tokenizer, on_bytes, on_tokens)
    except TimeoutError:
        return None


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
                  report: Optional[bool] = None, unit_bytes: int = UNIT_BYTES, progress_every: float = 5.0, on_progress: Optional[Callable[[str], None]] = None,
                  max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Optional[TokenStore]:
    """Tokenise `source` into the store `out` with `workers` processes (default: every core; 1: in
    this process), doing part `part` = (I, N) of it. Returns the store once it is complete; None when
    other parts are still to come (a part of several). Runs again where it stopped.
    `on_progress(text)` hears how far the work is, at least every few seconds while it moves (a
    training job's watchdog: a long preparation is progress, not a hang)."""
    from hybridpar.data.tokenizer import limit_threads

    started = time.time()
    plan = make_plan(source, tokenizer, out, text_field=text_field, val_fraction=val_fraction,
                     on_bad_record=on_bad_record, unit_bytes=unit_bytes, max_document_bytes=max_document_bytes)
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


def merge_store(out: PathLike) -> TokenStore:
    """Write the manifest of store `out` once every unit is done (any process may call it; the
    first writes it). Refuses naming the units still missing."""
    folder = Path(out)
    if not (folder / PLAN).is_file():
        raise StoreError(f"{folder} is not a token store being prepared (no {PLAN}): run hybridpar prepare first")
    with file_lock(folder / (MANIFEST + ".lock"), purpose="writing the manifest"):
        if (folder / MANIFEST).is_file():
            return TokenStore(folder)
        data = json.loads((folder / PLAN).read_text())
        files = [SourceFile(f["kind"], Path(f["path"]) if f.get("path") else None) for f in data["sources"]["files"]]
        plan = Plan(folder, data, tuple(Unit(files[u["file"]], u["start"], u["stop"], u["bytes"]) for u in data["units"]))
        records = [_record(plan, i) for i in range(len(plan.units))]
        missing = [i for i, r in enumerate(records) if r is None]
        if missing:
            shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise StoreError(f"{folder}: {len(missing)} of {len(records)} units are not prepared yet (units {shown}): "
                             "run the parts that hold them (hybridpar prepare ... --part I/N) until each finishes")
        _check_sources(data, files)
        manifest = _manifest(data, records, source_name(files))
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return TokenStore(folder)


def report_skipped(store: TokenStore) -> None:
    """One line per source file whose bad records were skipped (data.on_bad_record = "skip")."""
    from hybridpar.progress import note

    for f in store.meta["files"]:
        if f["skipped"]:
            note(f"{f['path']}: {f['skipped']:,} bad records skipped (no text, not a string, or over "
                 f"data.max_document_bytes) of {f['skipped'] + f['documents']:,}")


def _check_sources(data: dict, files: list[SourceFile]) -> None:
    """The input must not have changed while the store was made: sizes and mtimes as planned."""
    for described, f in zip(data["sources"]["files"], files):
        if f.path is None:
            continue
        st = f.path.stat() if f.path.exists() else None
        if st is None or st.st_size != described["size"] or st.st_mtime_ns != described["mtime_ns"]:
            raise StoreError(f"{f.path} changed while the store was being prepared: delete the store folder and "
                             "prepare it again")


def _manifest(data: dict, records: list[dict], name: str) -> dict:
    files = [{**f, "documents": 0, "tokens": 0, "skipped": 0} for f in data["sources"]["files"]]
    parts = {part: {"tokens": 0, "documents": 0, "shards": []} for part in PART_NAMES[: 2 if data["val_fraction"] else 1]}
    for record in records:
        described = files[record["file"]]
        described["documents"] += sum(record["documents"])
        described["tokens"] += sum(record["tokens"])
        described["skipped"] += record["skipped"]
        for p, part in enumerate(parts):
            parts[part]["tokens"] += record["tokens"][p]
            parts[part]["documents"] += record["documents"][p]
        for shard in record["shards"]:
            parts[shard["part"]]["shards"].append({k: shard[k] for k in ("name", "tokens", "size", "crc32c")})
    if sum(p["tokens"] for p in parts.values()) == 0:
        raise StoreError(f"no tokens: the data source {name} holds no text")
    total = sum(p["documents"] for p in parts.values())
    for part, p in parts.items():
        if data["val_fraction"] and p["tokens"] == 0:
            change = "raise it, or name a held-out data.val_source" if part == "validation" else "lower it"
            raise StoreError(f"data.val_fraction = {data['val_fraction']} put {'none' if part == 'validation' else 'all'} "
                             f"of the {total} documents of {name} in validation: {change}")
    return {"format": FORMAT, "version": VERSION, "plan": data["key"],
            **{k: data[k] for k in ("dtype", "vocab_size", "eos_id", "tokenizer_sha256", "tokenizer_path",
                                    "text_field", "val_fraction", "on_bad_record")},
            "files": files, "parts": parts}


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
                          unit_bytes=max(1, int(args.unit_mb * 2**20)), max_document_bytes=args.max_document_bytes)
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
    job) takes units of it, and later jobs reuse it. (training part, validation part or None)."""
    files = resolve_sources(source)
    key = {"source": describe_sources(files, text_field), "tokenizer": tokenizer.sha256, "version": VERSION,
           "val_fraction": val_fraction, "on_bad_record": on_bad_record, "max_document_bytes": max_document_bytes}
    folder = Path(cache_dir) / f"store-{sha256_text(json.dumps(key, sort_keys=True))[:16]}"
    store = prepare_store(source, tokenizer, folder, text_field=text_field, val_fraction=val_fraction,
                          on_bad_record=on_bad_record, workers=1, report=report, progress_every=progress_every,
                          on_progress=on_progress, max_document_bytes=max_document_bytes)
    return store, TokenStore(folder, "validation") if val_fraction else None

