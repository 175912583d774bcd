"""The replica check passes on healthy training and names a planted divergence."""

import pytest
import torch

from hybridpar.diagnostics.replicas import checksums as _checksums
from tests.distributed import parallel_dims
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
            sums.append(_checksums([_one_parameter(values)])[3])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(sums[0], sums[1])
    swapped = values.clone()
    swapped[[0, 1]] = values[[1, 0]]
    assert not torch.equal(_checksums([_one_parameter(swapped)])[3], sums[0])


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


# --- pipeline parallelism: each stage's copies among themselves ------------------------------------

def _case_stage_replicas() -> dict:
    """pp 2 x dp_replicate 2 (world 4; ranks 0, 1 hold stage 0, ranks 2, 3 stage 1), each stage cut with
    build_stage and sharded as apply_fsdp shards (no_shard: dp_replicate copies): healthy copies pass;
    a planted divergence on rank 3 is named with its stage. Then 2 stages per rank (Interleaved1F1B's
    looped ids: rank pp 1 holds stages 1 and 3) as a list of modules."""
    import torch
    import torch.distributed as dist

    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.diagnostics.replicas import ReplicaMismatchError, check_replicas
    from hybridpar.models.args import ModelArgs
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.pipeline.schedules import stage_ids, stage_layer_counts
    from hybridpar.pipeline.cutting import build_stage

    args = ModelArgs.from_preset("tiny", dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, n_layers=4)
    parallel = parallel_dims(pp=2, dp_replicate=2, dp_shard=1)

    def stages(virtual: int) -> tuple[list, list[int]]:
        counts = stage_layer_counts(args.n_layers, 2 * virtual)
        ids = stage_ids(parallel.pp_rank, 2, virtual, "Interleaved1F1B" if virtual > 1 else "1F1B")
        models = []
        for s in ids:
            torch.manual_seed(s)  # each stage its own values, the same on its replicas
            model = build_stage(args, parallel, s, counts)
            models.append(apply_fsdp(model, parallel, FSDPConfig(sharding_strategy="no_shard", param_dtype="float32")))
        return models, ids

    def check(models, ids) -> str:
        try:
            check_replicas(models[0] if len(models) == 1 else models, parallel, 7, stages=ids)
        except ReplicaMismatchError as err:
            return str(err)
        return "ok"

    out = {}
    for virtual, name in ((1, "layers.2.attention.wq.weight"), (2, "output.weight")):
        models, ids = stages(virtual)
        out[f"healthy{virtual}"] = check(models, ids)
        if dist.get_rank() == 3:
            with torch.no_grad():
                params = {n: p for m in models for n, p in m.named_parameters()}
                params[name].to_local().view(-1)[0] += 1e-3
        out[f"planted{virtual}"] = check(models, ids)
    return out


@pytest.mark.slow
def test_pipeline_stages_compare_only_their_own_copies(workers):
    results = workers(4).run(_case_stage_replicas)
    for r in results:
        assert (r["healthy1"], r["healthy2"]) == ("ok", "ok"), r
    print(f"\n{results[0]['planted1']}\n{results[0]['planted2']}")
    for key in ("planted1", "planted2"):
        assert len({r[key] for r in results}) == 1  # every rank raises the same error
    assert results[0]["planted1"] == ("replica check, step 7: copies that must be identical differ: stage 1: "
                                      "layers.2.attention.wq.weight on data-parallel replicas [2, 3] "
                                      "(ranks [3] differ from rank 2)")
    assert results[0]["planted2"].endswith(": stage 3: output.weight on data-parallel replicas [2, 3] "
                                           "(ranks [3] differ from rank 2)")
