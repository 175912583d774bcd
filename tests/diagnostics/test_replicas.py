"""The replica check passes on healthy training and names a planted divergence."""

import pytest
import torch

from hybridpar.diagnostics.replicas import _checksums
from tests.runs import make_config


def _one_parameter(values):
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(values)
    return model


def test_checksums_do_not_depend_on_the_thread_count():
    # Values of many magnitudes: a float sum split over 1 or 2 threads rounds differently.
    g = torch.Generator().manual_seed(0)
    values = torch.randn(40000, generator=g) * torch.rand(40000, generator=g).pow(8) * 1e4
    threads = torch.get_num_threads()
    sums = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            sums.append(_checksums(_one_parameter(values))[2])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(sums[0], sums[1])
    swapped = values.clone()
    swapped[[0, 1]] = values[[1, 0]]
    assert not torch.equal(_checksums(_one_parameter(swapped))[2], sums[0])


def _case_replicas(config, plant):
    import torch
    import torch.distributed as dist

    from hybridpar.diagnostics.replicas import ReplicaMismatchError, check_replicas
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    trainer.run()  # replica_check_every = 1: healthy steps must pass
    if plant is not None:
        name, rank = plant
        if dist.get_rank() == rank:
            with torch.no_grad():
                dict(trainer.model.named_parameters())[name].to_local().view(-1)[0] += 1e-3
    try:
        check_replicas(trainer.model, trainer.parallel, trainer.step)
    except ReplicaMismatchError as err:
        return str(err)
    return "ok"


LAYOUTS = {  # world, make_config keyword arguments
    "mp2-no_shard-dp2": (4, dict(mp=2, dp_shard=1, dp_replicate=2, strategy="no_shard", dp=2)),
    "mp2-hybrid-2x2": (8, dict(mp=2, dp_shard=2, dp_replicate=2, strategy="hybrid_shard", dp=4)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_healthy_training_passes(workers, corpus, tmp_path, layout):
    world, kwargs = LAYOUTS[layout]
    config = make_config(corpus, tmp_path, steps=3, **kwargs, **{"diagnostics.replica_check_every": 1})
    assert workers(world).run(_case_replicas, config, None) == ["ok"] * world


def test_planted_divergence_is_named(workers, corpus, tmp_path):
    world, kwargs = LAYOUTS["mp2-hybrid-2x2"]
    config = make_config(corpus, tmp_path, steps=2, **kwargs, **{"diagnostics.replica_check_every": 1})
    # Rank 5 = replicate 1, shard 0, mp 1: its FSDP shard of wq has a copy on rank 1.
    messages = workers(world).run(_case_replicas, config, ("layers.0.attention.wq.weight", 5))
    print(f"\n{messages[0]}")
    assert len(set(messages)) == 1
    assert "layers.0.attention.wq.weight on data-parallel replicas [1, 5] (ranks [5] differ from rank 1)" in messages[0]


def test_planted_divergence_of_an_mp_replicated_norm(workers, corpus, tmp_path):
    world, kwargs = LAYOUTS["mp2-no_shard-dp2"]
    config = make_config(corpus, tmp_path, steps=2, **kwargs, **{"diagnostics.replica_check_every": 1})
    messages = workers(world).run(_case_replicas, config, ("norm.weight", 3))
    assert "norm.weight on data-parallel replicas [1, 3] (ranks [3] differ from rank 1)" in messages[0]
    assert "norm.weight on model-parallel copies [2, 3] (ranks [3] differ from rank 2)" in messages[0]
