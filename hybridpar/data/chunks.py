"""Checked bytes: a token store's shards are summed in chunks small enough to check as a window is
read, the way a file system checks its blocks.

Each shard `units/000012.train.0.tokens` has a sidecar `units/000012.train.0.sums`: the CRC-32C
of each CHUNK_BYTES of the shard (the last chunk may be shorter), as little-endian uint32. The
manifest keeps only the sidecar's own CRC-32C per shard, so it stays small however large the store
(a 512 MB shard has 8,192 chunks: a 32 KB sidecar), and opening a store reads no chunk. A reader
checks a chunk the first time a window touches it, and its tokens against the vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import crc32c
import numpy as np

CHUNK_BYTES = 64 << 10  # a whole number of tokens of any dtype; ~10 us to sum and scan on one core
SUMS_SUFFIX = ".sums"


def sums_name(shard_name: str) -> str:
    """The sidecar of a shard: its chunks' CRC-32C."""
    return shard_name.rsplit(".", 1)[0] + SUMS_SUFFIX


def n_chunks(size: int) -> int:
    return -(-size // CHUNK_BYTES)


class ChunkSummer:
    """The chunk sums of bytes fed in order, in pieces of any size (the shard writer's)."""

    def __init__(self) -> None:
        self.sums: list[int] = []
        self._value, self._filled = 0, 0

    def update(self, data: bytes) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, CHUNK_BYTES - self._filled)
            self._value = crc32c.crc32c(view[:take], self._value)
            self._filled += take
            view = view[take:]
            if self._filled == CHUNK_BYTES:
                self.sums.append(self._value)
                self._value, self._filled = 0, 0

    def finish(self) -> bytes:
        """The sidecar's bytes (the last, partial chunk included)."""
        if self._filled:
            self.sums.append(self._value)
            self._value, self._filled = 0, 0
        return np.asarray(self.sums, dtype="<u4").tobytes()


def chunk_damage(data: np.ndarray, expected: int, vocab_size: int) -> Optional[tuple[Optional[int], str]]:
    """What is wrong with one chunk's tokens, None if nothing: (None, what) for the whole chunk (its
    checksum), or (byte offset in the chunk, what) for the first token id outside the vocabulary."""
    if crc32c.crc32c(memoryview(np.ascontiguousarray(data)).cast("B")) != expected:
        return None, "its bytes do not match their checksum"
    if data.size and int(data.max()) >= vocab_size:
        at = int(np.argmax(data >= vocab_size))
        return at * data.itemsize, f"token {int(data[at])} is outside the vocabulary of {vocab_size}"
    return None


def read_sums(path: Path, size: int, expected_crc: int) -> np.ndarray:
    """A shard's chunk sums from its sidecar, checked against the manifest's CRC-32C of them;
    ValueError naming what is wrong."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError("its chunk checksums (" + path.name + ") are missing") from None
    if len(raw) != 4 * n_chunks(size) or crc32c.crc32c(raw) != expected_crc:
        raise ValueError(f"its chunk checksums ({path.name}) are damaged")
    if not raw:
        return np.zeros(0, dtype="<u4")
    # Mapped, not kept: a 2 TB store's sums are 128 MB, which the page cache then shares between
    # a node's processes (ranks, DataLoader workers) instead of each holding a copy.
    return np.memmap(path, dtype="<u4", mode="r")
