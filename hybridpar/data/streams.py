"""The lines of a JSON-lines file, plain or compressed, read in bounded chunks.

Memory stays bounded whatever the bytes: reads and decompressed chunks are at most a few MiB (a
64 KB zstd frame can expand to gigabytes), runs of blank lines are skipped without a Python step
per line, and a line longer than the limit is measured and skipped as it streams, never held.
A plain file is read a byte range at a time (formats.plan_units' units): a unit reads exactly the
lines that START in its range, so that any cut of a file into ranges reads every line once.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import zlib
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

_READ = 1 << 20  # bytes per read of a file or of a decompressed stream
# Compressed bytes fed to zstd per call. Its densest block (an RLE block: 4 bytes) expands to
# 128 KB, so a call makes at most about 32,768 x this: 8 MiB (decompressobj has no output cap).
_ZSTD_FEED = 256
_BLANK = re.compile(rb"[ \t\r\n]*")  # blank lines (and a line's leading spaces), skipped at C speed

OnBytes = Optional[Callable[[int], None]]  # told how many more bytes of input were read


class DataFormatError(ValueError):
    """Input that cannot be read as documents: names the file, the row or line, and what to change.
    In a job every rank meets it (the unit is never done, so each takes it in turn): said once."""

    every_rank = True  # hybridpar.mesh.ranks.raised_by_every_rank


@dataclasses.dataclass(frozen=True)
class TooLong:
    """A line longer than the limit, measured and skipped unread (it stands in for the line)."""

    size: int


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def lines(path: Path, kind: str, start: int, stop: int, limit: int,
          on_bytes: OnBytes = None) -> Iterator[tuple[int, Union[bytes, TooLong]]]:
    """(index from the first line read, line without its newline or TooLong) of every line of a
    .jsonl file that starts in bytes [start, stop), or of every line of a .jsonl.gz/.jsonl.zst;
    blank lines are skipped (counted in the index). `on_bytes(n)` hears of the file's bytes read."""
    with open(path, "rb") as raw:
        if kind == "jsonl":
            chunks = _range_chunks(raw, start, stop)
        elif kind == "jsonl.gz":
            chunks = _gzip_chunks(raw, path)
        else:
            chunks = _zstd_chunks(raw, path)
        reported = start if kind == "jsonl" else 0
        pending: list[bytes] = []  # the start of a line whose end is in a later chunk
        held = index = 0
        long = -1  # the size so far of a line over the limit (-1: none)
        for chunk in chunks:
            position = 0
            if long >= 0 or pending:  # the line that continues from the last chunk
                end = chunk.find(b"\n")
                part = chunk if end < 0 else chunk[:end]
                if long < 0 and held + len(part) > limit:
                    long, pending = held, []
                if long >= 0:
                    long += len(part)
                else:
                    pending.append(part)
                    held += len(part)
                if end < 0:
                    chunk = b""
                else:
                    yield index, (TooLong(long) if long >= 0 else _joined(pending))
                    index, position, pending, held, long = index + 1, end + 1, [], 0, -1
            while chunk:
                begin = _BLANK.match(chunk, position).end()
                index += chunk.count(b"\n", position, begin)
                end = chunk.find(b"\n", begin)
                if end < 0:
                    rest = len(chunk) - begin
                    if rest > limit:
                        long = rest
                    elif rest:
                        pending, held = [chunk[begin:]], rest
                    break
                yield index, (TooLong(end - begin) if end - begin > limit else chunk[begin:end])
                index, position = index + 1, end + 1
            if on_bytes is not None and raw.tell() > reported:
                on_bytes(raw.tell() - reported)
                reported = raw.tell()
        if long >= 0:
            yield index, TooLong(long)
        elif pending:
            yield index, _joined(pending)


def _joined(parts: list[bytes]) -> bytes:
    """The parts of a line as one, emptying the list: a long line is not held twice while it is read."""
    line = b"".join(parts)
    parts.clear()
    return line


def lines_before(path: Path, offset: int) -> int:
    """How many lines start before byte `offset`: the index of the first line a unit starting there
    reads (a line starts at 0 and after each newline, so: 1 + the newlines in bytes 0..offset-2)."""
    if offset <= 0:
        return 0
    count, offset = 1, offset - 1
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(_READ, offset))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def _range_chunks(raw, start: int, stop: int) -> Iterator[bytes]:
    """The bytes of the lines that start in [start, stop): from the first line start at or after
    `start` to the end of the line holding byte stop - 1. A line starts at 0 and after a newline."""
    position = start
    if start > 0:
        raw.seek(start - 1)
        position = _past_newline(raw)  # the end of the line holding byte start - 1: the unit before's
    last = b"\n"
    while position < stop:
        block = raw.read(min(_READ, stop - position))
        if not block:
            return
        position += len(block)
        last = block
        yield block
    if not last.endswith(b"\n"):  # the line that starts in the range ends in the next: finish it
        while True:
            block = raw.read(_READ)
            end = block.find(b"\n")
            if end >= 0:
                yield block[: end + 1]
                return
            if not block:
                return
            yield block


def _past_newline(raw) -> int:
    """Read on past the next newline (in bounded blocks, however long the line); the position after
    it (the end of the file if none), where `raw` is left."""
    while True:
        block = raw.read(_READ)
        end = block.find(b"\n")
        if end >= 0:
            return raw.seek(end + 1 - len(block), 1)
        if not block:
            return raw.tell()


def _gzip_chunks(raw, path: Path) -> Iterator[bytes]:
    """The text of a gzip file, at most _READ bytes at a time (GzipFile.read decompresses no more)."""
    out = 0
    with gzip.GzipFile(fileobj=raw) as f:
        while True:
            try:
                block = f.read(_READ)
            except (EOFError, OSError, zlib.error) as err:
                raise DataFormatError(f"{path}: the gzip stream is damaged or cut short after {out:,} bytes of text "
                                      f"({raw.tell():,} of {path.stat().st_size:,} compressed bytes read): "
                                      f"{first_line(err)}; copy or download it again") from None
            if not block:
                return
            out += len(block)
            yield block


def _zstd_chunks(raw, path: Path) -> Iterator[bytes]:
    """Every frame of a zstd file, decompressed as it streams in chunks of at most about 8 MiB; a
    frame cut short is an error (the library's stream reader would just stop)."""
    import zstandard

    context = zstandard.ZstdDecompressor()
    frame, fed, out = context.decompressobj(), False, 0
    while True:
        data = raw.read(_READ)
        if not data:
            break
        view, at = memoryview(data), 0
        while at < len(view):
            feed = view[at: at + _ZSTD_FEED]
            at += len(feed)
            try:
                block = frame.decompress(feed)
            except zstandard.ZstdError as err:
                raise DataFormatError(f"{path}: the zstd stream is damaged after {out:,} bytes of text "
                                      f"({raw.tell():,} of {path.stat().st_size:,} compressed bytes read): "
                                      f"{first_line(err)}; copy or download it again") from None
            fed = True
            if block:
                out += len(block)
                yield block
            if frame.eof:  # what this feed held past the frame's end starts the next frame
                at -= len(frame.unused_data)
                frame, fed = context.decompressobj(), False
    if fed:
        raise DataFormatError(f"{path}: the zstd stream is cut short after {out:,} bytes of text (all "
                              f"{path.stat().st_size:,} compressed bytes read, its last frame unfinished); copy or "
                              "download it again")
