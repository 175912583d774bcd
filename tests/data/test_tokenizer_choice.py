"""One rule picks a run's tokenizer (data.training_data.tokenizer_choice): the pipeline loads or trains it,
and resolve_job tells its sha256 without loading it, so a complete store is found by the tokenizer
the run then uses. The sources a job walked are passed to the pipeline, not walked again."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hybridpar.data.training_data import build_training_data, tokenizer_choice
from hybridpar.data.sources import describe_input, source_key


def _config(tmp_path, **flags):
    from hybridpar.config import load_config

    flags = {"data.cache_dir": str(tmp_path / "cache"), "data.tokenizer_vocab_size": 600, **flags}
    return load_config(None, [f"--{k}={v}" for k, v in flags.items()])


def _source(tmp_path, docs, name="docs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def test_the_sha256_told_without_loading_is_the_tokenizer_the_run_uses(tmp_path, tokenizer, corpus_sample):
    from hybridpar.data import prepare_store

    source = describe_input(_source(tmp_path, corpus_sample[:200]))  # another text than the fixture tokenizer's
    d = _config(tmp_path).data
    assert tokenizer_choice(d, [source]).sha256() is None  # the tokenizer to train on it is not trained yet
    trained = tokenizer_choice(d, [source]).load()
    assert tokenizer_choice(d, [source]).sha256() == trained.sha256 != tokenizer.sha256
    assert tokenizer_choice(_config(tmp_path, **{"data.tokenizer_vocab_size": 700}).data, [source]).sha256() is None

    given = _config(tmp_path, **{"data.tokenizer": tokenizer.path}).data
    assert tokenizer_choice(given, [source]).sha256() == tokenizer_choice(given, [source]).load().sha256
    assert tokenizer_choice(given, [source]).sha256() == tokenizer.sha256

    store = prepare_store(_source(tmp_path, corpus_sample[:50], "other.jsonl"), tokenizer, tmp_path / "store")
    inputs = [source, describe_input(str(store.folder))]  # a store among the sources: its tokenizer, not one trained
    assert tokenizer_choice(d, inputs).sha256() == tokenizer_choice(d, inputs).load().sha256 == tokenizer.sha256


def test_the_walked_sources_are_taken_not_walked_again(tmp_path, tokenizer, monkeypatch):
    """describe_input and the pipeline take a job's walked files (Job.sources); resolve_job finds the
    complete store the pipeline made, by the same tokenizer."""
    import hybridpar.data.sources as sources
    from hybridpar.preflight import resolve_job

    source = _source(tmp_path, [f"document {i}: the quick brown fox" for i in range(400)])
    config = _config(tmp_path, **{"data.source": source, "data.tokenizer": tokenizer.path, "data.seq_len": 16,
                                  "data.micro_batch_size": 1})
    walks = []

    class Walk(sources._Walk):
        def source(self, source):
            walks.append(str(source))
            return super().source(source)

    monkeypatch.setattr(sources, "_Walk", Walk)
    job = resolve_job(config, 1)
    assert walks == [source] and job.stores == {source_key(source): None}  # no store made yet
    table = dict(job.sources)
    assert describe_input(source, "text", table).files == describe_input(source).files == table[source_key(source)]
    walks.clear()
    assert describe_input(source, "text", table).files and walks == []

    parallel = SimpleNamespace(dp_rank=0, dp_size=1)
    build_training_data(config, parallel, walked_sources=job.sources)
    assert walks == []  # the pipeline took the job's files
    again = resolve_job(config, 1)
    assert again.stores[source_key(source)] is not None  # the store the pipeline made, found complete
    walks.clear()
    build_training_data(config, parallel)
    assert walks == [source]  # the counting can fail: without the table, the pipeline walks
