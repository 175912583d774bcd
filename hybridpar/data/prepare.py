"""Text -> one flat file of token ids, EOS after every document, plus a JSON sidecar that describes it.

Sources are read as sources.py resolves them. The output is a raw array (uint16 when every id
fits, else uint32) that numpy memory-maps, so training reads it without loading it.

Memory stays bounded whatever the input size: files are read line by line, long documents are cut
into pieces at line ends, and pieces are tokenised in batches appended to the output as they come.
Progress counts the bytes of input read (for the embedded corpus, of its source files).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from hybridpar.data.formats import plan_units, unit_documents
from hybridpar.data.sources import Source, SourceFile, describe_sources, resolve_sources, source_bytes, source_name
from hybridpar.files import PathLike, atomic_output, file_lock, sha256_text, write_text_atomic
from hybridpar.data.tokenise import PART_NAMES, TRAIN, VALIDATION, pieces, token_batches, token_dtype
from hybridpar.progress import Progress

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: long documents cut where no split pattern joins across the cut
SIDECAR_SUFFIX = ".json"

OnBytes = Optional[Callable[[int], None]]  # told how many more bytes of input were read


# --- documents as pieces ---------------------------------------------------------------------


def source_documents(source: Source, text_field: str = "text", on_bytes: OnBytes = None) -> Iterator[str]:
    """Every document of a source as one string, in reading order (to train a tokenizer on);
    `on_bytes(n)` hears of the input read as it goes (sources.source_bytes is the total)."""
    for parts in _documents(resolve_sources(source), text_field, on_bytes):
        yield "".join(parts)


def _documents(files: Sequence[SourceFile], text_field: str, on_bytes: OnBytes = None,
               on_bad_record: str = "error") -> Iterator[Iterator[str]]:
    """Each document as an iterator of pieces that concatenate to it; consume each before the next."""
    for unit in plan_units(files, text_field):
        yield from unit_documents(unit, text_field, on_bad_record, on_bytes=on_bytes)


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
        stream = pieces(_documents(files, text_field, progress.update), val_fraction)
        for batch in token_batches(stream, tokenizer):
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
