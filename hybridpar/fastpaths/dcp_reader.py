"""A DCP storage reader that reads tensor bytes straight into the tensors being loaded (a fast path).

torch's FileSystemReader torch.loads every stored tensor into a fresh buffer, narrows it and copies
it into the destination, one tensor after another. The files are the same either way: DCP stores
each tensor as a small torch.save archive (a pickle describing the tensor, then its raw bytes) at a
known (offset, length) in a `.distcp` file. This reader
  - parses only each archive's description (torch.load to "meta", weights_only=True), never its
    data, from the archive's first and last few KiB, read up front in a few merged reads;
  - reads the bytes with one positioned read (os.preadv) into the destination when the stored layout
    and the slice are both contiguous (same layout, whole-row reshards), else via a buffer and a copy;
  - splits the items into runs of about equal bytes in file order, one thread each (reads release
    the GIL), so every thread reads forward through its part of a file.
Items it does not handle (non-tensor values, stream transforms such as compression) go to the stock
reader unchanged, so any checkpoint the stock reader loads, this one loads too.
Given `seeds` (checkpoint.verify's), it sums each item it read whole with CRC-32C from the bytes it
already holds, continuing from the item's seed, into `sums`: the load's check then needs no second read.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import crc32c

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..compat.torch import stored_data_offset, zip_reader
from ..safe_pickle import CheckpointReadError, SafeFileSystemReader


@dataclasses.dataclass(eq=False)  # items are told apart by identity (they hold tensors)
class _Item:
    req: ReadItem
    name: str  # the file, relative to the checkpoint folder
    path: str
    offset: int  # of the item's archive in the file
    length: int
    target: torch.Tensor  # the destination slice (DCP's resolve_tensor)


class FastFileSystemReader(SafeFileSystemReader):
    """Drop-in for dcp.FileSystemReader (same files, same results) that reads in place, in threads
    (and reads `.metadata` through the restricted unpickler)."""

    def __init__(self, path, thread_count: int = 2, seeds: Optional[dict[tuple[str, int], int]] = None,
                 sums: Optional[dict[tuple[str, int], tuple[int, int]]] = None) -> None:
        """`seeds`: {(file, item offset): running CRC-32C of the file's bytes before the item}; each such
        item read whole is summed from its seed into `sums` as {(file, offset): (length, CRC-32C)}."""
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        super().__init__(path)
        self.thread_count = thread_count
        self.seeds = seeds or {}
        self.sums = sums if sums is not None else {}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        fast, rest = [], []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.TENSOR and not info.transform_descriptors:
                path = str(self.fs.concat_path(self.path, info.relative_path))
                fast.append(_Item(req, info.relative_path, path, info.offset, info.length,
                                  planner.resolve_tensor(req).detach()))
            else:
                rest.append(req)
        if fast:
            _check_sizes(fast)
            bins = _balance(fast, self.thread_count)
            if len(bins) == 1:
                deferred = _read_items(bins[0], self.seeds, self.sums)
            else:
                with ThreadPoolExecutor(len(bins), thread_name_prefix="ckpt-read") as pool:
                    futures = [pool.submit(_read_items, b, self.seeds, self.sums) for b in bins]
                    deferred = [item for done in futures for item in done.result()]  # re-raises errors
            for item in fast:  # the planner is not thread-safe: commit on this thread
                if item not in deferred:
                    planner.commit_tensor(item.req, item.target)
            rest += [item.req for item in deferred]
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _check_sizes(items: list[_Item]) -> None:
    """A file shorter than the metadata says (a copy cut short, a full disk) is named, not misparsed."""
    sizes: dict[str, int] = {}
    for item in items:
        if item.path not in sizes:
            try:
                sizes[item.path] = os.stat(item.path).st_size
            except FileNotFoundError:
                raise CheckpointReadError(
                    f"checkpoint file {item.path} is missing: the checkpoint is incomplete; load another one"
                ) from None
        if item.offset + item.length > sizes[item.path]:
            raise CheckpointReadError(
                f"checkpoint file {item.path} is truncated: it has {sizes[item.path]} bytes but "
                f"{item.req.storage_index.fqn} is stored at bytes {item.offset}..{item.offset + item.length}; "
                "the checkpoint is damaged (copied or written only in part): load another one"
            )


def _balance(items: list[_Item], bins: int) -> list[list[_Item]]:
    """Cut the items, in file order, into at most `bins` runs of about equal bytes: each thread then
    reads forward through its own part of a file, which keeps the kernel's read-ahead going."""
    ordered = sorted(items, key=lambda i: (i.path, i.offset))
    total = sum(i.length for i in ordered)
    runs: list[list[_Item]] = [[]]
    done = 0
    for item in ordered:
        if runs[-1] and done >= total * len(runs) / bins:
            runs.append([])
        runs[-1].append(item)
        done += item.length
    return runs


# How much of each stored archive to read ahead for its description: torch.save puts the pickle
# and the data record's header first (under 1 KiB for one tensor) and the zip directory last.
_HEAD = _TAIL = 4096
_MERGE_GAP = 64 << 10  # ranges closer than this are read as one


def _read_items(items: list[_Item], seeds: dict, sums: dict) -> list[_Item]:
    """Read each item in place (items in file order); return those left to the stock reader."""
    deferred = []
    for path, group in itertools.groupby(items, key=lambda i: i.path):
        group = list(group)
        fd = os.open(path, os.O_RDONLY)
        try:
            ends = _read_archive_ends(fd, group)
            for item in group:
                if not _read_item(fd, item, ends, seeds.get((item.name, item.offset)), sums):
                    deferred.append(item)
        finally:
            os.close(fd)
    return deferred


def _read_archive_ends(fd: int, items: list[_Item]) -> list[tuple[int, bytes]]:
    """The first and last few KiB of every item's archive, as (file offset, bytes) blocks.

    Parsing an archive straight from the file costs many small reads, each one waiting on the
    disk when the page cache is cold; one archive's end and the next one's start are neighbours,
    so reading these together costs about one read per item, all going forward."""
    ranges = []
    for item in items:
        end = item.offset + item.length
        ranges.append((item.offset, min(end, item.offset + _HEAD)))
        ranges.append((max(item.offset, end - _TAIL), end))
    merged: list[list[int]] = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1] + _MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    if hasattr(os, "posix_fadvise"):
        # Queue them all with the disk first: their waits then overlap instead of adding up.
        for start, stop in merged:
            os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)
    return [(start, os.pread(fd, stop - start, start)) for start, stop in merged]


class _ArchiveView(io.RawIOBase):
    """One stored archive as a file, served from the blocks already read where they cover a read
    and from the file otherwise."""

    def __init__(self, fd: int, offset: int, length: int, blocks: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.blocks, self.pos = fd, offset, length, blocks, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.length - self.pos))
        start = self.offset + self.pos
        held = _held(self.blocks, start, start + n)
        if held is not None:
            out[:n] = held
        else:
            n = os.preadv(self.fd, [out[:n]], start) if n else 0
        self.pos += n
        return n


def _held(blocks: list[tuple[int, bytes]], start: int, stop: int) -> Optional[memoryview]:
    """Bytes start..stop of the file if one block read already holds them all."""
    for block_start, block in blocks:
        if block_start <= start and stop <= block_start + len(block):
            return memoryview(block)[start - block_start:stop - block_start]
    return None


def _span(fd: int, start: int, stop: int, blocks: list[tuple[int, bytes]]):
    """Bytes start..stop of the file, from the blocks read where they hold them."""
    held = _held(blocks, start, stop)
    return held if held is not None else os.pread(fd, stop - start, start)


def _damaged(item: _Item, why: str) -> CheckpointReadError:
    return CheckpointReadError(
        f"{item.path}: cannot read {item.req.storage_index.fqn} at bytes {item.offset}..{item.offset + item.length} "
        f"({why}); the checkpoint file is damaged: load another one"
    )


def _read_item(fd: int, item: _Item, blocks: list[tuple[int, bytes]], seed: Optional[int], sums: dict) -> bool:
    """Read one stored tensor (slice) into its destination; False if it needs the stock reader. With a
    `seed`, an item whose stored data was read whole is summed into `sums` (see the class)."""

    def view() -> _ArchiveView:
        return _ArchiveView(fd, item.offset, item.length, blocks)

    try:
        archive = zip_reader(view())
        # Bytes stored in the other byte order need swapping, which the stock reader does.
        stored_order = bytes(archive.get_record("byteorder")).decode() if archive.has_record("byteorder") else "little"
        if stored_order != sys.byteorder:
            return False
        stored = torch.load(view(), map_location="meta", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any parse failure means the bytes are not what .metadata says
        raise _damaged(item, str(err).splitlines()[0] if str(err) else type(err).__name__) from err
    data_start = stored_data_offset(stored) if isinstance(stored, torch.Tensor) else None
    if data_start is None:
        return False
    nbytes = stored.untyped_storage().nbytes()
    if data_start + nbytes > item.length:
        raise _damaged(item, f"its tensor claims {nbytes} bytes from byte {data_start}")
    wanted = stored
    for dim, (start, size) in enumerate(zip(item.req.storage_offsets, item.req.lengths)):
        if size < stored.size(dim):
            wanted = wanted.narrow(dim, start, size)
    target = item.target
    if wanted.shape != target.shape:
        raise CheckpointReadError(f"{item.req.storage_index.fqn}: stored slice {tuple(wanted.shape)} does not fit "
                                  f"its destination {tuple(target.shape)}")
    if wanted.numel() == 0:
        return True
    base = item.offset + data_start
    itemsize = stored.element_size()
    first = wanted.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(wanted.shape, wanted.stride()))
    # The stored data whole: the item is summed as it is read (see the class).
    summing = seed is not None and first == 0 and (last + 1) * itemsize == nbytes
    value = crc32c.crc32c(_span(fd, item.offset, base, blocks), seed) if summing else None
    if (wanted.is_contiguous() and target.is_contiguous() and target.dtype == stored.dtype
            and target.device.type == "cpu"):
        value = _pread_exact(fd, _bytes_of(target), base + first * itemsize, item, value)
    else:
        # General case: read the span the slice touches, lay the stored strides over it, copy
        # (casting dtype and moving device as copy_ does in the stock reader).
        buf = torch.empty((last - first + 1) * itemsize, dtype=torch.uint8)
        value = _pread_exact(fd, buf.numpy(), base + first * itemsize, item, value)
        target.copy_(buf.view(stored.dtype).as_strided(wanted.shape, wanted.stride(), 0))
    if summing:
        value = crc32c.crc32c(_span(fd, base + nbytes, item.offset + item.length, blocks), value)
        sums[(item.name, item.offset)] = (item.length, value)
    return True


def _bytes_of(t: torch.Tensor):
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes (any dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


_SUM_CHUNK = 1 << 20  # read and summed at a time: the sum reads the bytes while they are in the CPU's cache


def _pread_exact(fd: int, out, pos: int, item: _Item, value: Optional[int] = None) -> Optional[int]:
    """Fill `out` from the file at `pos`; with `value`, the CRC-32C of the bytes read, continued from it."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        stop = len(view) if value is None else min(len(view), done + _SUM_CHUNK)
        got = os.preadv(fd, [view[done:stop]], pos + done)
        if got == 0:
            raise _damaged(item, f"the file ends at byte {pos + done}")
        if value is not None:
            value = crc32c.crc32c(view[done:done + got], value)  # releases the GIL, like the reads
        done += got
    return value
