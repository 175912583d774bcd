"""build_training_data: the trainer's and the doctor's data, keyed by the data-parallel coordinates."""

from types import SimpleNamespace

import pytest
import torch

from hybridpar.data import build_dataloader, build_training_data
from tests.runs import make_config


def test_the_loader_is_keyed_by_the_dp_coordinates(corpus, tmp_path):
    config = make_config(corpus, tmp_path, dp=2)
    seen = []
    tokenizer, loader, validation = build_training_data(config, SimpleNamespace(dp_rank=1, dp_size=2),
                                                        on_tokenizer=seen.append)
    (source,) = loader.sources
    dataset = source.dataset
    assert seen == [tokenizer] and validation is None
    d = config.data
    expected = build_dataloader(dataset, dp_rank=1, dp_size=2, micro_batch_size=d.micro_batch_size, seed=d.seed)
    assert all(torch.equal(a, b) for a, b in zip(next(loader), next(expected)))


def test_the_tokenizer_is_met_before_the_dataset_size_is_checked(corpus, tmp_path):
    config = make_config(corpus, tmp_path, dp=2)
    _, loader, _ = build_training_data(config, SimpleNamespace(dp_rank=0, dp_size=2))
    dataset = loader.sources[0].dataset
    config.data.micro_batch_size = len(dataset)  # one global batch is now twice the dataset

    def vocab_too_small(tokenizer):
        raise ValueError("the trainer's vocabulary check")

    with pytest.raises(ValueError, match="the trainer's vocabulary check"):
        build_training_data(config, SimpleNamespace(dp_rank=0, dp_size=2), on_tokenizer=vocab_too_small)
    with pytest.raises(ValueError, match=f"one global batch needs {2 * len(dataset)}"):
        build_training_data(config, SimpleNamespace(dp_rank=0, dp_size=2))


def test_each_source_is_looked_at_once_and_its_store_made_step_by_step(corpus, tmp_path, monkeypatch):
    """The data go one way: build_sources resolves and describes each source once and hands that down
    as a value; the tokenizer, the cache folder, the plan and the completeness check never walk or
    stat it again. A store made here is planned, built and given its manifest once each, in that
    order; a complete one is neither planned nor built."""
    import shutil

    import hybridpar.data.sources as sources
    import hybridpar.data.store.prepare as store_prepare
    from hybridpar.data import build_sources

    tokenizer = build_training_data(make_config(corpus, tmp_path / "corpus"), SimpleNamespace(dp_rank=0, dp_size=1))[0]
    parts = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for part in parts:
        shutil.copy(corpus["source"], part)
    config = make_config({"source": "default", "cache_dir": str(tmp_path / "cache")}, tmp_path / "run", **{
        "data.sources": f"a={parts[0]}@0.5,b={parts[1]}@0.5", "data.tokenizer": str(tokenizer.path)})
    seen = []

    class Walk(sources._Walk):
        def source(self, source):
            seen.append(("walk", str(source)))
            return super().source(source)

    def counted(name, real):
        return lambda *args, **kwargs: seen.append((name,)) or real(*args, **kwargs)

    monkeypatch.setattr(sources, "_Walk", Walk)
    monkeypatch.setattr(sources, "describe_sources", counted("describe", sources.describe_sources))
    for name, step in [("plan_of", "plan"), ("work_on", "build"), ("finish_store", "manifest")]:
        monkeypatch.setattr(store_prepare, name, counted(step, getattr(store_prepare, name, None)), raising=False)

    made = build_sources(config.data)[1]
    walked = [("walk", str(p)) for p in parts]
    assert seen == [walked[0], ("describe",), walked[1], ("describe",)] + [("plan",), ("build",), ("manifest",)] * 2
    seen.clear()
    again = build_sources(config.data)[1]
    assert seen == [walked[0], ("describe",), walked[1], ("describe",)]  # complete: used as they are
    assert [w.n_tokens for _, _, w in again] == [w.n_tokens for _, _, w in made] and made[0][2].n_tokens > 0
