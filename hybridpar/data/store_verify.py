"""`hybridpar verify STORE`: every chunk of every shard of a token store against its checksum and
the vocabulary, shards read in parallel (threads: file reads, CRC-32C and numpy's scans release the
GIL), with a progress line and one line per damage naming the file and the byte offset."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from pathlib import Path
from typing import Optional

import crc32c
import numpy as np

from hybridpar.data.chunks import CHUNK_BYTES, chunk_damage, n_chunks, read_sums, sums_name
from hybridpar.data.store import StoreError, damage_where, read_manifest
from hybridpar.files import PathLike
from hybridpar.progress import Progress

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


def verify_store(folder: PathLike, out=None, workers: Optional[int] = None, progress_every: float = 5.0) -> int:
    """Check every chunk of a store: a line per damage and a summary; 0 when all is ok, 1 otherwise."""
    from hybridpar.data.store_prepare import default_workers

    folder, out = Path(folder), out or sys.stdout
    try:
        manifest = read_manifest(folder)  # its counts and names are checked before any shard is opened
    except StoreError as err:
        print(f"{folder}: NOT OK: {err}", file=out)
        return 1
    shards = [s for part in manifest["parts"].values() for s in part["shards"]]
    dtype, vocab_size = np.dtype(manifest["dtype"]), int(manifest["vocab_size"])
    lock, bad = threading.Lock(), 0
    with Progress(f"verifying {folder}", total=sum(s["size"] for s in shards), unit="B", enabled=True,
                  every=progress_every) as progress:
        def on_bytes(n: int) -> None:
            with lock:
                progress.update(n)

        with concurrent.futures.ThreadPoolExecutor(min(workers or default_workers(), max(len(shards), 1))) as pool:
            for lines in pool.map(lambda s: check_shard(folder, s, dtype, vocab_size, on_bytes), shards):
                bad += bool(lines)
                for line in lines:
                    print(line, file=out, flush=True)
    summary = "all ok" if not bad else f"NOT OK: {bad} damaged or missing"
    print(f"{folder}: token store, {len(shards) - bad} of {len(shards)} shards ok, every chunk checked "
          f"({sum(p['tokens'] for p in manifest['parts'].values()):,} tokens); {summary}", file=out)
    return 0 if not bad else 1
