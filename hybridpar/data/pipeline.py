"""The data a config asks for: tokenizer, packed dataset and each data-parallel rank's loader, built
the same way by the trainer and by `hybridpar doctor` (which checks the very batches training will read)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional

from hybridpar.data.loader import PackedDataset, ResumableDataLoader, build_dataloader, check_dataset_size
from hybridpar.data.formats import source_documents
from hybridpar.data.sources import resolve_sources, source_bytes, source_id, source_name
from hybridpar.data.store import TokenStore, is_store
from hybridpar.data.store_prepare import cached_store
from hybridpar.data.tokenizer import Tokenizer, load_or_train_tokenizer
from hybridpar.progress import Progress


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybridpar"


def source_entries(d) -> list[dict]:
    """data.sources, or data.source as a blend of one (weight 1, named by its path)."""
    if d.sources:
        return d.sources
    return [{"name": d.source, "source": d.source, "weight": 1.0, "text_field": d.text_field}]


def build_sources(d, on_progress: Optional[Callable[[str], None]] = None
                  ) -> tuple[Tokenizer, list[tuple[str, float, PackedDataset]], dict[str, PackedDataset]]:
    """From the config's [data] section: one tokenizer for every source (given, a store's, or trained
    on the sources and cached), and per source (name, weight, its seq_len + 1 windows) of its token
    store (the source itself, or prepared into the cache by every process that asks, each taking
    units of it), and {name: validation windows} where the config asks for them (data.val_source,
    or data.val_fraction of each source's own documents). Rank 0 reports the preparation's
    progress; `on_progress(text)` hears of it in every process."""
    entries = source_entries(d)
    tokenizer = _tokenizer_for(d, [e["source"] for e in entries])
    sources, validation = [], {}
    for entry in entries:
        train, held_out = _stores_for(d, entry["source"], entry.get("text_field", d.text_field), tokenizer, on_progress)
        sources.append((entry["name"], entry["weight"], PackedDataset(train, d.seq_len)))
        if d.val_source:  # a single source's
            held_out = _stores_for(d, d.val_source, d.text_field, tokenizer, on_progress, split=False)[0]
        if held_out is not None:
            validation[entry["name"]] = _validation_windows(d, held_out, entry["name"] if d.sources else "")
    return tokenizer, sources, validation


def build_data(d, on_progress: Optional[Callable[[str], None]] = None
               ) -> tuple[Tokenizer, PackedDataset, Optional[PackedDataset]]:
    """build_sources of a single data.source: (tokenizer, its windows, its validation windows or None)."""
    tokenizer, [(name, _, windows)], validation = build_sources(d, on_progress)
    return tokenizer, windows, validation.get(name)


def _tokenizer_for(d, sources: list[str]) -> Tokenizer:
    """data.tokenizer; else a store's among `sources`; else one trained on the raw sources together."""
    if d.tokenizer:
        return Tokenizer(d.tokenizer)
    stores = [s for s in sources if is_store(s)]
    if stores:
        return _store_tokenizer(TokenStore(stores[0]))
    raw = sources[0] if len(sources) == 1 else sources
    return load_or_train_tokenizer(
        None, vocab_size=d.tokenizer_vocab_size, documents_factory=lambda: _tokenizer_text(d, raw),
        corpus_id=source_id(raw, d.text_field), corpus_name=source_name(resolve_sources(raw)),
        cache_dir=cache_dir(d))


def _store_tokenizer(store: TokenStore) -> Tokenizer:
    """The tokenizer a store was made with: the file at the path it records, if that file still has
    the sha256 it records (the sha256 wins)."""
    made_with, sha = store.meta.get("tokenizer_path", ""), store.tokenizer_sha256
    if not made_with or not Path(made_with).exists():
        gone = f" ({made_with} is gone)" if made_with else ""
        raise ValueError(f"the token store {store.folder} was made with a tokenizer (sha256 {sha[:12]}) that cannot be "
                         f"found{gone}: set data.tokenizer to it")
    tokenizer = Tokenizer(made_with)
    if tokenizer.sha256 != sha:
        raise ValueError(f"the token store {store.folder} was made with the tokenizer of sha256 {sha[:12]}, but "
                         f"{made_with} now holds another (sha256 {tokenizer.sha256[:12]}): set data.tokenizer to the "
                         "store's tokenizer, or prepare the store again with this one")
    return tokenizer


def cache_dir(d) -> Path:
    """The [data] section's cache folder: data.cache_dir, else ~/.cache/hybridpar."""
    return Path(d.cache_dir) if d.cache_dir else default_cache_dir()


def _stores_for(d, source: str, text_field: str, tokenizer: Tokenizer, on_progress, split: bool = True
                ) -> tuple[TokenStore, Optional[TokenStore]]:
    """(training store, validation store or None) of one source: a store as given, checked against
    the tokenizer, or one prepared into the cache (with data.val_fraction's split when `split`)."""
    fraction = d.val_fraction if split else 0.0
    if not is_store(source):
        return cached_store(source, tokenizer, cache_dir(d), text_field=text_field, val_fraction=fraction,
                            on_bad_record=d.on_bad_record, on_progress=on_progress,
                            max_document_bytes=d.max_document_bytes)
    store = TokenStore(source)
    if tokenizer.sha256 != store.tokenizer_sha256:
        made_with = store.meta.get("tokenizer_path", "") or "unknown"
        raise ValueError(f"the token store {source} was made with another tokenizer ({made_with}, sha256 "
                         f"{store.tokenizer_sha256[:12]}) than this run's {tokenizer.path} (sha256 {tokenizer.sha256[:12]}): "
                         f"set data.tokenizer to the store's, or prepare the store again with this one")
    if fraction > 0 and store.meta["val_fraction"] != fraction:
        made = (f"with val_fraction {store.meta['val_fraction']}" if store.meta["val_fraction"]
                else "without a validation split")
        raise ValueError(f"data.val_fraction = {fraction}, but the token store {source} was prepared {made}: "
                         f"prepare it with --val-fraction {fraction}, or name a data.val_source")
    return store, TokenStore(source, "validation") if fraction > 0 else None


def _validation_windows(d, validation: Optional[TokenStore], name: str = "") -> Optional[PackedDataset]:
    if validation is None:
        return None
    windows = PackedDataset(validation, d.seq_len)
    if len(windows) == 0:
        where = (f"data.val_source {d.val_source}" if d.val_source else f"data.val_fraction = {d.val_fraction}") + \
            (f" of source {name!r}" if name else "")
        raise ValueError(f"the validation data ({where}) has {validation.n_tokens} tokens, fewer than one "
                         f"sequence of data.seq_len + 1 = {d.seq_len + 1}: give it more text")
    return windows


def _tokenizer_text(d, source) -> Iterator[str]:
    """The documents of `d.source`, reporting the bytes read: load_or_train_tokenizer asks for them
    only in the process that trains, so this one reports whatever its rank."""
    with Progress("tokenizer: reading the text", total=source_bytes(resolve_sources(source)), unit="B",
                  enabled=True) as progress:
        yield from source_documents(source, d.text_field, progress.update, d.on_bad_record, d.max_document_bytes)


def build_training_data(config, parallel, on_tokenizer: Optional[Callable[[Tokenizer], None]] = None,
                        on_progress: Optional[Callable[[str], None]] = None
                        ) -> tuple[Tokenizer, ResumableDataLoader, Optional[dict[str, PackedDataset]]]:
    """The training data of a config (its [data] and [train] sections) for this rank of `parallel`:
    build_sources, the loader keyed by the data-parallel coordinates (one source or a blend alike),
    and the validation windows per source (None without a validation split). `on_tokenizer(tokenizer)`
    runs before the size check and the loader (the trainer fits the model's vocabulary to the
    tokenizer there)."""
    d, grad_accum = config.data, config.train.grad_accum
    tokenizer, sources, validation = build_sources(d, on_progress)
    if on_tokenizer is not None:
        on_tokenizer(tokenizer)
    if len(sources) == 1:  # a single source's epochs are whole global batches: one at least
        check_dataset_size(sources[0][2], d.micro_batch_size * grad_accum * parallel.dp_size,
                           micro_batch_size=d.micro_batch_size, grad_accum=grad_accum, dp_size=parallel.dp_size)
    loader = build_dataloader(sources, dp_rank=parallel.dp_rank, dp_size=parallel.dp_size,
                              micro_batch_size=d.micro_batch_size, seed=d.seed, num_workers=d.num_workers,
                              on_exhausted=d.on_exhausted)
    return tokenizer, loader, validation or None
