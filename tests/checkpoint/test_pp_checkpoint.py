"""Checkpoints do not depend on pp: the Checkpointer takes a rank's stage modules (a list, one per
stage it holds) with one optimizer over all of them, and stores the unsplit model's names. A
checkpoint saved at pp 2 (one stage per rank; two per rank, Interleaved1F1B; FSDP'd at pp 2 x dp 2)
loads at pp 1 (world 1, and mp 2) and at pp 4 with every parameter and every optimizer state
(exp_avg, exp_avg_sq, step) bit-equal to the saving side's, and every param group's hyperparameters;
the reverse too. A save or a load that cannot be whole is refused in one line."""

import pytest
import torch

from tests.checkpoint.pp_stages import LAYOUTS, layout_parallel, optimizer_of, small_args, stage_modules, take_steps, values

SAVED_LRS = (0.0123, 0.0456)  # set on the saving side's two groups; a fresh optimizer has 1e-3


def _case_save(folder: str, layout: str) -> dict:
    from pathlib import Path

    from hybridpar.checkpoint.dcp import Checkpointer, params_dict

    args, parallel = small_args(), layout_parallel(layout)
    stages = stage_modules(layout, args, seed=0)
    optimizer = optimizer_of(stages)
    take_steps(stages, optimizer)
    for group, lr in zip(optimizer.param_groups, SAVED_LRS):
        group["lr"] = lr
    # The FSDP'd layout (what training saves) asynchronously, as checkpoint.async_save does.
    checkpointer = Checkpointer(Path(folder), parallel, async_save=LAYOUTS[layout][6])
    checkpointer.save(3, stages, optimizer, {"note": layout}, params_dict(args))
    checkpointer.close()
    return values(stages, optimizer)


def _case_load(folder: str, layout: str, as_list: bool = True) -> dict:
    from pathlib import Path

    from hybridpar.checkpoint.dcp import Checkpointer, params_dict

    args, parallel = small_args(), layout_parallel(layout)
    stages = stage_modules(layout, args, seed=1)  # other weights: the load must overwrite every one
    optimizer = optimizer_of(stages)
    model = stages if as_list or len(stages) > 1 else stages[0]
    state = Checkpointer(Path(folder), parallel).load(Path(folder) / "step-00000003", model, optimizer,
                                                      params_dict(args))
    assert state["note"] and state["step"] == 3
    return values(stages, optimizer)


def _merged(per_rank: list[dict]) -> dict:
    """Every rank's values by name (ranks of one stage hold the same names: they must agree)."""
    out = {"params": {}, "state": {}, "groups": per_rank[0]["groups"]}
    for result in per_rank:
        assert result["groups"] == out["groups"]
        for kind in ("params", "state"):
            for name, tensor in result[kind].items():
                if name in out[kind]:
                    assert torch.equal(out[kind][name], tensor), name
                out[kind][name] = tensor
    return out


def _assert_same(loaded: dict, saved: dict) -> None:
    for kind in ("params", "state"):
        assert sorted(loaded[kind]) == sorted(saved[kind]), kind
        differ = [n for n, t in saved[kind].items() if not torch.equal(loaded[kind][n], t)]
        assert not differ, f"{kind} not bit-equal after the load: {differ}"
    assert {k.rsplit("/", 1)[1] for k in saved["state"]} == {"exp_avg", "exp_avg_sq", "step"}
    assert [g["lr"] for g in loaded["groups"]] == list(SAVED_LRS)
    assert loaded["groups"] == saved["groups"]


@pytest.fixture(scope="module")
def saved(workers, tmp_path_factory):
    """layout -> (folder, merged values) of a checkpoint saved at that layout, made once."""
    made = {}

    def get(layout: str):
        if layout not in made:
            folder = tmp_path_factory.mktemp(layout)
            made[layout] = folder, _merged(workers(LAYOUTS[layout][0]).run(_case_save, str(folder), layout))
        return made[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [
    ("pp2", "pp1"), ("pp2", "pp1-mp2"), ("pp2", "pp4"),
    ("pp2-interleaved", "pp1"), ("pp2-interleaved", "pp4"),
    ("pp2-dp2-fsdp", "pp1"), ("pp2-dp2-fsdp", "pp4-fsdp"),
    ("pp1", "pp2"), ("pp1", "pp2-interleaved"),
    ("pp2", "pp2-embedding-alone"),  # rank 0's optimizer has an empty group (no norm): torch maps it only to an empty one
])
def test_a_checkpoint_loads_at_another_pp_bit_equal(saved, workers, source, target):
    folder, before = saved(source)
    as_list = target != "pp1"  # world 1 passes the model itself, the others a list of their stages
    after = _merged(workers(LAYOUTS[target][0]).run(_case_load, str(folder), target, as_list))
    _assert_same(after, before)


# --- refusals ----------------------------------------------------------------------------------


def _case_one_stage_each(folder: str, refuse: bool) -> str:
    from pathlib import Path

    from hybridpar.checkpoint import dcp
    from hybridpar.checkpoint.dcp import Checkpointer, CheckpointError, params_dict

    args, parallel = small_args(), layout_parallel("pp2-interleaved")
    first = stage_modules("pp2-interleaved", args, seed=0)[:1]  # ranks 0 and 1: stages 0 and 1 of 4
    real = dcp.refuse_incomplete_save
    if not refuse:
        dcp.refuse_incomplete_save = lambda *a: None
    try:
        Checkpointer(Path(folder), parallel).save(1, first, None, {}, params_dict(args))
        return "saved"
    except CheckpointError as err:
        return str(err)
    finally:
        dcp.refuse_incomplete_save = real


def _case_load_whole(folder: str) -> str:
    from pathlib import Path

    from hybridpar.checkpoint.dcp import Checkpointer, CheckpointError, params_dict

    args, parallel = small_args(), layout_parallel("pp1")
    try:
        Checkpointer(Path(folder), parallel).load(Path(folder) / "step-00000001", stage_modules("pp1", args, 0),
                                                  None, params_dict(args))
        return "loaded"
    except CheckpointError as err:
        return str(err)


def _case_stray_optimizer(folder: str) -> str:
    from pathlib import Path

    from hybridpar.checkpoint.dcp import Checkpointer, CheckpointError, params_dict

    args, parallel = small_args(), layout_parallel("pp2-interleaved")
    stages = stage_modules("pp2-interleaved", args, seed=0)
    try:
        Checkpointer(Path(folder), parallel).save(1, stages[:1], optimizer_of(stages), {}, params_dict(args))
        return "saved"
    except CheckpointError as err:
        return str(err)


@pytest.mark.slow
def test_a_save_or_load_that_cannot_be_whole_is_refused_in_one_line(workers, tmp_path):
    pool = workers(2)
    # Each rank gives one of its two stages: stages 0 and 1 of 4 saved, layers 3-5 and the head on no rank.
    refused = pool.run(_case_one_stage_each, str(tmp_path / "a"), True)
    assert refused[0] == refused[1], refused
    assert refused[0] == ("checkpoint step-00000001 not saved: no rank holds layers 3-5, norm.weight, output.weight "
                          "of the model (n_layers = 6); give Checkpointer.save every stage module each rank holds "
                          "(a list), on every rank"), refused[0]
    assert not list((tmp_path / "a").glob("step-*")), "nothing may be written"
    # Saved so anyway (the refusal off): the load into the whole model names what it lacks.
    assert pool.run(_case_one_stage_each, str(tmp_path / "b"), False) == ["saved", "saved"]
    said = workers(1).run(_case_load_whole, str(tmp_path / "b"))[0]
    assert said.startswith(f"{tmp_path / 'b' / 'step-00000001'} lacks layers 3-5, norm.weight, output.weight of this "
                           "model (its params.json is this model's): it was saved without them"), said
    assert "load another checkpoint" in said and "\n" not in said
    # The optimizer over both stages, the model one of them.
    stray = pool.run(_case_stray_optimizer, str(tmp_path / "c"))
    assert all(s.startswith("the optimizer holds ") and s.endswith(
        "parameters that are in none of the modules given to the checkpoint: pass every stage module this rank "
        "holds (a list), with the one optimizer over all their parameters") for s in stray), stray


def _case_group_counts(folder: str) -> str:
    from pathlib import Path

    import torch.distributed as dist

    from hybridpar.checkpoint.dcp import Checkpointer, CheckpointError, params_dict

    args, parallel = small_args(), layout_parallel("pp2")
    stages = stage_modules("pp2", args, seed=0)
    # rank 1 builds its AdamW without the trainer's two groups
    optimizer = optimizer_of(stages) if dist.get_rank() == 0 else torch.optim.AdamW(stages[0].parameters())
    try:
        Checkpointer(Path(folder), parallel).save(1, stages, optimizer, {}, params_dict(args))
        return "saved"
    except CheckpointError as err:
        return str(err)


def _case_union_refusals() -> list[str]:
    from hybridpar.checkpoint.dcp import CheckpointError
    from hybridpar.checkpoint.stages import one_module

    whole = stage_modules("pp1", small_args(), seed=0)[0]
    said = []
    for model in ([whole, whole], []):
        try:
            one_module(model)
            said.append("taken")
        except CheckpointError as err:
            said.append(str(err))
    return said


@pytest.mark.slow
def test_stage_lists_that_are_not_one_model_are_refused(workers, tmp_path):
    said = workers(2).run(_case_group_counts, str(tmp_path))
    assert said == ["the optimizers of the ranks have different numbers of param groups ([1, 2]): build the same "
                    "optimizer on every rank"] * 2, said
    twice, none = workers(1).run(_case_union_refusals)[0]
    assert twice == "tok_embeddings is in two of the stage modules given: give each stage once", twice
    assert none.startswith("no model given to the checkpoint: pass every stage module this rank holds"), none


def _case_save_after_validation(config) -> list:
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    trainer.run()
    return sorted(p.name for p in trainer.checkpointer.folder.glob("step-*"))


@pytest.mark.slow
def test_a_run_that_validates_at_its_last_step_saves_at_its_end(workers, corpus, tmp_path):
    """A forward without backward (validation, at the last step) leaves FSDP's root unit gathered, its
    registered parameters not the shards the optimizer holds: the end-of-run save must still go."""
    from tests.runs import make_config

    config = make_config(corpus, tmp_path / "run", steps=2, strategy="hybrid_shard", **{
        "data.val_fraction": 0.1, "checkpoint.at_end": True})
    assert workers(1).run(_case_save_after_validation, config) == [["step-00000002"]]
