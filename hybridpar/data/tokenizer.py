"""Tokenizers: load Llama 2's or Llama 3's tokenizer.model or a tokenizer.json, or train a sentencepiece one.

Trained ones follow Llama 2's ids (unk 0, bos 1, eos 2, no pad piece: pad_id -1) and its trainer
settings (BPE, byte fallback so no text is ever unknown, digits split, no normalisation,
whitespace kept as is), so decode(encode(text)) == text.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from functools import cached_property, partial
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import sentencepiece as spm

from hybridpar.data.bpe import HuggingFaceBPE, TiktokenBPE, detect_kind, find_tokenizer_file, hf_sha256
from hybridpar.data.store.token_store import read_manifest
from hybridpar.files import PathLike, made_once, sha256_file, sha256_text, write_bytes_atomic
from hybridpar.progress import note

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, -1
# Part of the cache key: bump when the training options below change.
TRAINER_VERSION = 1
# Training reads at most this many lines (the first ones, no sampling): enough for a good
# vocabulary, and it keeps training to seconds however large the corpus is.
DEFAULT_MAX_TRAINING_SENTENCES = 1_000_000
# SentencePiece drops longer sentences; cut them instead (its limit is in bytes, UTF-8 <= 4 per char).
_MAX_SENTENCE_CHARS = 4096


class Tokenizer:
    """A tokenizer file; the kind is read from its contents, whatever the file is called:

    - a sentencepiece model (Llama 2's tokenizer.model, or one train_tokenizer wrote);
    - a tiktoken BPE file (Llama 3's tokenizer.model in Meta's original/ folder): bos is
      <|begin_of_text|> = the number of BPE ranks, eos <|end_of_text|> = that + 1 (see bpe.py);
    - a Hugging Face tokenizer.json (bos/eos: bpe.hf_special_ids).
    A folder stands for its tokenizer.model, else its tokenizer.json. Ids are plain Python ints;
    bos/eos are added only when asked, and ordinary text never encodes to special tokens.
    """

    def __init__(self, model_path: PathLike) -> None:
        path = Path(model_path)
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer model {path} does not exist; pass a tokenizer.model (sentencepiece, e.g. Llama 2's, "
                f"or Meta's Llama 3 tiktoken file), a Hugging Face tokenizer.json, or a folder holding one"
            )
        if path.is_dir():
            path = find_tokenizer_file(path)
        self.path = path
        self._impl = _load(path)
        self.threads: Optional[int] = None  # a batch encode's threads (limit_threads); None: the library's default

    @property
    def kind(self) -> str:
        """"sentencepiece", "tiktoken" or "huggingface"."""
        return self._impl.kind

    @property
    def vocab_size(self) -> int:
        return self._impl.vocab_size

    @property
    def bos_id(self) -> int:
        return self._impl.bos_id

    @property
    def eos_id(self) -> int:
        return self._impl.eos_id

    @property
    def unk_id(self) -> int:
        return self._impl.unk_id

    @property
    def pad_id(self) -> int:
        return self._impl.pad_id

    @property
    def adds_bos(self) -> bool:
        """Whether the tokenizer's own default encoding puts bos first (a tokenizer.json whose
        post-processor does, as Llama 3's and 4's): what transformers' tokenizer does with it, and so
        lm-eval's Hugging Face backend. encode() adds bos only when asked, whatever this says."""
        return self._impl.adds_bos

    @cached_property
    def sha256(self) -> str:
        """Of the model file (and a tokenizer_config.json read beside a tokenizer.json): what a
        prepared token file records to know which tokenizer made it."""
        return self._impl.sha256

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes one str, got {type(text).__name__}; use encode_batch for a list")
        return self._with_specials(self._impl.encode(text), bos, eos)

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """Encode many texts in one call (the libraries spread it over their threads)."""
        texts = list(texts)
        if not texts:
            return []
        return [self._with_specials(ids, bos, eos) for ids in self._impl.encode_batch(texts)]

    def encode_batch_numpy(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Like encode_batch (no bos/eos) as int32 arrays, for bulk tokenising (sentencepiece makes
        them directly, without a Python int per token), on at most self.threads threads."""
        texts = list(texts)
        return self._impl.encode_batch_numpy(texts, self.threads) if texts else []

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids (a list, numpy array or tensor); bos/eos and other special pieces decode to nothing."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._impl.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        """The token's piece: sentencepiece's ("▁the"), or for BPE kinds as bpe.py's docstring says."""
        return self._impl.id_to_piece(int(token_id))

    def _with_specials(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            ids = [self._required("bos", self.bos_id)] + ids
        if eos:
            ids = ids + [self._required("eos", self.eos_id)]
        return ids

    def _required(self, name: str, token_id: int) -> int:
        if token_id < 0:
            raise ValueError(f"tokenizer {self.path} has no {name} piece ({name}_id is -1)")
        return token_id

    # DataLoader workers and spawned processes get a copy: ship the path, not the library's object.
    def __getstate__(self) -> dict:
        return {"path": self.path, "threads": self.threads}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self._impl = _load(self.path)
        self.threads = state.get("threads")

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, kind={self.kind}, vocab_size={self.vocab_size})"


def limit_threads(tokenizer, n: int) -> None:
    """Encode `tokenizer`'s batches on at most `n` threads (a hybridpar Tokenizer's `threads`; other
    objects are left as they are), and this process's tokenizers library pool with them: in a
    preparation worker the workers are the parallelism, and each library's own threads would only
    compete with them."""
    if isinstance(tokenizer, Tokenizer):
        tokenizer.threads = n
    os.environ["RAYON_NUM_THREADS"] = str(n)  # the tokenizers library's pool (read when it starts)
    if n == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"


def tokenizer_sha256(model_path: PathLike) -> str:
    """The sha256 `Tokenizer(model_path).sha256` gives, without loading the tokenizer (what a token
    store records of the tokenizer that made it)."""
    path = Path(model_path)
    path = find_tokenizer_file(path) if path.is_dir() else path
    return hf_sha256(path) if detect_kind(path) == "huggingface" else sha256_file(path)


def _load(path: Path):
    kind = detect_kind(path)
    if kind == "tiktoken":
        return TiktokenBPE(path)
    if kind == "huggingface":
        return HuggingFaceBPE(path)
    return _SentencePiece(path)


class _SentencePiece:
    """A sentencepiece model behind the Tokenizer interface, ids exactly as the processor gives them."""

    kind = "sentencepiece"
    adds_bos = False  # sentencepiece adds bos only when asked

    def __init__(self, path: Path) -> None:
        self._sp = _load_processor(path)
        self.vocab_size, self.bos_id, self.eos_id = self._sp.vocab_size(), self._sp.bos_id(), self._sp.eos_id()
        self.unk_id, self.pad_id = self._sp.unk_id(), self._sp.pad_id()
        self.path = path

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.path)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def encode_batch_numpy(self, texts: list[str], threads: Optional[int] = None) -> list[np.ndarray]:
        return self._sp.encode(texts, out_type="numpy", **({"num_threads": threads} if threads else {}))

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


def _load_processor(path: Path) -> spm.SentencePieceProcessor:
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise ValueError(
            f"{path} is not a valid sentencepiece model ({e}), nor a tiktoken BPE file (a 'base64-token rank' "
            f"line each) nor a Hugging Face tokenizer.json (JSON); pass one of these three, e.g. Llama 2's "
            f"tokenizer.model, Llama 3's original/tokenizer.model or a tokenizer.json"
        ) from e


def train_tokenizer(
    documents: Iterable[str],
    vocab_size: int,
    output_path: PathLike,
    *,
    max_sentences: int = DEFAULT_MAX_TRAINING_SENTENCES,
    report: Optional[bool] = None,
) -> Tokenizer:
    """Train a BPE tokenizer (Llama 2 settings) on `documents` and write it atomically to output_path.

    Deterministic: the same documents and vocab_size give the same file. Reads the documents'
    non-blank lines up to `max_sentences`, streamed (the documents are never held in memory). Once
    they are read, a line says that sentencepiece builds the vocabulary (it reports nothing
    itself): on stderr, from rank 0 when `report` is None, else from this process or not at all.
    """
    write_bytes_atomic(output_path, _trained_model(documents, vocab_size, max_sentences, report))
    return Tokenizer(output_path)


def _trained_model(documents: Iterable[str], vocab_size: int, max_sentences: int, report: Optional[bool]) -> bytes:
    """train_tokenizer's model file, as bytes."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    all_read = partial(_say_all_read, vocab_size=vocab_size, max_sentences=max_sentences, report=report)
    counter = _SentenceCounter(documents, max_sentences, on_end=all_read)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(counter),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            allow_whitespace_only_pieces=True,
            character_coverage=0.99995,
            max_sentence_length=4 * _MAX_SENTENCE_CHARS,
            input_sentence_size=0,  # we already cap the input; sampling would cost determinism
            shuffle_input_sentence=False,
            num_threads=1,  # results must not depend on the machine's core count
            minloglevel=2,
        )
    except RuntimeError as e:
        if counter.error is not None:
            raise counter.error from None
        if counter.count == 0:
            raise ValueError("cannot train a tokenizer: the documents hold no text") from e
        raise ValueError(
            f"could not train a tokenizer of vocab_size {vocab_size} on {counter.count} lines of text: {e}; "
            f"choose a vocab_size the corpus supports (the message above says the limit) or train on more text"
        ) from e
    if counter.error is not None:
        raise counter.error
    return model.getvalue()


def _say_all_read(count: int, vocab_size: int, max_sentences: int, report: Optional[bool]) -> None:
    first = " (the first ones: max_sentences)" if count >= max_sentences else ""
    note(f"tokenizer: {count:,} lines of text read{first}; sentencepiece is building the {vocab_size:,}-token "
         "vocabulary", enabled=report)


class _SentenceCounter:
    """Non-blank lines of the documents, capped, counting how many were handed out; `on_end(count)`
    runs once they all were (when any were). An error reading them (a bad record) ends the lines and
    is kept in `error`: sentencepiece would report it as an internal error of its own."""

    def __init__(self, documents: Iterable[str], limit: int,
                 on_end: Optional[Callable[[int], None]] = None) -> None:
        self.documents, self.limit, self.count, self.on_end = documents, limit, 0, on_end
        self.error: Optional[Exception] = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._lines()
        except Exception as err:  # noqa: BLE001 - raised again by _trained_model, once the trainer returns
            self.error = err
            return
        if self.on_end is not None and self.count:
            self.on_end(self.count)

    def _lines(self) -> Iterator[str]:
        for doc in self.documents:
            for line in doc.split("\n"):
                if not line.strip():
                    continue
                yield line[:_MAX_SENTENCE_CHARS]
                self.count += 1
                if self.count >= self.limit:
                    return


def load_or_train_tokenizer(
    path_or_none: Optional[PathLike],
    *,
    vocab_size: int,
    documents_factory: Callable[[], Iterable[str]],
    corpus_id: str,
    cache_dir: PathLike,
    lock_timeout: Optional[float] = None,
    corpus_name: Optional[str] = None,
    report: bool = True,
) -> Tokenizer:
    """The tokenizer at `path_or_none` as it is, else one trained on the corpus and cached.

    The cache file is keyed by (corpus_id, vocab_size, sentencepiece version, trainer settings);
    the first caller trains it under a file lock while concurrent callers (other ranks) wait and
    then load it. `documents_factory()` is called only when training. `vocab_size` applies to
    training only: a given tokenizer keeps its own (check it against the model with check_vocab).
    The process that trains says so on stderr (unless report=False), naming the corpus
    `corpus_name` (default: its id); the others stay quiet.
    """
    if path_or_none is not None:
        return Tokenizer(path_or_none)
    path = cached_tokenizer_path(cache_dir, corpus_id=corpus_id, vocab_size=vocab_size)

    def train() -> bytes:
        note(f"training a {vocab_size:,}-token sentencepiece tokenizer on {corpus_name or 'corpus ' + corpus_id}, "
             f"once: later runs reuse {path}", enabled=report)
        return _trained_model(documents_factory(), vocab_size, DEFAULT_MAX_TRAINING_SENTENCES, report)

    return Tokenizer(made_once(path, train, timeout=lock_timeout, purpose="training a tokenizer"))


@dataclasses.dataclass(frozen=True)
class TokenizerChoice:
    """Which tokenizer a run uses, chosen before it is loaded (hybridpar.data.training_data.tokenizer_choice
    makes it from the config's [data] and its inputs): `given` (data.tokenizer); else the one the
    token store `store` was made with; else the one trained on the raw corpus `corpus_id` (its
    documents `text`, read only to train; named `corpus_name` in messages) and cached in
    `cache_dir`. The pipeline loads it (load); resolve_job tells its sha256 without loading it
    (sha256), to find a complete store by it."""

    given: Optional[PathLike]
    store: Optional[Path]
    vocab_size: int
    corpus_id: str
    corpus_name: str
    cache_dir: Path
    text: Iterable[str] = dataclasses.field(default=(), compare=False, repr=False)

    def load(self) -> Tokenizer:
        """The tokenizer; the corpus's is trained and cached by the first process that asks."""
        if self.given:
            return Tokenizer(self.given)
        if self.store is not None:
            return _store_tokenizer(self.store)
        return load_or_train_tokenizer(None, vocab_size=self.vocab_size, documents_factory=lambda: self.text,
                                       corpus_id=self.corpus_id, corpus_name=self.corpus_name, cache_dir=self.cache_dir)

    def sha256(self) -> Optional[str]:
        """load()'s sha256, read without loading it: None while the corpus's is not trained yet."""
        if self.given:
            return tokenizer_sha256(self.given)
        if self.store is not None:
            return read_manifest(self.store)["tokenizer_sha256"]
        path = cached_tokenizer_path(self.cache_dir, corpus_id=self.corpus_id, vocab_size=self.vocab_size)
        return tokenizer_sha256(path) if path.exists() else None


def _store_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer the store `folder` was made with: the file at the path it records, if that file
    still has the sha256 it records (the sha256 wins)."""
    meta = read_manifest(folder)
    made_with, sha = meta.get("tokenizer_path", ""), meta["tokenizer_sha256"]
    if not made_with or not Path(made_with).exists():
        gone = f" ({made_with} is gone)" if made_with else ""
        raise ValueError(f"the token store {folder} was made with a tokenizer (sha256 {sha[:12]}) that cannot be "
                         f"found{gone}: set data.tokenizer to it")
    tokenizer = Tokenizer(made_with)
    if tokenizer.sha256 != sha:
        raise ValueError(f"the token store {folder} was made with the tokenizer of sha256 {sha[:12]}, but "
                         f"{made_with} now holds another (sha256 {tokenizer.sha256[:12]}): set data.tokenizer to the "
                         "store's tokenizer, or prepare the store again with this one")
    return tokenizer


def cached_tokenizer_path(cache_dir: PathLike, *, corpus_id: str, vocab_size: int) -> Path:
    key = json.dumps(
        {"corpus": corpus_id, "vocab_size": vocab_size, "sentencepiece": spm.__version__, "trainer": TRAINER_VERSION},
        sort_keys=True,
    )
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", corpus_id)[:48]
    return Path(cache_dir) / f"tokenizer-{readable}-v{vocab_size}-{sha256_text(key)[:12]}.model"

