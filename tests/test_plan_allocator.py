"""The planner's memory is what a GPU holds: the tensors plus the caching allocator's reserve
(Hardware.allocator_overhead), its own term and line; measured on an H200 (docs/planner.md)."""

from __future__ import annotations

import json

import pytest

from hybridpar.models.args import ModelArgs
from hybridpar.plan import GIB, Workload, make_plan
from hybridpar.plan.hardware import spec
from hybridpar.plan.inputs import ALLOCATOR_OVERHEAD


def _first_light(**hardware):
    """The first light's training on the H200 (bench/gpu/train_sections.py): Llama 3 8B's shape with 20
    layers, 8,192-token sequences, every 2nd block recomputed, world 1, on the 139.8 GiB card."""
    hw = spec("h100", 1, gpu_mem_gib=139.8, memory_bw=4.8e12, **hardware)
    plan = make_plan(ModelArgs.from_preset("llama3_8b", n_layers=20), Workload(seq_len=8192), hw, ac_every=2)
    return plan.find(1, 1, 1, "selective")[0]


def test_the_reserve_is_a_share_of_the_tensors_and_covers_the_card_the_h200_held():
    e = _first_light()
    tensors = e.memory.total - e.memory.allocator
    assert e.memory.allocator == pytest.approx(ALLOCATOR_OVERHEAD * tensors)
    # The measured figures behind the constant: the tensors summed to 112.4 GiB; hybridpar allocated at
    # most 90.5 GiB, and torchtitan's allocator reserved 1.32x its peak allocation (114.7 of 86.9 GiB).
    assert tensors / GIB == pytest.approx(112.35, abs=0.01)
    assert e.memory.total / GIB == pytest.approx(114.66 / 86.85 * 90.46, rel=0.002)
    # A CPU has no caching allocator: no reserve, the tensors as before.
    bare = _first_light(allocator_overhead=0.0)
    assert bare.memory.allocator == 0 and bare.memory.total == pytest.approx(tensors)


def _run(capsys, *argv):
    from hybridpar.cli import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_plan_says_the_reserve_on_its_own_line_and_in_the_memory(capsys, tmp_path):
    code, out, _ = _run(capsys, "--model", "llama3_8b", "--gpus", "8", "--gpu", "h100", "--json",
                        str(tmp_path / "plan.json"))
    assert code == 0
    assert ("assumed: the caching allocator reserves 6.3% more than the tensors counted (blocks a step frees stay "
            "cached for what it makes next; measured on an H200, docs/planner.md)") in out.splitlines(), out
    memory = next(line for line in out.splitlines() if line.startswith("  memory per GPU"))
    allocator = float(memory.rsplit("+ allocator ", 1)[1])
    total = float(memory.split("memory per GPU ")[1].split(" GiB")[0])
    assert allocator == pytest.approx(total * ALLOCATOR_OVERHEAD / (1 + ALLOCATOR_OVERHEAD), abs=0.06), memory
    best = json.loads((tmp_path / "plan.json").read_text())["layouts"][0]["memory_gib"]
    assert best["allocator"] == pytest.approx(ALLOCATOR_OVERHEAD * (best["total"] - best["allocator"]))
    # --allocator-overhead 0: the tensors alone, no line, no term.
    code, bare, _ = _run(capsys, "--model", "llama3_8b", "--gpus", "8", "--gpu", "h100", "--allocator-overhead", "0")
    assert code == 0 and "caching allocator" not in bare and "+ allocator" not in bare
    bare_memory = next(line for line in bare.splitlines() if line.startswith("  memory per GPU"))
    bare_total = float(bare_memory.split("memory per GPU ")[1].split(" GiB")[0])
    assert bare_total == pytest.approx(total - allocator, abs=0.11)  # three figures rounded to 0.1


def test_a_negative_overhead_is_one_line(capsys):
    code, _, err = _run(capsys, "--model", "llama3_8b", "--gpus", "8", "--allocator-overhead", "-0.1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--allocator-overhead -0.1 is negative: give a fraction of the tensors' bytes, 0 or more" in err
