"""Documents out of every common corpus format, a unit of work at a time.

A file is cut into units that can be read on their own, so that large files are prepared in
parallel: a parquet file's row groups, an arrow file's record batches, an uncompressed `.jsonl`
file's byte ranges (each unit reads the lines that start inside its range: every line exactly
once, whatever the unit size). A `.txt` file (one document), a compressed `.jsonl.gz`/`.jsonl.zst`
(a stream) and the embedded corpus are one unit. Units are about UNIT_BYTES of input; their order
(files in reading order, then position) is the order of the tokens, whoever reads them.

Each document comes as an iterator of pieces that concatenate to it (`cut`), at most
MAX_PIECE_CHARS characters each, so one long document never sits in memory twice and the
tokenizer never gets more than a piece; a `.txt` file is read a block at a time. A bad record is
an error naming the file and the line or row, or skipped and counted (`on_bad_record = "skip"`):
one over max_document_bytes (data.max_document_bytes), one whose text is missing, null, not a
string or not Unicode text (a lone UTF-16 surrogate, which no tokenizer can take; bytes that are
not UTF-8), and a .jsonl line that is not a JSON object.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

from hybridpar.config import MAX_DOCUMENT_BYTES  # the config's default, defined with it
from hybridpar.data.corpus import default_corpus_bytes, default_corpus_documents
from hybridpar.data.sources import Source, SourceFile, resolve_sources, source_bytes
from hybridpar.data.streams import DataFormatError, OnBytes, TooLong, first_line, lines, lines_before
from hybridpar.progress import Progress

UNIT_BYTES = 64 << 20  # input bytes per unit of work (a parquet row group or arrow batch may be more)
# A document longer than this is handed on in pieces, each cut right after a newline.
PIECE_CHARS = 1 << 16
# Pieces end after a newline whose next line holds a non-space character: split patterns such as
# Llama 3's join a newline to the blank lines or indentation after it, never to such a line, so
# the pieces tokenise as the whole does. Past this many PIECE_CHARS any newline will do; text
# without one there is cut before a space, else anywhere (memory: a piece is at most
# MAX_PIECE_CHARS, whatever the text).
_CUT_AFTER = re.compile(r"\n(?=[^\S\r\n]*\S)")
_WORD_START = re.compile(r"(?<=\S)\s")
_LONGEST_PIECE = 16
MAX_PIECE_CHARS = (_LONGEST_PIECE + 1) * PIECE_CHARS
_TOO_LONG_FIX = "raise data.max_document_bytes (hybridpar prepare --max-document-bytes)"
_ONE_OBJECT = "every line of a .jsonl file must be one JSON object, in UTF-8"


@dataclasses.dataclass(frozen=True)
class Unit:
    file: SourceFile
    start: int = 0  # row group, record batch or byte where the unit starts (its kind says which)
    stop: int = 0  # and where the next unit starts
    nbytes: int = 0  # the input bytes it reads (0 for the embedded corpus: progress counts read_bytes)

    @property
    def read_bytes(self) -> int:
        """The bytes reading it counts through on_bytes. The embedded corpus's unit records 0 (its
        plan, and so the key of every store made of it, stay as they were): its sources' size."""
        return default_corpus_bytes() if self.file.kind == "default" else self.nbytes

    def describe(self) -> str:
        if self.file.kind == "default":
            return "the embedded corpus"
        what = {"parquet": "row groups", "arrow": "record batches", "jsonl": "bytes"}.get(self.file.kind)
        return f"{self.file.path}" + (f" ({what} {self.start}..{self.stop})" if what else "")


@dataclasses.dataclass
class Tally:
    """What reading a unit found: documents handed on, bad records skipped (the first of them:
    where, and why)."""

    documents: int = 0
    skipped: int = 0
    first_bad: str = ""


# --- planning ------------------------------------------------------------------------------------

def plan_units(files: Sequence[SourceFile], text_field: str, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every unit of `files`, in the order their tokens go into the store."""
    if not isinstance(unit_bytes, int) or unit_bytes < 1:
        raise ValueError(f"the unit of work must be at least 1 byte, got {unit_bytes!r}")
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
        raise DataFormatError(f"{path}: not a readable parquet file ({first_line(err)})") from err
    _check_column(path, parquet.schema_arrow, text_field)
    return parquet


def _parquet_groups(path: Path, text_field: str) -> list[int]:
    metadata = _parquet_file(path, text_field).metadata
    return [metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)]


def _arrow_reader(path: Path, text_field: str) -> Iterator:
    """An arrow file's record batches: the IPC stream format `datasets` writes, or the file format.
    A file cut short or damaged is one error naming it, whenever it shows."""
    import pyarrow as pa

    source = pa.memory_map(str(path))  # batches are views of the mapped file: no copy to skip one
    try:
        reader = pa.ipc.open_stream(source)
        batches = iter(reader)
    except (pa.ArrowInvalid, OSError):  # not the stream format (or a stream cut short in its schema)
        try:
            reader = pa.ipc.open_file(source)
        except Exception as err:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
            raise DataFormatError(f"{path}: not a readable arrow file ({first_line(err)})") from err
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    _check_column(path, reader.schema, text_field)
    return _checked_batches(path, batches)


def _checked_batches(path: Path, batches: Iterator) -> Iterator:
    count = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:  # noqa: BLE001 - pyarrow's errors for a damaged file vary (OSError, ArrowInvalid)
            raise DataFormatError(f"{path}: the arrow file is cut short or damaged after {count:,} record batches "
                                  f"({first_line(err)}); save it again") from None
        count += 1
        yield batch


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


# --- reading -------------------------------------------------------------------------------------

def source_documents(source: Source, text_field: str = "text", on_bytes: OnBytes = None,
                     on_bad_record: str = "error", max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[str]:
    """Every document of a source as one string, in reading order (to train a tokenizer on);
    `on_bytes(n)` hears of the input read as it goes (sources.source_bytes is the total)."""
    return files_documents(resolve_sources(source), text_field, on_bytes, on_bad_record, max_document_bytes)


class CorpusText:
    """The documents of resolved files (sources.resolve_sources), one string each in reading order,
    read anew at each iteration: the text a tokenizer is trained on. The bytes read are reported
    as they go by whichever process reads them (only the one that trains does), whatever its rank."""

    def __init__(self, files: Sequence[SourceFile], text_field: str = "text", on_bad_record: str = "error",
                 max_document_bytes: int = MAX_DOCUMENT_BYTES) -> None:
        self.files, self.text_field = list(files), text_field
        self.on_bad_record, self.max_document_bytes = on_bad_record, max_document_bytes

    def __iter__(self) -> Iterator[str]:
        with Progress("tokenizer: reading the text", total=source_bytes(self.files), unit="B", enabled=True) as progress:
            yield from files_documents(self.files, self.text_field, progress.update, self.on_bad_record,
                                       self.max_document_bytes)


def files_documents(files: Sequence[SourceFile], text_field: str = "text", on_bytes: OnBytes = None,
                    on_bad_record: str = "error", max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[str]:
    """source_documents of files resolved already (sources.resolve_sources)."""
    for unit in plan_units(list(files), text_field):
        for parts in unit_documents(unit, text_field, on_bad_record, on_bytes=on_bytes,
                                    max_document_bytes=max_document_bytes):
            yield "".join(parts)


def unit_documents(unit: Unit, text_field: str, on_bad_record: str = "error", tally: Optional[Tally] = None,
                   on_bytes: OnBytes = None, max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[Iterator[str]]:
    """Each document of `unit` as an iterator of pieces that concatenate to it; consume each before
    the next. `tally` counts documents and skipped records; `on_bytes(n)` hears of input read; a
    record over `max_document_bytes` is a bad record."""
    tally = tally if tally is not None else Tally()
    kind = unit.file.kind
    if kind == "default":
        texts = default_corpus_documents(on_bytes=on_bytes)
    elif kind == "txt":
        tally.documents += 1
        yield _txt_pieces(unit.file.path, on_bytes)
        return
    elif kind in ("parquet", "arrow"):
        texts = _table_texts(unit, text_field, on_bad_record, tally, on_bytes, max_document_bytes)
    else:
        texts = _jsonl_texts(unit, text_field, on_bad_record, tally, on_bytes, max_document_bytes)
    for text in texts:
        tally.documents += 1
        yield cut(text)


def cut(text: str) -> Iterator[str]:
    """Pieces of about PIECE_CHARS (at most MAX_PIECE_CHARS), each ending right after a newline where
    _CUT_AFTER allows if it can, else after any newline, else before a space, else anywhere."""
    return _pieces([text])


def _pieces(blocks: Iterable[str]) -> Iterator[str]:
    """The text of `blocks` in pieces cut as `cut` cuts: the same pieces however the text comes in
    blocks, holding little more than a piece and a block (a piece's whole reach only without a
    preferred cut in it)."""
    reach = PIECE_CHARS - 1 + _LONGEST_PIECE * PIECE_CHARS  # past a piece's start, all that decides its end
    text, start = "", 0
    for block in itertools.chain(blocks, [None]):
        if block is not None:
            text, start = text[start:] + block, 0
        while start < len(text):
            end = _piece_end(text, start, block is None or len(text) - start > reach)
            if end is None:  # the text so far does not decide: more of it
                break
            yield text[start:end]
            start = end


def _piece_end(text: str, start: int, whole: bool) -> Optional[int]:
    """Where the piece that starts at `start` ends; None if that needs more text than there is
    (`whole`: there is no more, or enough). A preferred cut found in part of the text is the one
    found in all of it: whether a newline is one never depends on text past the next newline."""
    first = start + PIECE_CHARS - 1
    last = first + _LONGEST_PIECE * PIECE_CHARS
    found = _CUT_AFTER.search(text, first, last)
    if found:
        return found.start() + 1
    if not whole:
        return None
    newline = text.find("\n", first, last)
    if newline >= 0:
        return newline + 1
    if len(text) <= last:
        return len(text)
    space = _WORD_START.search(text, first, last)
    return space.start() if space else last


def _bad(where: Callable[[], str], why: str, on_bad_record: str, tally: Tally, fix: str = "fix the record") -> None:
    """A bad record: counted when skipping (the first one named), else an error naming it
    (`where()`: asked only for the first, or the error)."""
    if on_bad_record == "skip":
        tally.skipped += 1
        if not tally.first_bad:
            tally.first_bad = f"{where()}: {why}"
        return
    raise DataFormatError(f"{where()}: {why}; {fix}, or set data.on_bad_record = \"skip\" (hybridpar prepare "
                          "--on-bad-record skip) to skip such records (they are counted)")


def _too_long(size: int, limit: int) -> str:
    return f"a record of {size:,} bytes, over data.max_document_bytes = {limit:,}"


_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclasses.dataclass(frozen=True)
class NotUTF8:
    """A table row whose bytes are not UTF-8 (it stands in for the row's text)."""

    error: UnicodeDecodeError


def _text_of(value, where: Callable[[], str], text_field: str, on_bad_record: str, tally: Tally) -> Optional[str]:
    """`value` if it is Unicode text; else the bad record counted or said. `where()` names the
    record, asked only for an error: finding a line's number reads the file before it."""
    if isinstance(value, str):
        # JSON's "\ud83d" escape (or its bytes) makes a lone surrogate: valid JSON, common in scraped
        # text, but not Unicode text that UTF-8 (or any tokenizer library) can take.
        lone = None if value.isascii() else _SURROGATE.search(value)
        if lone is None:
            return value
        why = (f"{text_field!r} holds a lone UTF-16 surrogate (\\u{ord(lone.group()):04x} at character "
               f"{lone.start():,}), not Unicode text a tokenizer can take")
    elif isinstance(value, NotUTF8):
        why = f"{text_field!r} is not UTF-8 text ({value.error.reason} at byte {value.error.start:,})"
    elif value is None:
        why = f"{text_field!r} is null"
    else:
        why = f"{text_field!r} is a {type(value).__name__}, not a string"
    _bad(where, why, on_bad_record, tally)
    return None


def _row_group(parquet, path: Path, index: int, text_field: str):
    """Row group `index`'s text column; a damaged one (its footer read fine) is one line, not pyarrow's error."""
    try:
        return parquet.read_row_group(index, columns=[text_field]).column(0)
    except Exception as err:  # noqa: BLE001 - pyarrow's errors for damaged pages vary (OSError, ArrowInvalid)
        raise DataFormatError(f"{path}: row group {index} of {parquet.metadata.num_row_groups} is damaged "
                              f"({first_line(err)}); copy or write the file again") from None


def _table_texts(unit: Unit, text_field: str, on_bad_record: str, tally: Tally, on_bytes: OnBytes,
                 limit: int) -> Iterator[str]:
    """The text column of a parquet unit's row groups (one in memory at a time) or an arrow unit's batches."""
    path, row = unit.file.path, 0
    if unit.file.kind == "parquet":
        parquet = _parquet_file(path, text_field)
        row = sum(parquet.metadata.row_group(i).num_rows for i in range(unit.start))
        parts = (_row_group(parquet, path, i, text_field) for i in range(unit.start, unit.stop))
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
        for value in _column_values(column, limit):
            row += 1
            if isinstance(value, TooLong):
                _bad(lambda: f"{path}: row {row}", _too_long(value.size, limit), on_bad_record, tally, _TOO_LONG_FIX)
                continue
            text = _text_of(value, lambda: f"{path}: row {row}", text_field, on_bad_record, tally)
            if text is not None:
                yield text
        if on_bytes is not None:
            on_bytes(size)


def _column_values(column, limit: int) -> Iterable:
    """A text column's values: str, None, TooLong for one over the limit (never made a Python
    string) or NotUTF8 for one whose bytes are not UTF-8; the whole column at once when it can be."""
    import pyarrow.compute as pc

    lengths = pc.binary_length(column)
    if (pc.max(lengths).as_py() or 0) <= limit:
        try:
            return column.to_pylist()
        except UnicodeDecodeError:  # a row that is not UTF-8: row by row, to name it
            pass
    return (_row_value(column, i, n, limit) for i, n in enumerate(lengths.to_pylist()))


def _row_value(column, i: int, n: Optional[int], limit: int):
    if n is None or n > limit:
        return None if n is None else TooLong(n)
    try:
        return column[i].as_py()
    except UnicodeDecodeError as err:
        return NotUTF8(err)


def _jsonl_texts(unit: Unit, text_field: str, on_bad_record: str, tally: Tally, on_bytes: OnBytes,
                 limit: int) -> Iterator[str]:
    path, line_index = unit.file.path, 0

    def where() -> str:  # the line's number in the file: counted only for a message
        before = lines_before(path, unit.start) if unit.file.kind == "jsonl" else 0
        return f"{path}:{before + line_index + 1}"

    for line_index, line in lines(path, unit.file.kind, unit.start, unit.stop, limit, on_bytes):
        if isinstance(line, TooLong):
            _bad(where, _too_long(line.size, limit), on_bad_record, tally, _TOO_LONG_FIX)
            continue
        if not line or line.isspace():  # (no copy of the line, as strip() would make)
            continue
        try:  # decoded here, not by json (which guesses UTF-16 from a NUL byte and lets surrogates pass)
            record = json.loads(line.decode("utf-8-sig"))
        except UnicodeDecodeError as err:
            _bad(where, f"not UTF-8 text ({err.reason} at byte {err.start:,})", on_bad_record, tally, _ONE_OBJECT)
            continue
        except ValueError as err:
            _bad(where, f"not valid JSON ({first_line(err)})", on_bad_record, tally, _ONE_OBJECT)
            continue
        if not isinstance(record, dict):
            _bad(where, f"a JSON {type(record).__name__}, not an object with a {text_field!r} field", on_bad_record,
                 tally, _ONE_OBJECT)
            continue
        if text_field not in record:
            fields = ", ".join(sorted(record)[:10])
            _bad(where, f"no {text_field!r} field (it has: {fields})", on_bad_record, tally,
                 "set data.text_field to the field that holds the text")
            continue
        text = _text_of(record[text_field], where, text_field, on_bad_record, tally)
        del line, record  # a long document is held once, as its text, while it is read
        if text is not None:
            yield text


def _txt_pieces(path: Path, on_bytes: OnBytes = None) -> Iterator[str]:
    """A .txt file (one document) in pieces cut as `cut` cuts, read a block of characters at a time
    (never a whole line: a file may be one line of gigabytes)."""
    try:
        with open(path, encoding="utf-8") as f:  # universal newlines: '\r\n' arrives as '\n'
            yield from _pieces(_text_blocks(f, on_bytes))
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8") from e


def _text_blocks(f, on_bytes: OnBytes) -> Iterator[str]:
    reported = 0
    while True:
        block = f.read(PIECE_CHARS)  # a piece's worth of characters
        if on_bytes is not None:  # the binary buffer's position, which moves a chunk at a time
            position = f.buffer.tell()
            if position > reported:
                on_bytes(position - reported)
                reported = position
        if not block:
            return
        yield block
