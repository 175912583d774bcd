"""A unit's token shards, written as they are made: atomic files of at most MAX_SHARD_TOKENS, each
with its chunk checksums (hybridpar.data.chunks) written beside it as it closes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import crc32c
import numpy as np

from hybridpar.data.chunks import ChunkSummer, sums_name
from hybridpar.data.store.token_store import MAX_SHARD_TOKENS, shard_name
from hybridpar.data.tokenise import PART_NAMES
from hybridpar.files import atomic_output


class ShardWriter:
    """A unit's shards of one part: atomic files of at most MAX_SHARD_TOKENS, their chunks summed as
    written (the sidecar, hybridpar.data.chunks, is written as each shard closes)."""

    def __init__(self, folder: Path, unit: int, part: int) -> None:
        self.folder, self.unit, self.part = folder, unit, part
        self.shards: list[dict] = []
        self._context = self._file = self._sums = None

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._file is None:
                name = shard_name(self.unit, self.part, len(self.shards))
                self._context = atomic_output(self.folder / name, "wb")
                self._file = self._context.__enter__()
                self._sums = ChunkSummer()
                self.shards.append({"name": name, "part": PART_NAMES[self.part], "tokens": 0, "size": 0})
            shard = self.shards[-1]
            take = ids[: MAX_SHARD_TOKENS - shard["tokens"]]
            data = take.tobytes()
            self._file.write(data)
            shard["tokens"] += int(take.size)
            shard["size"] += len(data)
            self._sums.update(data)
            ids = ids[take.size:]
            if shard["tokens"] >= MAX_SHARD_TOKENS:
                self._close()

    def _close(self, error: Optional[BaseException] = None) -> None:
        if self._context is not None:
            context, self._context, self._file = self._context, None, None
            context.__exit__(type(error) if error else None, error, None)
            if error is None:
                shard, sums = self.shards[-1], self._sums.finish()
                with atomic_output(self.folder / sums_name(shard["name"]), "wb") as f:
                    f.write(sums)
                shard["chunks_crc32c"] = crc32c.crc32c(sums)

    def finish(self, error: Optional[BaseException] = None) -> list[dict]:
        self._close(error)
        return self.shards


def shard_written(folder: Path, shard: dict) -> bool:
    """Is the shard a unit record names there whole: the file at its size, and its checksums?"""
    path = folder / shard["name"]
    return path.is_file() and path.stat().st_size == shard["size"] and (folder / sums_name(shard["name"])).is_file()
