"""A rank's pipeline stages built by the one build_model (hybridpar.pipeline.cutting.build_stages): the whole
model's weights for the same seed at pp 2 x mp 2 (two stages per rank), a `load` filling stages
built without drawing a weight, and activation checkpointing chosen by the layer's index in the
whole model, not its place in the stage."""

import pytest
import torch
from torch import nn

from tests.distributed import parallel_dims


def _checkpointed(blocks) -> list[str]:
    from torch.distributed._composable.contract import _get_registry

    return [name for name, block in blocks.items() if "checkpoint" in (_get_registry(block) or {})]


def test_selective_checkpointing_counts_the_layers_index():
    from hybridpar.parallel.fsdp import apply_activation_checkpointing

    stage = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in (3, 4, 5)})  # a stage holding layers 3, 4, 5
    assert apply_activation_checkpointing(stage, "selective", 2) == [4]
    assert _checkpointed(stage) == ["4"]
    assert apply_activation_checkpointing([nn.Linear(2, 2) for _ in range(3)], "selective", 2) == [0, 2]


def _case_stages() -> dict:
    from hybridpar.build import build_model
    from hybridpar.pipeline.schedules import StageLayout
    from hybridpar.pipeline.cutting import build_stages
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.parallel.layers import local_tensor
    from tests.parallel.test_pipeline import _args

    args, parallel = _args(), parallel_dims(mp=2, pp=2)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    whole = {k: local_tensor(v) for k, v in build_model(args, parallel, device=cpu).state_dict().items()}

    def differing(stages) -> list[str]:
        return [k for s in stages for k, v in s.state_dict().items() if not torch.equal(local_tensor(v), whole[k])]

    out = {}
    torch.manual_seed(0)
    layout = StageLayout.of(args.n_layers, parallel.pp, parallel.pp_rank, "Interleaved1F1B")
    stages, out["ids"] = build_stages(args, parallel, layout, device=cpu), list(layout.ids)
    out["keys"] = [sorted(s.state_dict()) for s in stages]
    out["drawn"] = differing(stages)

    def load(model):  # a checkpoint's stand-in: every weight of the stage from the whole model
        with torch.no_grad():
            for k, v in model.state_dict().items():
                local_tensor(v).copy_(whole[k])

    torch.manual_seed(1)  # another seed: the weights can only come from `load`
    rng = torch.random.get_rng_state()
    v_shaped = StageLayout.of(args.n_layers, parallel.pp, parallel.pp_rank, "ZBVZeroBubble")
    loaded = build_stages(args, parallel, v_shaped, device=cpu, load=load)
    out["loaded"] = differing(loaded)
    out["rng_untouched"] = torch.equal(rng, torch.random.get_rng_state())  # built on meta: nothing drawn

    fsdp = FSDPConfig(activation_checkpointing="selective", ac_every=2, param_dtype="float32")
    torch.manual_seed(0)
    stages = build_stages(args, parallel, layout, device=cpu, fsdp=fsdp)
    out["checkpointed"] = [_checkpointed(s.layers) for s in stages]
    out["layers"] = [list(s.layers) for s in stages]
    return out


@pytest.mark.slow
def test_stages_hold_the_whole_models_weights(workers):
    ranks = workers(4).run(_case_stages)  # pp 2 x mp 2: ranks 0, 1 on pp rank 0; 2, 3 on pp rank 1
    for rank, out in enumerate(ranks):
        pp_rank = rank // 2
        assert out["ids"] == [pp_rank, pp_rank + 2]
        # 6 layers + embedding + head over 4 stages: layers 0 | 1 2 | 3 4 | 5
        assert out["layers"] == [["0"], ["3", "4"]] if pp_rank == 0 else [["1", "2"], ["5"]]
        assert out["drawn"] == [] and out["loaded"] == [], out
        assert out["rng_untouched"]
        # layers 0, 2, 4 (every 2nd of the whole model), whatever their place in the stage
        assert out["checkpointed"] == ([["0"], ["4"]] if pp_rank == 0 else [["2"], []])
    first, last = ranks[0]["keys"][0], ranks[2]["keys"][1]
    assert "tok_embeddings.weight" in first and "output.weight" not in first
    assert "output.weight" in last and "norm.weight" in last and "tok_embeddings.weight" not in last
