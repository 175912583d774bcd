"""The command line as a user runs it: `hybridpar train` without a launcher, and the quickstart script."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    # No launcher variables: the run must work as a plain process.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    return result


@pytest.mark.slow
def test_train_world_of_one_without_launcher(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: " + "the quick brown fox jumps. " * 20}) + "\n"
                            for i in range(200)))
    result = _run([sys.executable, "-m", "hybridpar", "train", "--model.preset", "debug", "--model.vocab_size", "512",
                   "--data.source", str(data), "--data.cache_dir", str(tmp_path / "cache"),
                   "--data.tokenizer_vocab_size", "300", "--data.seq_len", "32", "--train.steps", "3",
                   "--train.peak_flops", "1e12", "--output.run_dir", str(tmp_path / "run"),
                   "--output.tensorboard", "false", "--output.plot", "false", "--fsdp.param_dtype", "float32"], 300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step     3/3" in result.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # steps 1 and 3


def test_train_help_names_every_key_of_every_section_with_its_default_and_meaning():
    import dataclasses

    from hybridpar.config import Config

    result = _run([sys.executable, "-m", "hybridpar", "train", "--help"], 120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    page = (ROOT / "docs" / "training.md").read_text()  # the config key table
    checkpoints = (ROOT / "docs" / "checkpoints.md").read_text()  # the [checkpoint] keys' own table
    config = Config()
    for section in dataclasses.fields(config):
        assert f"[{section.name}]" in lines, section.name
        row = next(line for line in page.splitlines() if line.startswith(f"| `[{section.name}]` |"))
        for field in dataclasses.fields(getattr(config, section.name)):
            key = f"--{section.name}.{field.name}"
            line = next((x for x in lines if x.strip().startswith(key + " ")), None)
            assert line is not None, f"{key} missing from train --help"
            default = json.dumps(getattr(getattr(config, section.name), field.name))
            assert f"(default {default})  " in line and line.split(")  ", 1)[1].strip(), line
            if section.name != "checkpoint":  # the [checkpoint] row points to its own table
                assert f"`{field.name}`" in row, f"docs/training.md's [{section.name}] row does not name {field.name}"
            else:
                assert f"| `{field.name}` |" in checkpoints, f"docs/checkpoints.md's table does not name {field.name}"


@pytest.mark.slow
def test_a_wheel_installed_outside_the_checkout_trains_with_a_named_config(corpus, tmp_path):
    """`hybridpar train --config local` from a wheel in a fresh environment, run away from the
    checkout: the named configs and model presets are package data."""
    import shutil

    source = tmp_path / "src"
    for folder in ("hybridpar", "models"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path / "wheel"), str(source)], 300)
    assert built.returncode == 0, built.stderr[-3000:]
    env_dir = tmp_path / "env"  # torch and the other dependencies come from this interpreter's packages
    made = _run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], 120)
    assert made.returncode == 0, made.stderr
    python = str(env_dir / "bin" / "python")
    wheel = next((tmp_path / "wheel").glob("hybridpar-*.whl"))
    installed = _run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], 300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    where = subprocess.run([python, "-c", "import hybridpar; print(hybridpar.__file__)"], cwd=away,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr  # not the checkout's
    result = subprocess.run(
        [python, "-m", "hybridpar", "train", "--config", "local", "--parallel.mp", "1", "--parallel.dp_shard", "1", "--train.steps", "2",
         "--model.preset", "debug", "--model.vocab_size", "512", "--data.tokenizer_vocab_size", "512",
         "--data.seq_len", "32", "--data.source", corpus["source"], "--data.cache_dir", corpus["cache_dir"],
         "--train.peak_flops", "1e12", "--output.run_dir", str(away / "run"), "--checkpoint.at_end", "false"],
        cwd=away, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step     2/2" in result.stdout


def test_bad_override_is_one_clear_line():
    result = _run([sys.executable, "-m", "hybridpar", "train", "--train.stepz", "3"], 120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("hybridpar: error: unknown config key 'train.stepz'")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_quickstart_script_trains_and_writes_its_outputs(tmp_path):
    """The README's main job, shortened: 4 processes, mp 2 x dp 2, the embedded corpus."""
    run_dir = tmp_path / "local"
    result = _run(["bash", "launch/local.sh", "--train.steps", "30", "--output.run_dir", str(run_dir)], 900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"\nquickstart loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
    assert rows[-1]["step"] == 30 and rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert any((run_dir / "tensorboard").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("mistake,flags,message", [
    ("same_data", {}, "hybridpar: error: data guard, step 1"),
    ("none", {"--parallel.mp": "3"}, "hybridpar: error: "),
])
def test_an_error_every_rank_raises_is_one_screen(corpus, tmp_path, mistake, flags, message):
    """Under torchrun at world 4: the message once, from rank 0, without a traceback; every rank's
    traceback in the run folder's logs, which the message names; a non-zero exit."""
    run_dir = tmp_path / "run"
    args = {"--config": "local", "--train.steps": "2", "--output.run_dir": str(run_dir), "--model.preset": "debug",
            "--model.vocab_size": "512", "--data.tokenizer_vocab_size": "512", "--data.seq_len": "32",
            "--data.source": corpus["source"], "--data.cache_dir": corpus["cache_dir"], "--train.peak_flops": "1e12",
            **flags}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "tests" / "diagnostics" / "cli_job.py"), mistake, "--",
           *[x for kv in args.items() for x in kv]]
    result = _run(cmd, 600)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    print("\n" + "\n".join(ours))
    assert len(ours) == 1 and ours[0].startswith(message), result.stderr[-3000:]
    assert not re.search(r"^\[rank\d+\]:", result.stderr, re.M), result.stderr[-3000:]  # no rank's traceback
    assert result.stderr.count("Traceback") <= 1  # torchrun's own, around its summary
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert logs == [f"rank-{r}.log" for r in range(4)] and str(run_dir / "logs") in ours[0]
    assert "Traceback" in (run_dir / "logs" / "rank-2.log").read_text()


def _bad_params_json(folder: Path) -> Path:
    path = folder / "params.json"
    path.write_text(json.dumps({"dim": "256", "n_layers": 4, "n_heads": 8, "vocab_size": 4096}))
    return path


BAD_DIM = 'params.json: "dim" must be an integer, got the string "256"'


def test_train_with_a_bad_params_json_is_one_clear_line(tmp_path):
    result = _run([sys.executable, "-m", "hybridpar", "train", "--model.params_json", str(_bad_params_json(tmp_path)),
                   "--output.run_dir", str(tmp_path / "run")], 120)
    assert result.returncode == 2, result.stdout + result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert len(ours) == 1 and ours[0].startswith(f"hybridpar: error: {tmp_path}/{BAD_DIM}"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_with_a_bad_params_json_at_world_2_prints_it_once(tmp_path):
    """Every rank reads the file and refuses it; rank 0 alone prints the message."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "diagnostics" / "cli_job.py"), "none", "--",
           "--model.params_json", str(_bad_params_json(tmp_path)), "--output.run_dir", str(tmp_path / "run")]
    result = _run(cmd, 300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert len(ours) == 1 and ours[0].startswith(f"hybridpar: error: {tmp_path}/{BAD_DIM}"), result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]
