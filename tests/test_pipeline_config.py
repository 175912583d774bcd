"""Pipeline parallelism's settings (parallel.pp, pp_layers, pp_schedule, pp_microbatches): every
mistake one line naming what to change, before any process group or run folder exists."""

import subprocess
import sys
import types

import pytest

from hybridpar.config import ConfigError, dump_toml, find_config, load_config
from hybridpar.mesh.layout import MeshSizeError
from hybridpar.preflight import check_values, resolve_job
from tests.distributed import child_pythonpath

# The local config's model (the tiny preset) has 4 layers; data.micro_batch_size 2 unless said.
TINY_LAYERS = 4


def _config(*overrides: str):
    return load_config(find_config("local"), ["--parallel.mp", "1", *overrides])


@pytest.mark.parametrize("overrides,world,said", [
    (["--parallel.pp", "3"], 4, "world size 4 is not divisible by mp * dp_replicate * pp = 1 * 1 * 3 = 3"),
    (["--parallel.pp", "8", "--data.micro_batch_size", "8"], 8,
     "8 pipeline stages (parallel.pp = 8) but the model has 4 layers, 6 counting the embedding and the output: "
     "choose a parallel.pp of at most 6"),
    (["--parallel.pp", "2", "--parallel.pp_microbatches", "3", "--data.micro_batch_size", "4"], 2,
     "parallel.pp_microbatches = 3 does not divide data.micro_batch_size = 4"),
    (["--parallel.pp", "2", "--data.micro_batch_size", "3"], 2,
     "parallel.pp_microbatches = 2 does not divide data.micro_batch_size = 3"),
    (["--parallel.pp", "4", "--parallel.pp_microbatches", "2"], 4,
     "parallel.pp_schedule = 1F1B needs at least 4 micro-batches (parallel.pp_microbatches = 2)"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_layers", "2,2"], 2,
     "parallel.pp_schedule = Interleaved1F1B needs at least 2 stages per rank (virtual stages), but "
     "parallel.pp_layers gives 1: list 4 stages' layers, or choose 1F1B"),
    (["--parallel.pp", "2", "--parallel.pp_layers", "2,1,1"], 2,
     "parallel.pp_layers lists 3 stages, not a multiple of parallel.pp = 2"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_layers", "1,1,0,1,1,0"], 2,
     "parallel.pp_schedule = ZBVZeroBubble needs exactly 2 stages per rank (its V), but parallel.pp_layers gives 3"),
    (["--parallel.pp", "2", "--parallel.pp_layers", "1,1,1,1"], 2,
     "parallel.pp_schedule = 1F1B runs one stage per rank, but parallel.pp_layers gives 2"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_microbatches", "5",
      "--data.micro_batch_size", "5"], 2, "parallel.pp_microbatches = 5 must be a multiple of 2"),
    (["--parallel.pp", "1", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_layers", "0,1,1,1,1,0"], 2,
     "parallel.pp_layers is set"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV", "--parallel.pp_layers", "4,0"], 2,
     "parallel.pp_schedule = DualPipeV needs at least 2 stages per rank"),
    (["--parallel.pp", "2", "--parallel.pp_layers", "2,3"], 2,
     "parallel.pp_layers sums to 5 layers, but the model has 4: list layers that add up to 4"),
    (["--parallel.pp", "3", "--parallel.pp_layers", "2,0,2", "--data.micro_batch_size", "3"], 3,
     "parallel.pp_layers [2, 0, 2] leaves a middle stage without a layer"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "PipeDream"], 2, "parallel.pp_schedule must be one of 1F1B"),
    (["--parallel.pp", "2", "--parallel.pp_layers", "2,x"], 2, "parallel.pp_layers must list each stage's"),
])
def test_a_pipeline_that_cannot_run_is_refused_in_one_line(overrides, world, said):
    try:
        check_values(_config(*overrides), world)
        message = "no error"
    except (ConfigError, MeshSizeError) as err:
        message = str(err)
    assert said in message and "\n" not in message, message


@pytest.mark.parametrize("overrides,world", [
    (["--parallel.pp", "2"], 2),
    (["--parallel.pp", "2", "--parallel.mp", "2"], 4),
    (["--parallel.pp", "6", "--data.micro_batch_size", "6"], 6),  # 4 layers + embedding + output
    (["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--data.micro_batch_size", "4"], 2),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_microbatches", "1"], 2),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_layers", "1,1,1,1"], 2),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe", "--parallel.pp_layers", "3, 1",
      "--parallel.pp_microbatches", "1"], 2),
])
def test_pipelines_that_fit_pass_the_checks(overrides, world):
    check_values(_config(*overrides), world)


def test_pp_layers_from_toml_and_the_command_line_are_one_list(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[parallel]\npp = 2\npp_layers = [3, 1]\n")
    assert load_config(toml).parallel.pp_layers == [3, 1]
    assert _config("--parallel.pp_layers", "3,1").parallel.pp_layers == [3, 1]
    assert _config("--parallel.pp_layers", "[3, 1]").parallel.pp_layers == [3, 1]  # a config's dict as flags
    assert _config("--parallel.pp_layers", "[]").parallel.pp_layers == []
    assert _config().parallel.pp == 1 and _config().parallel.pp_layers == []
    # The run folder's config.toml (the trainer writes it) keeps the list, and reads back as the same config
    for config in (_config("--parallel.pp_layers", "3,1"), _config()):
        (tmp_path / "run.toml").write_text(dump_toml(config))
        assert load_config(tmp_path / "run.toml").to_dict() == config.to_dict()


def test_training_at_pp_above_1_refuses_only_what_the_pipeline_cannot_run():
    import torch.distributed as dist

    assert resolve_job(_config("--parallel.pp", "2"), 2).sizes == (2, 1, 1, 1, 1)  # the local config validates
    v_shaped = _config("--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_microbatches", "2")
    with pytest.raises(ConfigError) as info:
        resolve_job(v_shaped, 2)
    assert str(info.value) == ("parallel.pp_schedule = ZBVZeroBubble cannot run the validation forward; choose "
                               "Interleaved1F1B (or 1F1B), or unset data.val_fraction and data.val_source")
    resolve_job(load_config(find_config("local"), ["--parallel.mp", "1", "--parallel.pp", "2", "--parallel.pp_schedule",
                                                   "ZBVZeroBubble", "--parallel.pp_microbatches", "2",
                                                   "--data.val_fraction", "0"]), 2)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        resolve_job(_config("--parallel.pp", "2", "--model.preset", "llama3.2_1b"), 2)
    assert not dist.is_initialized()


def test_hybridpar_train_at_pp_2_with_a_v_schedule_and_validation_is_one_line_and_makes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "hybridpar", "train", "--config", "local", "--parallel.mp", "1", "--parallel.pp", "2",
         "--parallel.pp_schedule", "ZBVZeroBubble", "--output.run_dir", str(run_dir)], capture_output=True, text=True,
        timeout=120, env={"PYTHONPATH": child_pythonpath(), "WORLD_SIZE": "2", "RANK": "0", "PATH": "/usr/bin:/bin"})
    ours = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert result.returncode != 0 and len(ours) == 1, result.stderr[-2000:]
    assert "parallel.pp_schedule = ZBVZeroBubble cannot run the validation forward" in ours[0]
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_generation_is_refused_at_pp_above_1():
    from hybridpar.generate import generate

    with pytest.raises(ValueError) as info:
        generate(None, types.SimpleNamespace(pp=2), [[1, 2]], 2)
    assert str(info.value).startswith("generation runs at pp = 1, this mesh has pp = 2")


@pytest.mark.slow
def test_the_dry_run_says_it_does_not_rehearse_pp_yet(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hybridpar", "train", "--config", "local", "--dry-run", "--world", "4",
         "--parallel.mp", "1", "--parallel.pp", "2", "--output.run_dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": child_pythonpath(), "PATH": "/usr/bin:/bin"})
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "FAIL mesh: parallel.pp = 2: the dry run rehearses pipeline parallelism later" in out, out
