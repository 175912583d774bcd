"""The data a config asks for: tokenizer, packed dataset and each data-parallel rank's loader, built
the same way by the trainer and by `hybridpar doctor` (which checks the very batches training will read)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional

from hybridpar.data.loader import PackedDataset, ResumableDataLoader, build_dataloader, check_dataset_size
from hybridpar.data.prepare import prepare_cached, prepare_split_cached, source_documents
from hybridpar.data.sources import resolve_sources, source_bytes, source_id, source_name
from hybridpar.data.store import TokenStore, is_store
from hybridpar.data.tokenizer import Tokenizer, load_or_train_tokenizer
from hybridpar.progress import Progress


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybridpar"


def build_data(d) -> tuple[Tokenizer, PackedDataset, Optional[PackedDataset]]:
    """From the config's [data] section: the tokenizer (given, or trained on the source and cached),
    the token file (cached) and its seq_len + 1 windows, and the validation windows when the config
    asks for them (data.val_source, or data.val_fraction of the source's documents). The process
    that trains or tokenises says so and reports its progress on stderr; the others wait for its
    files quietly."""
    if is_store(d.source):
        return _from_store(d)
    cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
    tokenizer = load_or_train_tokenizer(
        d.tokenizer or None, vocab_size=d.tokenizer_vocab_size, documents_factory=lambda: _tokenizer_text(d),
        corpus_id=source_id(d.source, d.text_field), corpus_name=source_name(resolve_sources(d.source)),
        cache_dir=cache,
    )
    validation = None
    if d.val_fraction > 0:
        token_file, validation = prepare_split_cached(d.source, tokenizer, cache, d.val_fraction,
                                                      text_field=d.text_field)
    else:
        token_file = prepare_cached(d.source, tokenizer, cache, text_field=d.text_field)
        if d.val_source:
            validation = prepare_cached(d.val_source, tokenizer, cache, text_field=d.text_field)
    val_dataset = None
    if validation is not None:
        val_dataset = PackedDataset(validation, d.seq_len)
        if len(val_dataset) == 0:
            where = f"data.val_source {d.val_source}" if d.val_source else f"data.val_fraction = {d.val_fraction}"
            raise ValueError(f"the validation data ({where}) has {validation.n_tokens} tokens, fewer than one "
                             f"sequence of data.seq_len + 1 = {d.seq_len + 1}: give it more text")
    return tokenizer, PackedDataset(token_file, d.seq_len), val_dataset


def _from_store(d) -> tuple[Tokenizer, PackedDataset, Optional[PackedDataset]]:
    """data.source is a token store (hybridpar prepare): its tokens, checked against the run's tokenizer."""
    store = TokenStore(d.source)
    made_with = store.meta.get("tokenizer_path", "")
    if not d.tokenizer and not made_with:
        raise ValueError(f"the token store {d.source} does not record its tokenizer's path: set data.tokenizer")
    tokenizer = Tokenizer(d.tokenizer or made_with)
    if tokenizer.sha256 != store.tokenizer_sha256:
        raise ValueError(f"the token store {d.source} was made with another tokenizer ({made_with or 'unknown'}, sha256 "
                         f"{store.tokenizer_sha256[:12]}) than this run's {tokenizer.path} (sha256 {tokenizer.sha256[:12]}): "
                         f"set data.tokenizer to the store's, or prepare the store again with this one")
    validation = None
    if d.val_fraction > 0:
        if store.meta["val_fraction"] != d.val_fraction:
            made = (f"with val_fraction {store.meta['val_fraction']}" if store.meta["val_fraction"]
                    else "without a validation split")
            raise ValueError(f"data.val_fraction = {d.val_fraction}, but the token store {d.source} was prepared {made}: "
                             f"prepare it with --val-fraction {d.val_fraction}, or name a data.val_source")
        validation = TokenStore(d.source, "validation")
    elif d.val_source:
        validation = TokenStore(d.val_source) if is_store(d.val_source) else prepare_cached(
            d.val_source, tokenizer, Path(d.cache_dir) if d.cache_dir else default_cache_dir(), text_field=d.text_field)
    return tokenizer, PackedDataset(store, d.seq_len), None if validation is None else PackedDataset(validation, d.seq_len)


def _tokenizer_text(d) -> Iterator[str]:
    """The documents of `d.source`, reporting the bytes read: load_or_train_tokenizer asks for them
    only in the process that trains, so this one reports whatever its rank."""
    with Progress("tokenizer: reading the text", total=source_bytes(resolve_sources(d.source)), unit="B",
                  enabled=True) as progress:
        yield from source_documents(d.source, d.text_field, progress.update)


def build_training_data(config, parallel, on_tokenizer: Optional[Callable[[Tokenizer], None]] = None
                        ) -> tuple[Tokenizer, PackedDataset, ResumableDataLoader, Optional[PackedDataset]]:
    """The training data of a config (its [data] and [train] sections) for this rank of `parallel`:
    build_data, a dataset large enough for one global batch, the loader keyed by the
    data-parallel coordinates, and the validation windows (None without a validation split).
    `on_tokenizer(tokenizer)` runs before the size check and the loader (the trainer fits the
    model's vocabulary to the tokenizer there)."""
    d, grad_accum = config.data, config.train.grad_accum
    tokenizer, dataset, val_dataset = build_data(d)
    if on_tokenizer is not None:
        on_tokenizer(tokenizer)
    check_dataset_size(dataset, d.micro_batch_size * grad_accum * parallel.dp_size,
                       micro_batch_size=d.micro_batch_size, grad_accum=grad_accum, dp_size=parallel.dp_size)
    loader = build_dataloader(dataset, dp_rank=parallel.dp_rank, dp_size=parallel.dp_size,
                              micro_batch_size=d.micro_batch_size, seed=d.seed, num_workers=d.num_workers)
    return tokenizer, dataset, loader, val_dataset
