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
    # float8 after the bf16 sections, emulated: one run of each recipe against bf16's of the same mode
    assert list(r)[-5:] == ["float8 rowwise compiled", "torchtitan float8 rowwise compiled",
                            "torchtitan float8 tensorwise compiled", "float8 tensorwise eager", "loss"], list(r)
    for name, bf16 in (("float8 rowwise compiled", "train compiled"), ("float8 tensorwise eager", "train eager")):
        assert r[name]["ok"] and r[name]["steps_timed"] >= 5 and r[name]["mfu_measured"] > 0, (name, r[name])
        assert r[name]["float8_over_bf16"] == pytest.approx(r[name]["tokens_per_s"] / r[bf16]["tokens_per_s"])
        assert r[name]["losses"] != r[bf16]["losses"], name  # float8's numbers, not bf16's
    for recipe in ("rowwise", "tensorwise"):  # torchtitan's, at the same recipe: trained or why not
        titan = r[f"torchtitan float8 {recipe} compiled"]
        assert titan["float8"]["recipe"] == recipe and (titan["ok"] or titan["why"]), titan
    loss = r["loss"]
    assert loss["ok"] and loss["steps"] == 8 and loss["bf16"][0] == r["train compiled"]["loss_first"], loss
    assert loss["gap_last"] == pytest.approx(loss["float8"][1] / loss["bf16"][1] - 1) and abs(loss["gap_last"]) < 0.02
    table = (out / "first_light.md").read_text()
    assert "| train eager |" in table and "tok/s" in table and "rel error" in table
    assert "| float8 rowwise compiled |" in table and "float8/bf16" in table and "| loss | 8 steps" in table
    log = (out / "log.txt").read_text()
    assert "torchao emulates the float8 matmuls" in log and "--float8.fsdp_all_gather true" in log


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


def _sections_run(tmp_path, monkeypatch, *argv) -> list[str]:
    """The names of the sections first_light's main starts for `argv`, none of them run."""
    from bench.gpu import first_light
    from bench.gpu.check import Check

    started = []
    monkeypatch.setattr(Check, "section", lambda self, name, needs, body: started.append(name))
    assert first_light.main([*argv, "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    return started


BF16 = ["probe", "gpu tests", "layers", "train eager", "torchtitan eager", "train compiled", "saves", "verify",
        "export hf", "generate", "torchtitan compiled"]
FLOAT8 = ["float8 rowwise compiled", "torchtitan float8 rowwise compiled", "float8 tensorwise compiled",
          "torchtitan float8 tensorwise compiled", "float8 rowwise eager", "float8 tensorwise eager", "loss"]


def test_float8_runs_after_the_bf16_training_pair_and_only_when_asked(tmp_path, monkeypatch):
    # The bf16 check as it was: no float8 section takes its time.
    assert _sections_run(tmp_path, monkeypatch, "--device", "cuda") == BF16
    # --float8 (one 10-minute call): the bf16 pair the float8 runs are compared with, then float8,
    # the compiled runs and torchtitan's first.
    assert _sections_run(tmp_path, monkeypatch, "--device", "cuda", "--float8") == [
        "probe", "layers", "train eager", "train compiled"] + FLOAT8
    # --tiny (CI): every bf16 section, then one float8 run of each recipe.
    assert _sections_run(tmp_path, monkeypatch, "--device", "cpu", "--tiny") == BF16 + [
        "float8 rowwise compiled", "torchtitan float8 rowwise compiled", "torchtitan float8 tensorwise compiled",
        "float8 tensorwise eager", "loss"]


def test_a_card_without_float8_makes_the_float8_sections_one_line(tmp_path):
    from bench.gpu import first_light, float8_sections
    from bench.gpu.check import Check

    args = argparse.Namespace(out=tmp_path / "out", work=tmp_path / "work", budget=10.0, tiny=False, device="cuda")
    check = Check(args)
    check.results["probe"] = {"ok": True, "card": "NVIDIA A100-SXM4-80GB", "capability": "8.0"}
    check.section = lambda *a: pytest.fail(f"a float8 section ran on a card without float8: {a[0]}")
    float8_sections.run(check, set())
    why = ("skipped: NVIDIA A100-SXM4-80GB has compute capability 8.0, and float8 matmuls need 8.9 or above "
           "(L4, H100, H200, B200)")
    assert check.results["float8"] == {"ok": False, "skipped": True, "why": why}
    assert first_light.rows({"float8": check.results["float8"]}) == [("float8", why)]
    saved = json.loads((tmp_path / "out" / "first_light.json").read_text())
    assert saved["float8"]["why"] == why
    # An H100's 9.0 (and a CPU, emulated) goes on to the sections.
    started = []
    check.section = lambda name, needs, body: started.append(name)
    check.results = {"probe": {"ok": True, "card": "NVIDIA H100 80GB HBM3", "capability": "9.0"}}
    float8_sections.run(check, {"torchtitan"})
    assert started == [n for n in FLOAT8 if "torchtitan" not in n] and "float8" not in check.results


def test_the_loss_section_sets_float8_beside_bf16_over_the_same_steps(tmp_path):
    from bench.gpu import first_light, float8_sections
    from bench.gpu.check import Check

    check = Check(argparse.Namespace(out=tmp_path / "out", work=tmp_path / "work", budget=10.0, tiny=False,
                                     device="cuda"))
    bf16 = [12.0, 9.0, 8.0, 7.5, 7.0, 7.0]
    f8 = [12.0, 9.1, 8.1, 7.6, 7.1, 7.14]
    check.results["train compiled"] = {"ok": True, "losses": bf16}
    assert float8_sections.loss(check) == {
        "ok": False, "why": "needs the losses of float8 rowwise compiled, which did not train"}
    check.results["float8 rowwise compiled"] = {"ok": True, "losses": f8}
    found = float8_sections.loss(check)
    assert found["ok"] and found["steps"] == 6 and found["bf16"] == [12.0, 7.0] and found["float8"] == [12.0, 7.14]
    assert found["gap_last"] == pytest.approx(0.02) and found["gap_last5"] == pytest.approx(39.04 / 38.5 - 1)
    assert first_light.rows({"loss": found}) == [(
        "loss", "6 steps on the same batches: bf16 12.000 -> 7.000, float8 rowwise 12.000 -> 7.140; "
                "float8 +2.00% at the last step, +1.40% over the last 5")]
    check.results["float8 rowwise compiled"]["losses"] = f8[:-1] + [float("nan")]
    assert float8_sections.loss(check)["ok"] is False


def test_the_documented_commands_parse(tmp_path):
    """Every `bash bench/gpu/first_light.sh ...` of docs/benchmarks.md is a command line the check takes."""
    from bench.gpu import first_light

    lines = [line.split("#")[0].split() for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
             if line.startswith("bash bench/gpu/first_light.sh")]
    assert any("--float8" in words for words in lines), lines
    for words in lines:
        first_light.parser().parse_args(words[2:])
