"""The GPU check's CPU path (bench/gpu/first_light.sh --device cpu --tiny): the same sections as on a
GPU, end to end, on tiny shapes; and a section the time left cannot hold is a line, not the end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_first_light_runs_end_to_end_on_a_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    done = subprocess.run(["bash", "bench/gpu/first_light.sh", "--device", "cpu", "--tiny", "--out", str(out),
                           "--work", str(work)], cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
    print(done.stdout[-3000:], done.stderr[-2000:])
    assert done.returncode == 0
    r = json.loads((out / "first_light.json").read_text())
    # The tests marked gpu ran, and every one was skipped for want of CUDA.
    assert r["gpu tests"]["ok"] and r["gpu tests"]["counts"].get("skipped", 0) >= 5, r["gpu tests"]
    assert set(r["gpu tests"]["counts"]) == {"skipped"}, r["gpu tests"]
    for name in ("probe", "train eager", "train compiled", "saves", "verify", "export hf", "generate"):
        assert r[name]["ok"], (name, r[name])
    for name in ("train eager", "train compiled"):
        assert r[name]["steps_timed"] >= 5 and r[name]["tokens_per_s"] > 0 and r[name]["mfu_measured"] > 0
    saves = r["saves"]
    assert saves["resumed"] and saves["async"]["bytes"] > 0 and saves["blocking"]["gbs"] > 0
    assert saves["async_again"]["bytes"] == saves["async"]["bytes"]  # the second async save, same state
    assert saves["async"]["bytes"] == pytest.approx(saves["blocking"]["bytes"], rel=0.01)  # the same model
    print(f"HF export against transformers: relative error {r['export hf']['rel_error']:.2e}")
    assert r["export hf"]["rel_error"] < 1e-5
    # torchtitan is not installed here: its lines say why rather than stopping the check.
    assert "torchtitan eager" in r and ("why" in r["torchtitan eager"] or r["torchtitan eager"]["ok"])
    table = (out / "first_light.md").read_text()
    assert "| train eager |" in table and "tok/s" in table and "rel error" in table
    assert (out / "log.txt").stat().st_size > 0


def test_a_section_the_time_left_cannot_hold_is_a_line(tmp_path):
    from bench.gpu.check import Check

    args = argparse.Namespace(out=tmp_path / "out", work=tmp_path / "work", budget=10.0, tiny=True, device="cpu")
    check = Check(args)
    ran = []
    check.section("cheap", 1, lambda c: ran.append("cheap") or {"ok": True})
    check.section("costly", 60, lambda c: ran.append("costly") or {"ok": True})
    check.section("broken", 1, lambda c: 1 / 0)
    assert ran == ["cheap"]
    saved = json.loads((tmp_path / "out" / "first_light.json").read_text())
    assert saved["cheap"] == {"ok": True}
    assert saved["costly"]["ok"] is False and saved["costly"]["why"].startswith("skipped: ")
    assert saved["broken"] == {"ok": False, "why": "ZeroDivisionError: division by zero"}


def test_the_first_async_save_says_how_long_it_waited_for_its_host_copy():
    from bench.gpu.first_light import rows

    save = {"blocked_s": 3.5, "bytes": 17.8e9, "written_s": 40.0, "gbs": 0.45}
    results = {"saves": {"ok": True, "n_layers": 2, "async": {**save, "staging_wait_s": 2.4, "staging_prepared_s": 9.5},
                         "async_again": save, "blocking": save}}
    line = dict(rows(results))["async save"]
    assert "blocked 3.5 s at the first save (2.4 s of it waiting for its pinned host copy, begun after step 1 and " \
           "made in 9.5 s in the background), 3.5 s at the next" in line, line
    del results["saves"]["async"]["staging_wait_s"]  # a CPU's saves: DCP stages them, nothing is made before
    assert "blocked 3.5 s at the first save, 3.5 s at the next" in dict(rows(results))["async save"]


def test_the_training_line_puts_the_planner_against_the_reserved_memory():
    from bench.gpu.first_light import rows

    run = {"ok": True, "tokens_per_s": 11736.0, "tflops": 439.0, "mfu_measured": 0.56, "mfu_nominal": 0.44,
           "peak_memory_gib": 90.5, "reserved_memory_gib": 118.0, "measured_over_planned": 0.98,
           "planned_over_reserved": 1.01, "planner": {"tokens_per_s": 12034.0, "memory_gib": 119.2}}
    line = dict(rows({"train eager": run}))["train eager"]
    assert "peak 90.5 GiB allocated, 118.0 GiB reserved; planner 12,034 tok/s, 119.2 GiB (measured/planned 0.98; " \
           "planned/reserved 1.01)" in line, line
    del run["planned_over_reserved"], run["reserved_memory_gib"]  # a CPU's rows: no caching allocator
    assert "peak 90.5 GiB; planner 12,034 tok/s, 119.2 GiB (measured/planned 0.98)" in dict(rows({"train eager": run}))[
        "train eager"]
