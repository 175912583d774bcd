"""Checkpoints do not depend on cp: a run trained at cp 2 and saved mid-run resumes at cp 1 (world 1,
and dp 2 at world 2) and at cp 4 (world 4) from the saved data position, and every loss after the
resume and every final parameter equal the uninterrupted cp 2 run's."""

import shutil

import pytest
import torch

from tests.checkpoint.test_dcp import HALF, STEPS, _case_run
from tests.distributed import rel_err
from tests.runs import make_config

BOUND = 1e-5


def _config(corpus, folder, run_dir, *, cp, dp=1):
    return make_config(corpus, run_dir, dp=dp, steps=STEPS,
                       **{"parallel.cp": cp, "checkpoint.folder": str(folder), "checkpoint.resume": True,
                          "checkpoint.at_end": True, "optim.warmup_steps": 3})


@pytest.fixture(scope="module")
def cp2_runs(workers, corpus, tmp_path_factory):
    """At cp 2 (world 2): 10 steps straight through, and a run stopped and saved at step 5."""
    root = tmp_path_factory.mktemp("cp2")
    straight = workers(2).run(_case_run, _config(corpus, root / "straight", root / "run0", cp=2))[0]
    half = workers(2).run(_case_run, _config(corpus, root / "half", root / "run1", cp=2), HALF)[0]
    return {"straight": straight, "half": half, "folder": root / "half"}


# target: (world, cp, dp) of the resumed run
TARGETS = {"cp1-world1": (1, 1, 1), "cp1-dp2": (2, 1, 2), "cp4-world4": (4, 4, 1)}


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_cp2_checkpoint_resumes_at_another_cp(cp2_runs, check_close, workers, corpus, tmp_path, target):
    s = cp2_runs
    assert s["half"]["losses"] == s["straight"]["losses"][:HALF]
    folder = tmp_path / "ckpt"  # a copy: each target resumes from step 5, not from another's step 10
    shutil.copytree(s["folder"] / f"step-{HALF:08d}", folder / f"step-{HALF:08d}")
    world, cp, dp = TARGETS[target]
    resumed = workers(world).run(_case_run, _config(corpus, folder, tmp_path / "run", cp=cp, dp=dp))[0]
    assert resumed["start"] == HALF
    expected = s["straight"]["losses"][HALF:]
    print(f"\ncp2 straight   {expected}\n{target} resumed {resumed['losses']}")
    assert len(resumed["losses"]) == len(expected) == STEPS - HALF, (len(resumed["losses"]), len(expected))
    errors = {f"loss step {HALF + 1 + i}": rel_err(torch.tensor(a), torch.tensor(b))
              for i, (a, b) in enumerate(zip(resumed["losses"], expected))}
    print("relative errors of the losses:", {k: f"{v:.2e}" for k, v in errors.items()})
    straight = s["straight"]["params"]
    assert sorted(resumed["params"]) == sorted(straight)
    errors.update({name: rel_err(resumed["params"][name], value) for name, value in straight.items()})
    check_close(f"cp2 -> {target}", errors, BOUND)
