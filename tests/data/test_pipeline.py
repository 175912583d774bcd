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
