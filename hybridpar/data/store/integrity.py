"""`hybridpar verify STORE`: every chunk of every shard of a token store against its checksum and
the vocabulary, shards read in parallel (threads: file reads, CRC-32C and numpy's scans release the
GIL), with a progress line and one line per damage naming the file and the byte offset. And the
same check of a complete store that `hybridpar prepare` is asked to make again (recheck_store):
its damaged units are prepared again in place."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import crc32c
import numpy as np

from hybridpar.data.chunks import CHUNK_BYTES, chunk_damage, n_chunks, read_sums, sums_name
from hybridpar.data.store.token_store import MANIFEST, StoreError, damage_where, read_manifest, unit_record_name
from hybridpar.data.store.unit_build import written_record
from hybridpar.data.store.unit_plan import Plan, default_workers, read_plan
from hybridpar.files import PathLike
from hybridpar.progress import Progress, note

READ_CHUNKS = 128  # chunks read at a time (8 MiB): the disk keeps streaming
SHOWN = 10  # damaged chunks named per shard; the rest are counted


def check_shard(folder: Path, shard: dict, dtype: np.dtype, vocab_size: int, on_bytes=lambda n: None) -> list[str]:
    """The damage of one shard, a line each ([]: none)."""
    path = folder / shard["name"]
    if not path.is_file():
        return [f"{path}: missing"]
    size = path.stat().st_size
    if size != shard["size"]:
        return [f"{path}: {size} bytes, the manifest records {shard['size']}"]
    try:
        sums = read_sums(folder / sums_name(shard["name"]), size, shard["chunks_crc32c"])
    except ValueError as err:
        return [f"{path}: {err}"]
    found: list[str] = []
    buf = bytearray(READ_CHUNKS * CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        for first in range(0, n_chunks(size), READ_CHUNKS):
            n = f.readinto(buf)
            block = np.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)
            over_vocab = block.size and int(block.max()) >= vocab_size  # one scan a block: damage is rare
            for c, lo in zip(range(first, n_chunks(size)), range(0, n, CHUNK_BYTES)):
                if over_vocab or crc32c.crc32c(view[lo:lo + CHUNK_BYTES]) != sums[c]:
                    data = block[lo // dtype.itemsize:(lo + CHUNK_BYTES) // dtype.itemsize]
                    damage = chunk_damage(data, int(sums[c]), vocab_size)
                    if damage is not None:
                        found.append(damage_where(path, c * CHUNK_BYTES, data.nbytes, damage))
            on_bytes(n)
    if len(found) > SHOWN:
        found = found[:SHOWN] + [f"{path}: and {len(found) - SHOWN} more damaged chunks"]
    return found


def check_shards(folder: Path, shards: list[dict], dtype: np.dtype, vocab_size: int, what: str, *,
                 workers: Optional[int] = None, report: Optional[bool] = True, progress_every: float = 5.0,
                 on_damage: Callable[[dict, list[str]], None] = lambda shard, lines: None) -> int:
    """check_shard of every shard in threads, with a progress line `what`; `on_damage(shard, lines)`
    hears of each damaged one, in order. The number of damaged shards."""
    lock, bad = threading.Lock(), 0
    with Progress(what, total=sum(s["size"] for s in shards), unit="B", enabled=report,
                  every=progress_every) as progress:
        def on_bytes(n: int) -> None:
            with lock:
                progress.update(n)

        with concurrent.futures.ThreadPoolExecutor(min(workers or default_workers(), max(len(shards), 1))) as pool:
            for shard, lines in zip(shards, pool.map(lambda s: check_shard(folder, s, dtype, vocab_size, on_bytes),
                                                      shards)):
                if lines:
                    bad += 1
                    on_damage(shard, lines)
    return bad


def verify_store(folder: PathLike, out=None, workers: Optional[int] = None, progress_every: float = 5.0) -> int:
    """Check every chunk of a store: a line per damage and a summary; 0 when all is ok, 1 otherwise."""
    folder, out = Path(folder), out or sys.stdout
    try:
        manifest = read_manifest(folder)  # its counts and names are checked before any shard is opened
    except StoreError as err:
        print(f"{folder}: NOT OK: {err}", file=out)
        return 1
    shards = [s for part in manifest["parts"].values() for s in part["shards"]]

    def said(shard: dict, lines: list[str]) -> None:
        for line in lines:
            print(line, file=out, flush=True)

    bad = check_shards(folder, shards, np.dtype(manifest["dtype"]), int(manifest["vocab_size"]), f"verifying {folder}",
                       workers=workers, progress_every=progress_every, on_damage=said)
    summary = "all ok" if not bad else f"NOT OK: {bad} damaged or missing"
    print(f"{folder}: token store, {len(shards) - bad} of {len(shards)} shards ok, every chunk checked "
          f"({sum(p['tokens'] for p in manifest['parts'].values()):,} tokens); {summary}", file=out)
    return 0 if not bad else 1


def recheck_store(plan: Plan, *, workers: Optional[int] = None, report: Optional[bool] = True) -> None:
    """Before a complete store of `plan` is called complete again (the same `hybridpar prepare` run
    again, as every damage message advises): every chunk of every unit's shards checked, and where a
    unit is damaged (or its shards or record are missing, or the manifest is), the manifest and that
    unit's record removed, so that the preparation makes those units again, in place, and writes the
    manifest anew. Nothing to do for a store of other input (unit_plan.preparing refuses it)."""
    folder = plan.folder
    there = read_plan(folder)
    if not (folder / MANIFEST).is_file() or there is None or there.get("key") != plan.key:
        return
    records = [written_record(plan, i) for i in range(len(plan.units))]
    damaged = {i: [f"{folder / unit_record_name(i)}: missing"] for i, record in enumerate(records) if record is None}
    units = {shard["name"]: i for i, record in enumerate(records) if record for shard in record["shards"]}
    check_shards(folder, [s for record in records if record for s in record["shards"]], np.dtype(plan.data["dtype"]),
                 plan.data["vocab_size"], f"checking the complete store {folder}", workers=workers, report=report,
                 on_damage=lambda shard, lines: damaged.setdefault(units[shard["name"]], lines))
    try:
        read_manifest(folder)
        manifest = None
    except StoreError as err:
        manifest = str(err)
    if not damaged and manifest is None:
        return
    found = [line for i in sorted(damaged) for line in damaged[i]] + ([manifest] if manifest else [])
    note(f"{folder} is damaged ({found[0]}{f'; and {len(found) - 1} more' if len(found) > 1 else ''}): preparing "
         f"{len(damaged)} of its {len(records)} units again, and its manifest", enabled=report)
    (folder / MANIFEST).unlink()  # first: the store is unfinished while its units are made again
    for i in damaged:
        (folder / unit_record_name(i)).unlink(missing_ok=True)
