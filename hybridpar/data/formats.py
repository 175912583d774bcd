"""Documents out of every common corpus format, a unit of work at a time.

A file is cut into units that can be read on their own, so that large files are prepared in
parallel: a parquet file's row groups, an arrow file's record batches, an uncompressed `.jsonl`
file's byte ranges (each unit reads the lines that start inside its range). A `.txt` file (one
document), a compressed `.jsonl.gz`/`.jsonl.zst` (a stream) and the embedded corpus are one unit.
Units are about UNIT_BYTES of input; their order (files in reading order, then position) is the
order of the tokens, whoever reads them.

Each document comes as an iterator of pieces that concatenate to it (`cut`), so one long
document never sits in memory twice. A record whose text is missing, null or not a string is an
error naming the file and the row, or skipped and counted (`on_bad_record = "skip"`).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from hybridpar.data.corpus import default_corpus_documents
from hybridpar.data.sources import Source, SourceFile, resolve_sources

UNIT_BYTES = 64 << 20  # input bytes per unit of work (a parquet row group or arrow batch may be more)
# A document longer than this is handed on in pieces, each cut right after a newline.
PIECE_CHARS = 1 << 16
# Pieces end after a newline whose next line holds a non-space character: split patterns such as
# Llama 3's join a newline to the blank lines or indentation after it, never to such a line, so
# the pieces tokenise as the whole does. Past this many PIECE_CHARS any newline will do (memory).
_CUT_AFTER = re.compile(r"\n(?=[^\S\r\n]*\S)")
_LONGEST_PIECE = 16
_READ = 1 << 20  # bytes per read of a stream
BAD_RECORD_CHOICES = ("error", "skip")

OnBytes = Optional[Callable[[int], None]]  # told how many more bytes of input were read


class DataFormatError(ValueError):
    """Input that cannot be read as documents: names the file, the row or line, and what to change.
    In a job every rank meets it (the unit is never done, so each takes it in turn): said once."""

    every_rank = True  # hybridpar.ranks.raised_by_every_rank


@dataclasses.dataclass(frozen=True)
class Unit:
    file: SourceFile
    start: int = 0  # row group, record batch or byte where the unit starts (its kind says which)
    stop: int = 0  # and where the next unit starts
    nbytes: int = 0  # the input bytes it reads: what progress counts

    def describe(self) -> str:
        if self.file.kind == "default":
            return "the embedded corpus"
        what = {"parquet": "row groups", "arrow": "record batches", "jsonl": "bytes"}.get(self.file.kind)
        return f"{self.file.path}" + (f" ({what} {self.start}..{self.stop})" if what else "")


@dataclasses.dataclass
class Tally:
    """What reading a unit found: documents handed on, bad records skipped."""

    documents: int = 0
    skipped: int = 0


# --- planning ------------------------------------------------------------------------------------

def plan_units(files: Sequence[SourceFile], text_field: str, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every unit of `files`, in the order their tokens go into the store."""
    units: list[Unit] = []
    for f in files:
        if f.kind == "parquet":
            units += _grouped(f, _parquet_groups(f.path, text_field), unit_bytes)
        elif f.kind == "arrow":
            units += _grouped(f, _arrow_batches(f.path, text_field), unit_bytes)
        elif f.kind == "jsonl":
            size = f.path.stat().st_size
            units += [Unit(f, lo, min(lo + unit_bytes, size), min(unit_bytes, size - lo))
                      for lo in range(0, size, unit_bytes)] or [Unit(f, 0, 0, 0)]
        else:
            units.append(Unit(f, 0, 0, 0 if f.kind == "default" else f.path.stat().st_size))
    return units


def _grouped(f: SourceFile, sizes: list[int], unit_bytes: int) -> list[Unit]:
    """Consecutive parts (row groups, batches) of about unit_bytes each, at least one part a unit."""
    units, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= unit_bytes or i == len(sizes) - 1:
            units.append(Unit(f, start, i + 1, total))
            start, total = i + 1, 0
    return units or [Unit(f, 0, 0, 0)]


def _parquet_file(path: Path, text_field: str):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
        raise DataFormatError(f"{path}: not a readable parquet file ({_first_line(err)})") from err
    _check_column(path, parquet.schema_arrow, text_field)
    return parquet


def _parquet_groups(path: Path, text_field: str) -> list[int]:
    metadata = _parquet_file(path, text_field).metadata
    return [metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)]


def _arrow_reader(path: Path, text_field: str):
    """An arrow file's record batches: the IPC stream format `datasets` writes, or the file format."""
    import pyarrow as pa

    source = pa.memory_map(str(path))  # batches are views of the mapped file: no copy to skip one
    try:
        reader = pa.ipc.open_stream(source)
        batches = iter(reader)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(source)
        except Exception as err:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
            raise DataFormatError(f"{path}: not a readable arrow file ({_first_line(err)})") from err
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    _check_column(path, reader.schema, text_field)
    return batches


def _arrow_batches(path: Path, text_field: str) -> list[int]:
    return [batch.nbytes for batch in _arrow_reader(path, text_field)]


def _check_column(path: Path, schema, text_field: str) -> None:
    if text_field not in schema.names:
        raise DataFormatError(f"{path} has no column {text_field!r} (its columns: {', '.join(schema.names)}); set "
                              "data.text_field to the column that holds the text")
    kind = schema.field(text_field).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise DataFormatError(f"{path}: column {text_field!r} holds {kind}, not text; set data.text_field to the "
                              "column that holds the text")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# --- reading -------------------------------------------------------------------------------------

def source_documents(source: Source, text_field: str = "text", on_bytes: OnBytes = None,
                     on_bad_record: str = "error") -> Iterator[str]:
    """Every document of a source as one string, in reading order (to train a tokenizer on);
    `on_bytes(n)` hears of the input read as it goes (sources.source_bytes is the total)."""
    files = resolve_sources(source)
    for unit in plan_units(files, text_field):
        for parts in unit_documents(unit, text_field, on_bad_record, on_bytes=on_bytes):
            yield "".join(parts)


def unit_documents(unit: Unit, text_field: str, on_bad_record: str = "error", tally: Optional[Tally] = None,
                   on_bytes: OnBytes = None) -> Iterator[Iterator[str]]:
    """Each document of `unit` as an iterator of pieces that concatenate to it; consume each before
    the next. `tally` counts documents and skipped records; `on_bytes(n)` hears of input read."""
    tally = tally if tally is not None else Tally()
    kind = unit.file.kind
    if kind == "default":
        texts = default_corpus_documents(on_bytes=on_bytes)
    elif kind == "txt":
        tally.documents += 1
        yield _txt_pieces(unit.file.path, on_bytes)
        return
    elif kind in ("parquet", "arrow"):
        texts = _table_texts(unit, text_field, on_bad_record, tally, on_bytes)
    else:
        texts = _jsonl_texts(unit, text_field, on_bad_record, tally, on_bytes)
    for text in texts:
        tally.documents += 1
        yield cut(text)


def cut(text: str) -> Iterator[str]:
    """Pieces of about PIECE_CHARS, each ending right after a newline (or at the end of the text),
    where _CUT_AFTER allows if it can."""
    start = 0
    while start < len(text):
        first = start + PIECE_CHARS - 1
        found = _CUT_AFTER.search(text, first, first + _LONGEST_PIECE * PIECE_CHARS)
        end = found.start() if found else text.find("\n", first)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _bad(where: Callable[[], str], why: str, on_bad_record: str, tally: Tally, fix: str = "fix the record") -> None:
    """A bad record: counted when skipping, else an error naming it (`where()`: asked only then)."""
    if on_bad_record == "skip":
        tally.skipped += 1
        return
    raise DataFormatError(f"{where()}: {why}; {fix}, or set data.on_bad_record = \"skip\" to skip such records "
                          "(they are counted)")


def _text_of(value, where: Callable[[], str], text_field: str, on_bad_record: str, tally: Tally) -> Optional[str]:
    """`value` if it is text; else the bad record counted or said. `where()` names the record, asked
    only for an error: finding a line's number reads the file before it."""
    if isinstance(value, str):
        return value
    why = f"{text_field!r} is null" if value is None else f"{text_field!r} is a {type(value).__name__}, not a string"
    _bad(where, why, on_bad_record, tally)
    return None


def _table_texts(unit: Unit, text_field: str, on_bad_record: str, tally: Tally, on_bytes: OnBytes) -> Iterator[str]:
    """The text column of a parquet unit's row groups (one in memory at a time) or an arrow unit's batches."""
    path, row = unit.file.path, 0
    if unit.file.kind == "parquet":
        parquet = _parquet_file(path, text_field)
        row = sum(parquet.metadata.row_group(i).num_rows for i in range(unit.start))
        parts = (parquet.read_row_group(i, columns=[text_field]).column(0) for i in range(unit.start, unit.stop))
        sizes = [parquet.metadata.row_group(i).total_byte_size for i in range(unit.start, unit.stop)]
    else:
        batches = _arrow_reader(path, text_field)
        parts, sizes = [], []
        for i, batch in enumerate(batches):
            if i >= unit.stop:
                break
            if i < unit.start:
                row += batch.num_rows
                continue
            parts.append(batch.column(batch.schema.get_field_index(text_field)))
            sizes.append(batch.nbytes)
    for column, size in zip(parts, sizes):
        for value in column.to_pylist():
            row += 1
            text = _text_of(value, lambda: f"{path}: row {row}", text_field, on_bad_record, tally)
            if text is not None:
                yield text
        if on_bytes is not None:
            on_bytes(size)


def _jsonl_texts(unit: Unit, text_field: str, on_bad_record: str, tally: Tally, on_bytes: OnBytes) -> Iterator[str]:
    path, line_index = unit.file.path, 0

    def where() -> str:  # the line's number in the file: counted only for a message
        before = _lines_before(path, unit.start) if unit.file.kind == "jsonl" else 0
        return f"{path}:{before + line_index + 1}"

    for line_index, line in _lines(unit, on_bytes):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
            raise DataFormatError(f"{where()}: not valid JSON ({_first_line(err)}); every line of a .jsonl file "
                                  "must be one JSON object") from None
        if not isinstance(record, dict):
            raise DataFormatError(f"{where()}: a JSON {type(record).__name__}, not an object with a "
                                  f"{text_field!r} field")
        if text_field not in record:
            fields = ", ".join(sorted(record)[:10])
            _bad(where, f"no {text_field!r} field (it has: {fields})", on_bad_record, tally,
                 "set data.text_field to the field that holds the text")
            continue
        text = _text_of(record[text_field], where, text_field, on_bad_record, tally)
        if text is not None:
            yield text


def _lines_before(path: Path, offset: int) -> int:
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


def _lines(unit: Unit, on_bytes: OnBytes) -> Iterator[tuple[int, bytes]]:
    """(index from the unit's first line, line) of a jsonl unit: plain, gzip or zstd."""
    path, kind = unit.file.path, unit.file.kind
    with open(path, "rb") as raw:
        if kind == "jsonl":
            chunks = _range_chunks(raw, unit.start, unit.stop)
        elif kind == "jsonl.gz":
            chunks = _gzip_chunks(raw, path)
        else:
            chunks = _zstd_chunks(raw, path)
        reported, pending, index = raw.tell(), b"", 0
        for chunk in chunks:
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield index, line
                index += 1
            if on_bytes is not None and raw.tell() > reported:
                on_bytes(raw.tell() - reported)
                reported = raw.tell()
        if pending:
            yield index, pending


def _range_chunks(raw, start: int, stop: int) -> Iterator[bytes]:
    """The bytes of the lines that start in [start, stop): from the first line start at or after
    `start` to the end of the line holding byte stop - 1."""
    if start > 0:
        raw.seek(start - 1)
        raw.readline()  # the rest of the line holding byte start - 1: the previous unit's
    position = raw.tell()
    while position < stop:
        block = raw.read(min(_READ, stop - position))
        if not block:
            return
        position += len(block)
        yield block
    if position == stop and stop > start:  # finish the line that crosses into the next unit
        rest = raw.readline()
        if rest:
            yield rest


def _gzip_chunks(raw, path: Path) -> Iterator[bytes]:
    out = 0
    with gzip.GzipFile(fileobj=raw) as f:
        while True:
            try:
                block = f.read(_READ)
            except (EOFError, OSError, zlib.error) as err:
                raise DataFormatError(f"{path}: the gzip stream is damaged or cut short after {out:,} bytes of text "
                                      f"({raw.tell():,} of {path.stat().st_size:,} compressed bytes read): "
                                      f"{_first_line(err)}; copy or download it again") from None
            if not block:
                return
            out += len(block)
            yield block


def _zstd_chunks(raw, path: Path) -> Iterator[bytes]:
    """Every frame of a zstd file, decompressed as it streams; a frame cut short is an error (the
    library's stream reader would just stop)."""
    import zstandard

    context = zstandard.ZstdDecompressor()
    frame, fed, out = context.decompressobj(), False, 0
    while True:
        data = raw.read(_READ)
        if not data:
            break
        while data:
            try:
                block = frame.decompress(data)
            except zstandard.ZstdError as err:
                raise DataFormatError(f"{path}: the zstd stream is damaged after {out:,} bytes of text "
                                      f"({raw.tell():,} of {path.stat().st_size:,} compressed bytes read): "
                                      f"{_first_line(err)}; copy or download it again") from None
            fed = True
            if block:
                out += len(block)
                yield block
            if frame.eof:
                data, frame, fed = frame.unused_data, context.decompressobj(), False
            else:
                data = b""
    if fed:
        raise DataFormatError(f"{path}: the zstd stream is cut short after {out:,} bytes of text (all "
                              f"{path.stat().st_size:,} compressed bytes read, its last frame unfinished); copy or "
                              "download it again")


def _txt_pieces(path: Path, on_bytes: OnBytes = None) -> Iterator[str]:
    """A .txt file (one document) in pieces cut as `cut` cuts, read line by line."""
    lines: list[str] = []
    size = reported = 0
    try:
        with open(path, encoding="utf-8") as f:  # universal newlines: '\r\n' arrives as '\n'
            for line in f:
                if size >= PIECE_CHARS and (line.strip() or size >= _LONGEST_PIECE * PIECE_CHARS):
                    reported = _read_so_far(f, reported, on_bytes)
                    yield "".join(lines)
                    lines, size = [], 0
                lines.append(line)
                size += len(line)
            _read_so_far(f, reported, on_bytes)
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8") from e
    if lines:
        yield "".join(lines)


def _read_so_far(f, reported: int, on_bytes: OnBytes) -> int:
    """Tell on_bytes how far the text file `f` has read past `reported` (its binary buffer's
    position, which moves a chunk at a time); the new position."""
    if on_bytes is None:
        return reported
    position = f.buffer.tell()
    if position > reported:
        on_bytes(position - reported)
    return position
