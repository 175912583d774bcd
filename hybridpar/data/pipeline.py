"""The data a config asks for: tokenizer, packed dataset and each data-parallel rank's loader, built
the same way by the trainer and by `hybridpar doctor` (which checks the very batches training will read)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional

from hybridpar.data.loader import PackedDataset, ResumableDataLoader, build_dataloader, check_dataset_size
from hybridpar.data.prepare import prepare_cached, source_documents
from hybridpar.data.sources import resolve_sources, source_bytes, source_id, source_name
from hybridpar.data.tokenizer import Tokenizer, load_or_train_tokenizer
from hybridpar.progress import Progress


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybridpar"


def build_data(d) -> tuple[Tokenizer, PackedDataset]:
    """From the config's [data] section: the tokenizer (given, or trained on the source and cached),
    the token file (cached) and its seq_len + 1 windows. The process that trains or tokenises
    says so and reports its progress on stderr; the others wait for its files quietly."""
    cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
    tokenizer = load_or_train_tokenizer(
        d.tokenizer or None, vocab_size=d.tokenizer_vocab_size, documents_factory=lambda: _tokenizer_text(d),
        corpus_id=source_id(d.source, d.text_field), corpus_name=source_name(resolve_sources(d.source)),
        cache_dir=cache,
    )
    token_file = prepare_cached(d.source, tokenizer, cache, text_field=d.text_field)
    return tokenizer, PackedDataset(token_file, d.seq_len)


def _tokenizer_text(d) -> Iterator[str]:
    """The documents of `d.source`, reporting the bytes read: load_or_train_tokenizer asks for them
    only in the process that trains, so this one reports whatever its rank."""
    with Progress("tokenizer: reading the text", total=source_bytes(resolve_sources(d.source)), unit="B",
                  enabled=True) as progress:
        yield from source_documents(d.source, d.text_field, progress.update)


def build_training_data(config, parallel, on_tokenizer: Optional[Callable[[Tokenizer], None]] = None
                        ) -> tuple[Tokenizer, PackedDataset, ResumableDataLoader]:
    """The training data of a config (its [data] and [train] sections) for this rank of `parallel`:
    build_data, a dataset large enough for one global batch, and the loader keyed by the
    data-parallel coordinates. `on_tokenizer(tokenizer)` runs before the size check and the loader
    (the trainer fits the model's vocabulary to the tokenizer there)."""
    d, grad_accum = config.data, config.train.grad_accum
    tokenizer, dataset = build_data(d)
    if on_tokenizer is not None:
        on_tokenizer(tokenizer)
    check_dataset_size(dataset, d.micro_batch_size * grad_accum * parallel.dp_size,
                       micro_batch_size=d.micro_batch_size, grad_accum=grad_accum, dp_size=parallel.dp_size)
    loader = build_dataloader(dataset, dp_rank=parallel.dp_rank, dp_size=parallel.dp_size,
                              micro_batch_size=d.micro_batch_size, seed=d.seed, num_workers=d.num_workers)
    return tokenizer, dataset, loader
