"""Pipeline parallelism's model side (hybridpar.pipeline: schedules, stages, engine): the stage split rule, and the loss
and every parameter's gradient of a pipelined model, through torch's schedules on an explicit pp
process group, against the unsplit model's (fp32, same seed)."""

import pytest
import torch

from hybridpar.pipeline.schedules import stage_ids, stage_layer_counts
from hybridpar.pipeline.cutting import stage_layers
from tests.distributed import parallel_dims, rel_err


def test_split_rule_counts_embedding_and_head_as_layers():
    assert stage_layer_counts(32, 8) == [4, 5, 4, 4, 4, 4, 4, 3]  # 34 units: 5,5,4,...; ends give one each
    assert sum(stage_layer_counts(126, 16)) == 126
    assert stage_layer_counts(126, 16) == [7] + [8] * 14 + [7]  # 128 units, 8 each
    assert stage_layer_counts(126, 32) == [3] + [4] * 30 + [3]
    assert stage_layer_counts(4, 4) == [1, 2, 1, 0]
    assert stage_layer_counts(32, 2, [10, 22]) == [10, 22]
    with pytest.raises(ValueError, match="pp_layers"):
        stage_layer_counts(32, 2, [10, 21])
    with pytest.raises(ValueError, match="at most 6 stages"):
        stage_layer_counts(4, 8)
    assert stage_layers(2, [3, 5, 4]) == [8, 9, 10, 11]


def test_stage_ids_looped_and_v():
    assert stage_ids(1, 4, 2, "Interleaved1F1B") == [1, 5]
    assert stage_ids(1, 4, 2, "ZBVZeroBubble") == [1, 6]
    assert stage_ids(0, 2, 1, "1F1B") == [0]


def _args():
    from hybridpar.models.args import ModelArgs

    return ModelArgs.from_preset("tiny", dim=64, n_heads=4, n_kv_heads=2, vocab_size=256, n_layers=6)


def _case_stage_keys() -> dict:
    from hybridpar.models.llama import Transformer
    from hybridpar.pipeline.cutting import build_stage

    args, parallel = _args(), parallel_dims(mp=1)
    counts = stage_layer_counts(args.n_layers, 2)
    with torch.device("meta"):
        full = set(Transformer(args, parallel).state_dict())
        stages = [set(build_stage(args, parallel, s, counts).state_dict()) for s in range(2)]
    return {"full": full, "stages": stages, "layers": [stage_layers(s, counts) for s in range(2)]}


@pytest.mark.slow
def test_stage_keeps_layer_names(workers):
    out = workers(2).run(_case_stage_keys)[0]
    first, second = out["stages"]
    assert first < out["full"] and second < out["full"] and first | second == out["full"] and not first & second
    for keys, layers in zip(out["stages"], out["layers"]):
        assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {str(i) for i in layers}
    assert "output.weight" in second and "norm.weight" in second and "tok_embeddings.weight" in first
    assert not any(k.startswith("tok_embeddings") for k in second)


def _case_pipeline(schedule: str, virtual: int, n_micro: int) -> dict:
    import torch.distributed as dist

    from hybridpar.models.llama import Transformer
    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.pipeline.engine import PipelineEngine
    from hybridpar.pipeline.cutting import build_stage

    parallel = parallel_dims(mp=1)
    group = dist.new_group(list(range(dist.get_world_size())))  # the explicit pp group
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    args = _args()
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, args.vocab_size, (4, 16), generator=gen)
    targets = torch.randint(0, args.vocab_size, (4, 16), generator=gen)
    targets[0, :5] = -100  # ignored targets: the mean is over the counted tokens of the whole batch
    scale = 1.0 / (targets != -100).sum().item()
    torch.manual_seed(0)
    full = Transformer(args, parallel)
    loss = vocab_parallel_cross_entropy(full(tokens), targets, parallel=parallel, reduction="sum") * scale
    loss.backward()
    want = {n: p.grad for n, p in full.named_parameters()}

    counts = stage_layer_counts(args.n_layers, pp * virtual)
    ids = stage_ids(rank, pp, virtual, schedule)
    stages = []
    for s in ids:
        torch.manual_seed(0)
        stages.append(build_stage(args, parallel, s, counts))
    engine = PipelineEngine(stages, ids, group, schedule, n_micro, torch.device("cpu"), parallel.mp_group)
    got = engine.step(tokens, targets, scale)
    errors = {}
    if got is not None:
        errors["loss"] = rel_err(got, loss)
    for m in stages:
        for n, p in m.named_parameters():
            errors[n] = rel_err(p.grad, want[n])
    return {"errors": errors, "names": [n for n, _ in full.named_parameters()]}


@pytest.mark.slow
@pytest.mark.parametrize("world,schedule,virtual,n_micro", [
    (2, "1F1B", 1, 2), (2, "Interleaved1F1B", 2, 2), (2, "ZBVZeroBubble", 2, 2), (4, "GPipe", 1, 4),
    (4, "1F1B", 1, 4)])
def test_pipeline_matches_unsplit(workers, world, schedule, virtual, n_micro):
    per_rank = workers(world).run(_case_pipeline, schedule, virtual, n_micro)
    errors = [r["errors"] for r in per_rank]
    # the loss and every parameter's gradient, each from some stage
    assert set().union(*errors) == {"loss", *per_rank[0]["names"]}
    worst = max(max(e.values()) for e in errors)
    assert worst < 1e-6, errors

