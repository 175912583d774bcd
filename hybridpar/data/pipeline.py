"""The data a config asks for: tokenizer and packed dataset, built the same way by the trainer and
by `hybridpar doctor` (which checks the very batches training will read)."""

from __future__ import annotations

from pathlib import Path

from hybridpar.data.loader import PackedDataset
from hybridpar.data.prepare import prepare_cached, source_documents, source_id
from hybridpar.data.tokenizer import Tokenizer, load_or_train_tokenizer


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybridpar"


def build_data(d) -> tuple[Tokenizer, PackedDataset]:
    """From the config's [data] section: the tokenizer (given, or trained on the source and cached),
    the token file (cached) and its seq_len + 1 windows."""
    cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
    tokenizer = load_or_train_tokenizer(
        d.tokenizer or None, vocab_size=d.tokenizer_vocab_size,
        documents_factory=lambda: source_documents(d.source, d.text_field),
        corpus_id=source_id(d.source, d.text_field), cache_dir=cache,
    )
    token_file = prepare_cached(d.source, tokenizer, cache, text_field=d.text_field)
    return tokenizer, PackedDataset(token_file, d.seq_len)
