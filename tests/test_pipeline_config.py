"""Pipeline parallelism's settings (parallel.pp, pp_layers, pp_schedule, pp_microbatches): every
mistake one line naming what to change, before any process group or run folder exists."""

import re
import subprocess
import sys
import types
from pathlib import Path

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
def test_one_schedule_table_names_torch_s_classes():
    from torch.distributed import pipelining

    from hybridpar.pipeline.schedules import MULTI_STAGE, SCHEDULES, V_SHAPED, stages_per_rank

    assert all(hasattr(pipelining, s.torch_class) for s in SCHEDULES.values())  # this torch has all five
    assert MULTI_STAGE == ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV") and V_SHAPED == MULTI_STAGE[1:]
    assert [stages_per_rank(n) for n in SCHEDULES] == [1, 1, 2, 2, 2]


def test_one_split_rule_for_the_trainer_and_preflight():
    """preflight refuses too many stages exactly where the trainer's split (stage_layer_counts)
    cannot cut them, and the split refuses a pp_layers preflight refuses, with preflight's line."""
    from hybridpar.pipeline.schedules import check_pipeline, stage_layer_counts
    for n_layers in range(0, 5):
        for pp in range(2, 9):
            try:
                stage_layer_counts(n_layers, pp)
                splits = True
            except ConfigError:
                splits = False
            try:
                check_pipeline(pp, "GPipe", [], 1, n_layers, 1)
                accepted = True
            except ConfigError:
                accepted = False
            assert splits == accepted, (n_layers, pp)
    with pytest.raises(ConfigError) as info:
        stage_layer_counts(4, 3, [2, 0, 2])
    assert str(info.value) == ("parallel.pp_layers [2, 0, 2] leaves a middle stage without a layer: give every "
                               "stage but the first and the last at least one")
    with pytest.raises(ConfigError, match="sums to 5 layers, but the model has 4"):
        stage_layer_counts(4, 2, [2, 3])


# The configs behind docs/training.md's table of pipeline refusals (the local config's 4-layer model);
# the table's last row is generate's.
DOCUMENTED_REFUSALS = [
    (["--parallel.pp", "2", "--parallel.pp_schedule", "PipeDream"], 2),
    (["--parallel.pp", "3"], 4),
    (["--parallel.pp", "8", "--data.micro_batch_size", "8"], 8),
    (["--parallel.pp", "2", "--parallel.pp_microbatches", "-1"], 2),
    (["--parallel.pp", "2", "--parallel.pp_microbatches", "2", "--data.micro_batch_size", "3"], 2),
    (["--parallel.pp", "4", "--parallel.pp_microbatches", "2"], 4),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_microbatches", "5",
      "--data.micro_batch_size", "5"], 2),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_layers", "2,2"], 2),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_layers", "1,1,0,1,1,0"], 2),
    (["--parallel.pp", "2", "--parallel.pp_layers", "1,1,1,1"], 2),
    (["--parallel.pp", "2", "--parallel.pp_layers", "2,1,1"], 2),
    (["--parallel.pp", "2", "--parallel.pp_layers", "2,3"], 2),
    (["--parallel.pp", "3", "--parallel.pp_layers", "2,0,2", "--data.micro_batch_size", "3"], 3),
    (["--parallel.pp", "1", "--parallel.pp_layers", "2,2"], 2),
    (["--parallel.pp", "2", "--parallel.pp_layers", "2,x"], 2),
]


def training_md_refusal_lines() -> list[str]:
    """The lines docs/training.md's table of pipeline refusals quotes, in its order."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    section = page.split("\n## Pipeline parallelism\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section.split("| the line says |", 1)[1], re.M)


def test_training_md_quotes_the_refusals_as_they_are_said(monkeypatch):
    """Every line docs/training.md's table quotes is one preflight (or generate) says, and each says one."""
    from hybridpar.pipeline import schedules as pipeline
    from hybridpar.generate import generate

    messages = []
    for overrides, world in DOCUMENTED_REFUSALS:
        with pytest.raises((ConfigError, MeshSizeError)) as info:
            check_values(_config(*overrides), world)
        messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        generate(None, types.SimpleNamespace(pp=2), [[1, 2]], 2)
    messages.append(str(info.value))
    monkeypatch.setattr(pipeline, "_torch_has", lambda name: False)  # a torch before DualPipeV
    with pytest.raises(ConfigError) as info:
        check_values(_config("--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV"), 2)
    messages.append(str(info.value))
    quoted = training_md_refusal_lines()
    assert len(quoted) == len(messages), quoted
    for line in quoted:
        assert any(line in m for m in messages), line
