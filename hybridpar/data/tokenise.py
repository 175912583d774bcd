"""Documents -> token ids: each document's pieces encoded in batches, EOS after every document,
optionally split whole documents between training and validation (validation_share).

Memory stays bounded whatever the input: pieces are tokenised in batches of about BATCH_CHARS
characters, and a long document arrives as pieces (formats.cut).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Iterator, Optional

import numpy as np

# Characters handed to the tokenizer per call: bounds memory.
BATCH_CHARS = 1 << 17
# A piece that continues a document is encoded after this separator, whose tokens are then dropped,
# so it is tokenised as in the middle of the text (no dummy-prefix space at its start).
_CONTINUATION_PREFIX = "\n"


@dataclasses.dataclass(frozen=True)
class Piece:
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


def pieces(documents: Iterable[Iterator[str]], val_fraction: float = 0.0) -> Iterator[Piece]:
    for doc in documents:
        previous: Optional[str] = None
        first, part = True, TRAIN
        for text in doc:
            if previous is None and val_fraction > 0:  # decided by the first piece, before any is sent
                part = VALIDATION if validation_share(text) < val_fraction else TRAIN
            if previous is not None:
                yield Piece(previous, not first, False, part)
                first = False
            previous = text
        if previous is not None:  # empty documents add nothing, not even an EOS
            yield Piece(previous, not first, True, part)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def token_batches(stream: Iterable[Piece], tokenizer) -> Iterator[dict[int, tuple[np.ndarray, int]]]:
    """{part: (ids as int32, documents ended)} per batch of about BATCH_CHARS characters."""
    prefix = _encode_arrays(tokenizer, [_CONTINUATION_PREFIX])[0]
    batch: list[Piece] = []
    chars = 0
    for piece in stream:
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


def _encode(batch: list[Piece], tokenizer, prefix: np.ndarray) -> dict[int, tuple[np.ndarray, int]]:
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
