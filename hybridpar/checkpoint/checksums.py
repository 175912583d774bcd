"""Checksums of a checkpoint's files, computed as their bytes are written, and its manifest.

Every file DCP's writer opens (the `.distcp` shards and `.metadata`) goes through a stream that
feeds each write to CRC-32C (hardware accelerated by the `crc32c` package, about 9 GB/s on one core)
before passing it on, so no byte is read back. Where DCP asks a stream its position (at the start
and end of every item it stores) the running checksum is kept as a mark, so that a mismatch can be
located to the tensors stored in the damaged bytes. The small files hybridpar writes itself
(params.json, train_state.json, rng/rank*.pt) are summed from the bytes written. Rank 0 writes the
manifest `checksums.json` ({"algorithm": "crc32c", "files": {name: {"size", "crc32c", "marks"}}}) before the
checkpoint folder is renamed complete; checkpoint.verify checks files against it.

HYBRIDPAR_CHECKSUMS=0 turns checksums off (no manifest, loads unverified): for measuring their cost.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import crc32c
from torch.distributed.checkpoint.filesystem import FileSystem

from ..files import CRC_CHUNK, crc32c_file, write_text_atomic

ALGORITHM = "crc32c"
MANIFEST = "checksums.json"
ENV = "HYBRIDPAR_CHECKSUMS"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def entry(size: int, value: int, marks: Optional[list] = None) -> dict:
    """A manifest entry; `marks`: [(position, checksum of the bytes before it)] inside the file."""
    out: dict = {"size": size, ALGORITHM: f"{value:08x}"}
    if marks:
        out["marks"] = [[pos, f"{v:08x}"] for pos, v in marks]
    return out


def same(a: dict, b: dict) -> bool:
    """Do two entries record the same bytes (marks aside)?"""
    return a["size"] == b["size"] and a[ALGORITHM] == b[ALGORITHM]


def intervals(want: dict) -> list[tuple[int, int, int, int]]:
    """A manifest entry's stretches between consecutive marks (one stored item each in a .distcp
    file): (start, checksum before it, stop, checksum up to stop)."""
    edges = ([(0, 0)] + [(int(pos), int(v, 16)) for pos, v in want.get("marks", [])]
             + [(int(want["size"]), int(want[ALGORITHM], 16))])
    return [(a, va, b, vb) for (a, va), (b, vb) in zip(edges, edges[1:]) if b > a]


def sum_range(f, start: int, stop: int, value: int) -> int:
    """CRC-32C of bytes start..stop of the open file `f`, continuing from `value`."""
    f.seek(start)
    while start < stop:
        data = f.read(min(CRC_CHUNK, stop - start))
        if not data:
            break
        value, start = crc32c.crc32c(data, value), start + len(data)
    return value


def first_difference(path: Path, want: dict) -> Optional[tuple[int, int]]:
    """The byte range between the manifest's two marks where file `path` first differs from what was
    written; None when the entry has no marks to tell."""
    with open(path, "rb") as f:
        for start, seed, stop, expected in intervals(want):
            if sum_range(f, start, stop, seed) != expected:
                return start, stop
    return None


def file_checksum(path: Path, progress: Optional[Callable[[int], Any]] = None) -> dict:
    """The manifest entry of the file at `path` as it is now (size and checksum of its bytes)."""
    return entry(*crc32c_file(path, progress))


def entry_of(data: bytes) -> dict:
    """The manifest entry of a file holding `data`."""
    return entry(len(data), crc32c.crc32c(data))


class _SummingStream:
    """A write-only file stream that sums what passes through it (DCP writes, tells, fsyncs, closes)."""

    def __init__(self, raw, done: Callable[[dict], None]) -> None:
        self.raw, self.done, self.value, self.size, self.closed = raw, done, 0, 0, False
        self.marks: list[tuple[int, int]] = []

    def tell(self) -> int:
        pos = self.raw.tell()
        if pos == self.size and 0 < pos and (not self.marks or self.marks[-1][0] != pos):
            self.marks.append((pos, self.value))  # an item's edge: see the module
        return pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.value = crc32c.crc32c(view, self.value)
        self.size += len(view)
        return self.raw.write(view)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.raw.close()
            self.done(entry(self.size, self.value, [m for m in self.marks if m[0] < self.size]))

    def __getattr__(self, name: str):  # tell, flush, fileno, writable ...: the file's own
        if name in ("seek", "truncate"):  # would make the running sum wrong
            raise AttributeError(f"a checksummed checkpoint stream cannot {name}")
        return getattr(self.raw, name)


class SummingFileSystem(FileSystem):
    """DCP's local FileSystem that records the size and checksum of every file written through it,
    by path relative to `root`; renames (DCP writes .metadata under a temporary name) carry them."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = Path(root)
        self.files: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP's writer threads close files concurrently

    def _name(self, path) -> str:
        return Path(path).relative_to(self.root).as_posix()

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = self._name(path)

        def record(summed: dict) -> None:
            with self._lock:
                self.files[name] = summed

        with super().create_stream(path, mode) as raw:
            stream = _SummingStream(raw, record)
            yield stream
            stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            summed = self.files.pop(self._name(path), None)
            if summed is not None:
                self.files[self._name(new_path)] = summed


def summing(writer):
    """`writer` (a DCP FileSystemWriter) with its files summed as they are written (see written())."""
    if enabled():
        writer.fs = SummingFileSystem(Path(writer.path))
    return writer


def written(writer) -> dict[str, dict]:
    """The manifest entries of the files `writer` wrote (none when checksums are off)."""
    fs = getattr(writer, "fs", None)
    return dict(fs.files) if isinstance(fs, SummingFileSystem) else {}


def write_manifest(folder: Path, files: dict[str, dict]) -> None:
    if enabled():
        manifest = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))


def read_manifest(folder: Path) -> Optional[dict[str, dict]]:
    """The manifest's entries by file name; None for a checkpoint saved without one. Raises ValueError
    for a manifest that cannot be read."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} cannot be read ({err})") from err
    if manifest.get("algorithm") != ALGORITHM:
        raise ValueError(f"{path} uses checksum algorithm {manifest.get('algorithm')!r}; this hybridpar "
                         f"knows {ALGORITHM!r}")
    return files
