"""Checkpoints do not depend on pp, through the trainer (issue 38's must-show): a run trained at pp 2
(1F1B, world 2) and saved mid-run resumes at pp 1 x mp 2 (world 2) and at pp 4 (1F1B, world 4, 4
micro-batches) from the saved data position, and every loss after the resume and every final
parameter are within 1e-5 of the uninterrupted pp 2 run's."""

import shutil

import pytest
import torch

from tests.distributed import rel_err
from tests.runs import make_config

BOUND = 1e-5
STEPS, HALF = 8, 4
LAYERS = {"model.n_layers": 4}  # 6 units (the embedding and the head count as one each): 4 stages fit


def _case_run(config, stop_after=None):
    """Train (resuming if configured); optionally stop after `stop_after` steps and save there. Every
    rank returns the full parameters of the stages it holds (rank 0 also the losses it logs)."""
    import torch.distributed as dist

    from hybridpar.parallel.state import full_state_dict
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    start = trainer.step
    if stop_after is not None:
        config.train.steps = stop_after
    history = trainer.run()
    params = {name: value for part in trainer.model_parts for name, value in full_state_dict(part).items()}
    return {"start": start, "losses": [m["loss"] for m in history] if dist.get_rank() == 0 else None,
            "params": params, "parts": len(trainer.model_parts), "pp": trainer.parallel.pp}


def _params(per_rank: list) -> dict:
    """Every rank's parameters by name; ranks holding one name must agree on it exactly."""
    out = {}
    for result in per_rank:
        for name, value in result["params"].items():
            assert name not in out or torch.equal(out[name], value), name
            out[name] = value
    return out


def _config(corpus, folder, run_dir, *, pp, mp=1):
    return make_config(corpus, run_dir, mp=mp, strategy="hybrid_shard" if mp > 1 else "full_shard", steps=STEPS,
                       **LAYERS, **{"parallel.pp": pp, "parallel.pp_schedule": "1F1B",
                                    "checkpoint.folder": str(folder), "checkpoint.resume": True,
                                    "checkpoint.at_end": True, "optim.warmup_steps": 3})


@pytest.fixture(scope="module")
def pp2_runs(workers, corpus, tmp_path_factory):
    """At pp 2 (world 2): 8 steps straight through, and a run stopped and saved at step 4."""
    root = tmp_path_factory.mktemp("pp2")
    straight = workers(2).run(_case_run, _config(corpus, root / "straight", root / "run0", pp=2))
    half = workers(2).run(_case_run, _config(corpus, root / "half", root / "run1", pp=2), HALF)
    return {"straight": straight, "half": half, "folder": root / "half"}


# target: (world, pp, mp) of the resumed run
TARGETS = {"pp1-mp2": (2, 1, 2), "pp4-1F1B": (4, 4, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_pp2_checkpoint_resumes_at_another_pp(pp2_runs, check_close, workers, corpus, tmp_path, target):
    s = pp2_runs
    assert s["half"][0]["losses"] == s["straight"][0]["losses"][:HALF]
    folder = tmp_path / "ckpt"  # a copy: each target resumes from step 4, not from another's step 8
    shutil.copytree(s["folder"] / f"step-{HALF:08d}", folder / f"step-{HALF:08d}")
    world, pp, mp = TARGETS[target]
    resumed = workers(world).run(_case_run, _config(corpus, folder, tmp_path / "run", pp=pp, mp=mp))
    assert {r["start"] for r in resumed} == {HALF}
    assert [(r["pp"], r["parts"]) for r in resumed] == [(pp, 1)] * world
    expected, got = s["straight"][0]["losses"][HALF:], resumed[0]["losses"]
    print(f"\npp2 straight   {expected}\n{target} resumed {got}")
    assert len(got) == len(expected) == STEPS - HALF, (len(got), len(expected))
    errors = {f"loss step {HALF + 1 + i}": rel_err(torch.tensor(a), torch.tensor(b))
              for i, (a, b) in enumerate(zip(got, expected))}
    print("relative errors of the losses:", {k: f"{v:.2e}" for k, v in errors.items()})
    straight, params = _params(s["straight"]), _params(resumed)
    assert sorted(params) == sorted(straight)
    errors.update({name: rel_err(params[name], value) for name, value in straight.items()})
    check_close(f"pp2 -> {target}", errors, BOUND)
