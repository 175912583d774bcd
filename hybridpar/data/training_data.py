"""The data a config asks for: tokenizer, packed dataset and each data-parallel rank's loader, built
the same way by the trainer and by `hybridpar doctor` (which checks the very batches training will read)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from hybridpar.data.formats import CorpusText
from hybridpar.data.loader import (PackedDataset, ResumableDataLoader, build_dataloader, check_dataset_size,
                                   validation_windows)
from hybridpar.data.sources import Input, describe_input, input_id, joined_input
from hybridpar.data.store.prepare import stores_of
from hybridpar.data.tokenizer import Tokenizer, TokenizerChoice


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hybridpar"


def source_entries(d) -> list[dict]:
    """data.sources, or data.source as a blend of one (weight 1, named by its path)."""
    if d.sources:
        return d.sources
    return [{"name": d.source, "source": d.source, "weight": 1.0, "text_field": d.text_field}]


def build_sources(d, on_progress: Optional[Callable[[str], None]] = None, walked_sources: Optional[Mapping] = None
                  ) -> tuple[Tokenizer, list[tuple[str, float, PackedDataset]], dict[str, PackedDataset]]:
    """From the config's [data] section: one tokenizer for every source (given, a store's, or trained
    on the sources and cached), and per source (name, weight, its seq_len + 1 windows) of its token
    store (the source itself, or prepared into the cache by every process that asks, each taking
    units of it), and {name: validation windows} where the config asks for them (data.val_source,
    or data.val_fraction of each source's own documents). Rank 0 reports the preparation's
    progress; `on_progress(text)` hears of it in every process. `walked_sources`: the sources' files
    as a job resolved them (hybridpar.preflight.Job.sources), taken instead of walking them again.

    The data go one way: each source looked at once (sources.describe_input: resolved and described,
    or a token store), the tokenizer (tokenizer_choice), each source's store (store.prepare.stores_of),
    its windows."""
    entries = source_entries(d)
    named = [(e["source"], e.get("text_field", d.text_field)) for e in entries]
    fractions = [d.val_fraction] * len(entries)
    if d.val_source:  # held out for a single source: the last input, whole
        named, fractions = named + [(d.val_source, d.text_field)], fractions + [0.0]
    where = [_validation_where(d, e["name"] if d.sources else "") for e in entries]
    folder = cache_dir(d)
    inputs = [describe_input(source, text_field, walked_sources) for source, text_field in named]
    trained = inputs[:len(entries)]  # a held-out data.val_source is not trained on
    tokenizer = tokenizer_choice(d, trained).load()
    stores = stores_of(inputs, tokenizer, folder, val_fractions=fractions, on_bad_record=d.on_bad_record,
                       max_document_bytes=d.max_document_bytes, max_bad_records=d.max_bad_records,
                       on_progress=on_progress)
    held_out = stores[len(entries)][0] if d.val_source else None
    sources, validation = [], {}
    for entry, (train, split), said in zip(entries, stores, where):
        sources.append((entry["name"], entry["weight"], PackedDataset(train, d.seq_len)))
        held = split if held_out is None else held_out
        if held is not None:
            validation[entry["name"]] = validation_windows(held, d.seq_len, said)
    return tokenizer, sources, validation


def tokenizer_choice(d, trained: Sequence[Input]) -> TokenizerChoice:
    """The one rule of which tokenizer a run of the [data] section `d` over its `trained` inputs uses
    (build_sources loads it; hybridpar.preflight.resolve_job tells its sha256 without loading it):
    data.tokenizer; else the first token store's among them; else the one trained on the raw ones
    read as one (sources.joined_input with data.text_field)."""
    corpus = joined_input(trained, d.text_field)
    return TokenizerChoice(d.tokenizer or None, next((i.store for i in trained if i.store is not None), None),
                           vocab_size=d.tokenizer_vocab_size, corpus_id=input_id(corpus), corpus_name=corpus.name,
                           cache_dir=cache_dir(d),
                           text=CorpusText(corpus.files, d.text_field, d.on_bad_record, d.max_document_bytes))


def build_data(d, on_progress: Optional[Callable[[str], None]] = None
               ) -> tuple[Tokenizer, PackedDataset, Optional[PackedDataset]]:
    """build_sources of a single data.source: (tokenizer, its windows, its validation windows or None)."""
    tokenizer, [(name, _, windows)], validation = build_sources(d, on_progress)
    return tokenizer, windows, validation.get(name)


def cache_dir(d) -> Path:
    """The [data] section's cache folder: data.cache_dir, else ~/.cache/hybridpar."""
    return Path(d.cache_dir) if d.cache_dir else default_cache_dir()


def _validation_where(d, name: str) -> str:
    """Which validation data a source's are, in words (for the error of too few of them)."""
    where = f"data.val_source {d.val_source}" if d.val_source else f"data.val_fraction = {d.val_fraction}"
    return where + (f" of source {name!r}" if name else "")


def build_training_data(config, parallel, on_tokenizer: Optional[Callable[[Tokenizer], None]] = None,
                        on_progress: Optional[Callable[[str], None]] = None, walked_sources: Optional[Mapping] = None,
                        data_rank: Optional[tuple[int, int]] = None
                        ) -> tuple[Tokenizer, ResumableDataLoader, Optional[dict[str, PackedDataset]]]:
    """The training data of a config (its [data] and [train] sections) for this rank of `parallel`:
    build_sources, the loader keyed by the data-parallel coordinates (one source or a blend alike),
    and the validation windows per source (None without a validation split). `on_tokenizer(tokenizer)`
    runs before the size check and the loader (the trainer fits the model's vocabulary to the
    tokenizer there). `walked_sources`: build_sources'. `data_rank`: (rank, size) of this rank among every
    reader of the data, (parallel.dp_rank, parallel.dp_size) unless replica groups read it too."""
    d, grad_accum = config.data, config.train.grad_accum
    dp_rank, dp_size = data_rank or (parallel.dp_rank, parallel.dp_size)
    tokenizer, sources, validation = build_sources(d, on_progress, walked_sources)
    if on_tokenizer is not None:
        on_tokenizer(tokenizer)
    if len(sources) == 1:  # a single source's epochs are whole global batches: one at least
        check_dataset_size(sources[0][2], d.micro_batch_size * grad_accum * dp_size,
                           micro_batch_size=d.micro_batch_size, grad_accum=grad_accum, dp_size=dp_size)
    loader = build_dataloader(sources, dp_rank=dp_rank, dp_size=dp_size,
                              micro_batch_size=d.micro_batch_size, seed=d.seed, num_workers=d.num_workers,
                              on_exhausted=d.on_exhausted)
    return tokenizer, loader, validation or None
