"""The torchtitan reference (bench/gpu/titan.py) without torchtitan: one JSON line saying why, exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
        "--vocab", "256", "--seq", "64", "--warmup", "1", "--steps", "2"]


@pytest.mark.parametrize("float8", [[], ["--float8", "tensorwise"]], ids=["bf16", "float8"])
def test_without_torchtitan_one_line_says_why(tmp_path, float8):
    # A torchtitan that cannot be imported, whether or not this machine has the real one.
    fake = tmp_path / "site" / "torchtitan"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torchtitan hidden by the test')\n")
    out = tmp_path / "titan.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "titan.py"), *TINY, "--compile", *float8,
                           "--json", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TITAN_JSON ")]
    assert len(lines) == 1 and proc.stdout.splitlines()[-1] == lines[0], proc.stdout[-2000:]
    result = json.loads(lines[0][len("TITAN_JSON "):])
    assert result["ok"] is False and result["compile"] is True
    assert result.get("float8") == ({"recipe": "tensorwise"} if float8 else None)  # the caller's row names it
    assert result["why"] == "import torchtitan's llama3: ImportError: torchtitan hidden by the test"
    assert "\n" not in result["why"] and "Traceback" not in proc.stdout + proc.stderr
    assert json.loads(out.read_text()) == result


def test_a_wrong_ac_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "titan.py"), *TINY, "--ac", "sometimes"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "TITAN_JSON" not in proc.stdout
    assert proc.stderr.splitlines()[-1].endswith("--ac 'sometimes': give 'op', 'full', 'none' or a block count such as 2")


@pytest.mark.slow
def test_with_torchtitan_it_trains_the_shape_it_was_given(tmp_path):
    pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (CI needs none)")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "titan.py"), *TINY, "--ac", "2"],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1][len("TITAN_JSON "):])
    assert result["ok"], result
    # every 2nd of 2 blocks checkpointed; embedding, 2 blocks, norm, output and the root sharded
    assert result["wrapped"] == {"blocks": 2, "checkpointed": 1, "compiled": 0, "fsdp_units": 6}
    assert result["settings"]["ac"] == "selective every 2 blocks"
    assert len(result["step_s"]) == 2 and result["tokens_per_s"] == pytest.approx(64 / result["step_s_median"])
    assert result["loss_last"] < result["loss_first"]  # the same batch thrice: AdamW lowers its loss


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_with_torchtitan_its_float8_converter_trains_the_recipe(tmp_path, recipe):
    pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (CI needs none)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "titan.py"), *TINY, "--ac", "2",
                           "--float8", recipe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1][len("TITAN_JSON "):])
    assert result["ok"], result
    # every block's 7 linears in float8 (emulated off CUDA), the output head kept as torchtitan's configs keep it;
    # tensorwise: FSDP gathers them in float8, their scales precomputed after each optimizer step
    gathered = recipe == "tensorwise"
    assert result["float8"] == {"recipe": recipe, "emulate": True, "filter_fqns": ["output"], "linears": 14,
                                "fsdp_float8_all_gather": gathered, "precompute_scales": gathered,
                                "precomputed_scales": 14 if gathered else 0}
    assert result["settings"]["float8"] == recipe and result["loss_last"] < result["loss_first"]
    # Compiled off CUDA, torchtitan's converter refuses emulation: its reason, in the one line.
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "titan.py"), *TINY, "--compile",
                           "--float8", recipe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stdout.splitlines()[-1][len("TITAN_JSON "):])
    assert not result["ok"] and result["why"].startswith("float8 conversion: ValueError: Failed to swap to Float8Linear")
