"""Text -> one flat file of token ids, EOS after every document, plus a JSON sidecar that describes it.

Sources are read as sources.py resolves them. The output is a raw array (uint16 when every id
fits, else uint32) that numpy memory-maps, so training reads it without loading it.

Memory stays bounded whatever the input size: files are read line by line, long documents are cut
into pieces at line ends, and pieces are tokenised in batches appended to the output as they come.
Progress counts the bytes of input read (for the embedded corpus, of its source files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from hybridpar.data.corpus import default_corpus_documents
from hybridpar.data.sources import Source, SourceFile, describe_sources, resolve_sources, source_bytes, source_name
from hybridpar.files import PathLike, atomic_output, file_lock, sha256_text, write_text_atomic
from hybridpar.progress import Progress

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: long documents cut where no split pattern joins across the cut
SIDECAR_SUFFIX = ".json"
# A document longer than this is tokenised in pieces, each cut right after a newline.
PIECE_CHARS = 1 << 16
# Pieces end after a newline whose next line holds a non-space character: split patterns such as
# Llama 3's join a newline to the blank lines or indentation after it, never to such a line, so
# the pieces tokenise as the whole does. Past this many PIECE_CHARS any newline will do (memory).
_CUT_AFTER = re.compile(r"\n(?=[^\S\r\n]*\S)")
_LONGEST_PIECE = 16
# Characters handed to the tokenizer per call: bounds memory.
BATCH_CHARS = 1 << 17
# A piece that continues a document is encoded after this separator, whose tokens are then dropped,
# so it is tokenised as in the middle of the text (no dummy-prefix space at its start).
_CONTINUATION_PREFIX = "\n"

OnBytes = Optional[Callable[[int], None]]  # told how many more bytes of input were read


# --- documents as pieces ---------------------------------------------------------------------


def source_documents(source: Source, text_field: str = "text", on_bytes: OnBytes = None) -> Iterator[str]:
    """Every document of a source as one string, in reading order (to train a tokenizer on);
    `on_bytes(n)` hears of the input read as it goes (sources.source_bytes is the total)."""
    for pieces in _documents(resolve_sources(source), text_field, on_bytes):
        yield "".join(pieces)


def _documents(files: Sequence[SourceFile], text_field: str, on_bytes: OnBytes = None) -> Iterator[Iterator[str]]:
    """Each document as an iterator of pieces that concatenate to it; consume each before the next."""
    for f in files:
        if f.kind == "default":
            for doc in default_corpus_documents(on_bytes=on_bytes):
                yield _cut(doc)
        elif f.kind == "txt":
            yield _txt_pieces(f.path, on_bytes)
        else:
            for doc in _jsonl_texts(f.path, text_field, on_bytes):
                yield _cut(doc)


def _read_so_far(f, reported: int, on_bytes: OnBytes) -> int:
    """Tell on_bytes how far the text file `f` has read past `reported` (its binary buffer's
    position, which moves a chunk at a time); the new position."""
    if on_bytes is None:
        return reported
    position = f.buffer.tell()
    if position > reported:
        on_bytes(position - reported)
    return position


def _txt_pieces(path: Path, on_bytes: OnBytes = None) -> Iterator[str]:
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
        raise ValueError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8") from e
    if lines:
        yield "".join(lines)


def _jsonl_texts(path: Path, text_field: str, on_bytes: OnBytes = None) -> Iterator[str]:
    reported = unreported = 0  # progress every PIECE_CHARS characters, as _txt_pieces (tell() costs)
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                unreported += len(line)
                if unreported >= PIECE_CHARS:
                    reported, unreported = _read_so_far(f, reported, on_bytes), 0
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(record, dict) or text_field not in record:
                    fields = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                        f"{path}:{lineno}: no {text_field!r} field (found {fields}); "
                        f"every line needs one, or set text_field to the field that holds the text"
                    )
                text = record[text_field]
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: field {text_field!r} is a {type(text).__name__}, not a string")
                yield text
            _read_so_far(f, reported, on_bytes)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); convert it to UTF-8") from e


def _cut(text: str) -> Iterator[str]:
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


@dataclasses.dataclass(frozen=True)
class _Piece:
    text: str
    continues: bool  # not the document's first piece
    ends: bool  # the document's last piece: EOS follows
    part: int = 0  # the output it goes to: TRAIN or VALIDATION when the documents are split


TRAIN, VALIDATION = 0, 1
PART_NAMES = ("train", "validation")


def validation_share(first_piece: str) -> float:
    """Where a document falls in [0, 1): a hash of its first piece. A document goes to validation
    when this is below data.val_fraction. From the text, not the position, so that copies of a
    document land in the same split and the split does not change when documents are reordered."""
    digest = hashlib.blake2b(first_piece.encode("utf-8", "surrogatepass"), digest_size=8,
                             person=b"hp-val-split").digest()
    return int.from_bytes(digest, "big") / 2**64


def _pieces(documents: Iterable[Iterator[str]], val_fraction: float = 0.0) -> Iterator[_Piece]:
    for doc in documents:
        previous: Optional[str] = None
        first, part = True, TRAIN
        for text in doc:
            if previous is None and val_fraction > 0:  # decided by the first piece, before any is sent
                part = VALIDATION if validation_share(text) < val_fraction else TRAIN
            if previous is not None:
                yield _Piece(previous, not first, False, part)
                first = False
            previous = text
        if previous is not None:  # empty documents add nothing, not even an EOS
            yield _Piece(previous, not first, True, part)


# --- tokenising ------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _token_batches(pieces: Iterable[_Piece], tokenizer) -> Iterator[dict[int, tuple[np.ndarray, int]]]:
    """{part: (ids as int32, documents ended)} per batch of about BATCH_CHARS characters."""
    prefix = _encode_arrays(tokenizer, [_CONTINUATION_PREFIX])[0]
    batch: list[_Piece] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= BATCH_CHARS:
            yield _encode(batch, tokenizer, prefix)
            batch, chars = [], 0
    if batch:
        yield _encode(batch, tokenizer, prefix)


def _encode_arrays(tokenizer, texts: list[str]) -> list[np.ndarray]:
    # Arrays straight from sentencepiece when the tokenizer offers them: lists hold one Python
    # object per token, ten times the memory.
    if hasattr(tokenizer, "encode_batch_numpy"):
        return [np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode_batch_numpy(texts)]
    return [np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode_batch(texts)]


def _encode(batch: list[_Piece], tokenizer, prefix: np.ndarray) -> dict[int, tuple[np.ndarray, int]]:
    texts = [_CONTINUATION_PREFIX + p.text if p.continues else p.text for p in batch]
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    arrays: dict[int, list[np.ndarray]] = {}
    for piece, ids in zip(batch, _encode_arrays(tokenizer, texts)):
        if piece.continues:
            if np.array_equal(ids[: len(prefix)], prefix):
                ids = ids[len(prefix):]
            else:  # a tokenizer that merges across the separator: fall back to the piece alone
                ids = _encode_arrays(tokenizer, [piece.text])[0]
        out = arrays.setdefault(piece.part, [])
        out.append(ids)
        if piece.ends:
            out.append(eos)
    return {part: (np.concatenate(ids), sum(p.ends for p in batch if p.part == part))
            for part, ids in arrays.items()}


# --- the token file --------------------------------------------------------------------------


def sidecar_path(token_path: PathLike) -> Path:
    token_path = Path(token_path)
    return token_path.with_name(token_path.name + SIDECAR_SUFFIX)


class TokenFile:
    """A prepared token file: `.tokens` is a read-only memmap, the rest comes from the sidecar."""

    def __init__(self, path: PathLike) -> None:
        path = Path(path)
        if path.suffix == SIDECAR_SUFFIX and path.with_suffix("").is_file():  # the sidecar was given
            path = path.with_suffix("")
        if not path.exists():
            raise FileNotFoundError(f"token file {path} does not exist; create it with prepare_tokens")
        meta_path = sidecar_path(path)
        if not meta_path.exists():
            raise ValueError(
                f"{path} has no sidecar {meta_path.name}: it is not a prepared token file, or its "
                f"preparation did not finish; prepare it again"
            )
        self.path = path
        self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        expected = self.n_tokens * self.dtype.itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"{path} holds {actual} bytes but its sidecar says {self.n_tokens} {self.dtype} tokens "
                f"({expected} bytes): the file is incomplete or was replaced; prepare it again"
            )
        self._tokens: Optional[np.memmap] = None

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._tokens

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    @property
    def n_documents(self) -> int:
        return int(self.meta["n_documents"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer_sha256"]

    def __len__(self) -> int:
        return self.n_tokens

    # DataLoader workers get a copy: reopen the memmap there instead of pickling the tokens.
    def __getstate__(self) -> dict:
        return {"path": self.path, "meta": self.meta, "_tokens": None}

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, n_tokens={self.n_tokens}, dtype={self.dtype})"


def prepare_tokens(source: Source, tokenizer, output_path: PathLike, *, text_field: str = "text",
                   report: Optional[bool] = None, progress_every: float = 5.0) -> TokenFile:
    """Tokenise `source` into `output_path` (+ its .json sidecar), streamed and written atomically.

    `tokenizer` needs encode_batch, eos_id, vocab_size and sha256 (a Tokenizer has them). A line
    says what starts, progress follows every `progress_every` seconds, on stderr, from rank 0 when
    `report` is None, else from this process or not at all.
    """
    files, output = resolve_sources(source), Path(output_path)
    with _tokenising(files, output, report, progress_every, cached=False) as progress:
        return _prepare(files, describe_sources(files, text_field), tokenizer, [output], text_field, progress)[0]


def _tokenising(files: Sequence[SourceFile], output: Path, report: Optional[bool], every: float,
                cached: bool) -> Progress:
    """The progress of tokenising `files` (in bytes read), its first line said."""
    progress = Progress("tokenising", total=source_bytes(files), unit="B", enabled=report, every=every)
    progress.note(f"tokenising {source_name(files)} into {output}{', once: later runs reuse it' if cached else ''}")
    return progress


def _prepare(files: Sequence[SourceFile], description: dict, tokenizer, outputs: Sequence[Path], text_field: str,
             progress: Progress, val_fraction: float = 0.0) -> list[TokenFile]:
    """One token file, or with val_fraction > 0 two: outputs[TRAIN] and outputs[VALIDATION], each
    document whole in one of them (validation_share)."""
    eos_id, vocab_size = int(tokenizer.eos_id), int(tokenizer.vocab_size)
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"the tokenizer has no usable eos piece (eos_id {eos_id}); documents need one between them")
    dtype = token_dtype(vocab_size)
    n_tokens, n_documents = [0] * len(outputs), [0] * len(outputs)
    with contextlib.ExitStack() as stack:  # every output renamed into place on success, none on error
        outs = [stack.enter_context(atomic_output(output, "wb")) for output in outputs]
        pieces = _pieces(_documents(files, text_field, progress.update), val_fraction)
        for batch in _token_batches(pieces, tokenizer):
            for part, (ids, ended) in batch.items():
                if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                    raise ValueError(f"the tokenizer produced id {bad}, outside its vocab of {vocab_size}")
                outs[part].write(ids.astype(dtype))
                n_tokens[part] += int(ids.size)
                n_documents[part] += ended
        _check_parts(files, n_tokens, n_documents, val_fraction)
        # All tokens are written, the renames come next. Drop old sidecars first: a crash between
        # the renames leaves a token file with no sidecar (clearly unfinished), never new tokens
        # described by an old sidecar. A failure before this point leaves the old outputs whole.
        for output in outputs:
            sidecar_path(output).unlink(missing_ok=True)
    made = []
    for part, output in enumerate(outputs):
        meta = {
            "format": "hybridpar-tokens",
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "n_tokens": n_tokens[part],
            "n_documents": n_documents[part],
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "tokenizer_sha256": tokenizer.sha256,
            "tokenizer_path": str(getattr(tokenizer, "path", "")),
            "source": description,
        }
        if val_fraction > 0:
            meta["split"] = {"part": PART_NAMES[part], "val_fraction": val_fraction}
        write_text_atomic(sidecar_path(output), json.dumps(meta, indent=1) + "\n")
        log.info("prepared %s: %d tokens in %d documents", output, n_tokens[part], n_documents[part])
        made.append(TokenFile(output))
    progress.summary = " + ".join(f"{n:,} tokens in {d:,} documents" + (f" ({PART_NAMES[i]})" if val_fraction else "")
                                  for i, (n, d) in enumerate(zip(n_tokens, n_documents)))
    return made


def _check_parts(files: Sequence[SourceFile], n_tokens: list[int], n_documents: list[int], val_fraction: float) -> None:
    if sum(n_tokens) == 0:
        raise ValueError(f"no tokens: the data source {source_name(files)} holds no text")
    if val_fraction <= 0:
        return
    total = sum(n_documents)
    if n_tokens[VALIDATION] == 0:
        raise ValueError(f"data.val_fraction = {val_fraction} put none of the {total} documents of "
                         f"{source_name(files)} in validation: raise it, or name a held-out data.val_source")
    if n_tokens[TRAIN] == 0:
        raise ValueError(f"data.val_fraction = {val_fraction} put all {total} documents of {source_name(files)} "
                         "in validation, none in training: lower it")


def prepare_cached(
    source: Source,
    tokenizer,
    cache_dir: PathLike,
    *,
    text_field: str = "text",
    lock_timeout: Optional[float] = None,
    report: bool = True,
    progress_every: float = 5.0,
) -> TokenFile:
    """prepare_tokens into cache_dir, reusing an earlier result made from the same source and tokenizer.

    The file name is a hash of the source description (paths, sizes, mtimes; the corpus id for
    'default') and the tokenizer's sha256. Concurrent callers (ranks) wait for the first one. The
    process that prepares reports as prepare_tokens does (unless report=False), whatever its rank;
    those that find the file or wait for it stay quiet.
    """
    return _cached(source, tokenizer, cache_dir, text_field, 0.0, lock_timeout, report, progress_every)[0]


def prepare_split_cached(source: Source, tokenizer, cache_dir: PathLike, val_fraction: float, *,
                         text_field: str = "text", lock_timeout: Optional[float] = None, report: bool = True,
                         progress_every: float = 5.0) -> tuple[TokenFile, TokenFile]:
    """prepare_cached, with the documents split: (training file, validation file). A document goes
    whole to one of them, validation when its validation_share is below `val_fraction`, so no
    validation text is trained on; copies of a document go to the same side."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be between 0 and 1 (a share of the documents), got {val_fraction}")
    train, validation = _cached(source, tokenizer, cache_dir, text_field, val_fraction, lock_timeout, report,
                                progress_every)
    return train, validation


def _cached(source: Source, tokenizer, cache_dir: PathLike, text_field: str, val_fraction: float,
            lock_timeout: Optional[float], report: bool, progress_every: float) -> list[TokenFile]:
    files = resolve_sources(source)
    description = describe_sources(files, text_field)
    key = {"source": description, "tokenizer": tokenizer.sha256, "version": FORMAT_VERSION}
    if val_fraction > 0:
        key["val_fraction"] = val_fraction
    name = f"tokens-{sha256_text(json.dumps(key, sort_keys=True))[:16]}"
    outputs = ([Path(cache_dir) / f"{name}.{part}.bin" for part in PART_NAMES] if val_fraction > 0
               else [Path(cache_dir) / f"{name}.bin"])
    cached = _load_if_complete(outputs)
    if cached is not None:
        return cached
    with file_lock(outputs[0].with_name(outputs[0].name + ".lock"), timeout=lock_timeout, purpose="preparing tokens"):
        cached = _load_if_complete(outputs)  # another rank may have finished it while we waited
        if cached is not None:
            return cached
        with _tokenising(files, outputs[0].with_name(name + (".*.bin" if val_fraction > 0 else ".bin")), report,
                         progress_every, cached=True) as progress:
            return _prepare(files, description, tokenizer, outputs, text_field, progress, val_fraction)


def _load_if_complete(paths: Sequence[Path]) -> Optional[list[TokenFile]]:
    if not all(path.exists() and sidecar_path(path).exists() for path in paths):
        return None
    try:
        return [TokenFile(path) for path in paths]
    except ValueError:
        return None  # left unfinished by a killed job: prepare it again
