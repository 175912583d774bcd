"""The pipeline benchmark (bench/pipeline.py): its replay and bubble arithmetic against schedules worked
by hand, its saved-activation count against a graph whose saves are known, and one tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.pipeline import SavedBytes, _unpack
from bench.pipeline_replay import evened, replay, stage_costs, wall_bubble
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


def _one_f_one_b(p: int, m: int, f, b) -> dict[int, list[dict]]:
    """1F1B written out: rank r warms up with p - 1 - r forwards, alternates, then drains its backwards.
    f(r), b(r): the costs of rank r's forward and backward."""
    orders = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        seq = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", i) for i in range(m - warm, m)]
        orders[r] = [{"kind": k, "stage": r, "mb": i, "cost": f(r) if k == "F" else b(r)} for k, i in seq]
    return orders


def _gpipe(p: int, m: int) -> dict[int, list[dict]]:
    return {r: [{"kind": k, "stage": r, "mb": i, "cost": 1.0 if k == "F" else 2.0} for k in "FB" for i in range(m)]
            for r in range(p)}


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_replay_of_even_stages_is_the_formula(p, m):
    # Even stages, f = 1, b = 2: the step is (m + p - 1)(f + b) and every rank idles (p - 1) / (m + p - 1).
    for orders in (_one_f_one_b(p, m, lambda r: 1.0, lambda r: 2.0), _gpipe(p, m)):
        got = replay(orders, p)
        assert got["step"] == pytest.approx((m + p - 1) * 3)
        assert got["bubble"] == pytest.approx({r: (p - 1) / (m + p - 1) for r in range(p)})


def test_replay_with_a_slow_last_stage_by_hand():
    # pp 2, m 2; stage 1 costs twice stage 0. Rank 0: F0 [0,1] F1 [1,2], B0 waits for rank 1's B0 (7)
    # [7,9], B1 for its B1 (13) [13,15]. Rank 1: F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13].
    got = replay(_one_f_one_b(2, 2, lambda r: 1.0 + r, lambda r: 2.0 * (1 + r)), 2)
    assert got["step"] == 15
    assert got["bubble"] == pytest.approx({0: 1 - 6 / 15, 1: 1 - 12 / 15})


def test_the_even_replay_removes_the_stages_unevenness_and_keeps_the_order():
    # The slow last stage above: evened, every F costs 1.5 and every B 3, so the 1F1B order gives the
    # formula's bubble; the stage costs are the measured ones.
    orders = _one_f_one_b(2, 4, lambda r: 1.0 + r, lambda r: 2.0 * (1 + r))
    assert stage_costs(orders) == {0: {"F": 1.0, "B": 2.0}, 1: {"F": 2.0, "B": 4.0}}
    even = evened(orders)
    assert [(a["kind"], a["mb"]) for a in even[1]] == [(a["kind"], a["mb"]) for a in orders[1]]
    assert replay(even, 2)["bubble"] == pytest.approx({0: 1 / 5, 1: 1 / 5})
    assert replay(orders, 2)["bubble"][0] > 0.5


def test_replay_refuses_an_order_that_cannot_run():
    orders = {0: [{"kind": "B", "stage": 0, "mb": 0, "cost": 1}, {"kind": "F", "stage": 0, "mb": 0, "cost": 1}],
              1: [{"kind": "F", "stage": 1, "mb": 0, "cost": 1}, {"kind": "B", "stage": 1, "mb": 0, "cost": 1}]}
    with pytest.raises(ValueError, match="cannot run"):
        replay(orders, 2)


def test_wall_bubble_counts_the_waits_and_the_time_outside_a_rank_s_schedule():
    ranks = {0: {"start": 10.0, "end": 20.0, "waits": 2.0}, 2: {"start": 10.5, "end": 18.0, "waits": 1.0}}
    got = wall_bubble(ranks)
    assert got["step"] == 10.0
    assert got["bubble"] == pytest.approx({0: 0.2, 2: (1.0 + 0.5 + 2.0) / 10})


def test_saved_bytes_counts_each_storage_once_while_held_and_no_parameter():
    weight = torch.nn.Parameter(torch.randn(1000))
    x = torch.randn(1000, requires_grad=True)
    saved = SavedBytes([weight])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
        y = x * weight  # saves x and the weight: x counted (4,000 bytes), the parameter not
        z = y.exp()  # saves its result z
        w = z.sin()  # saves its input z again: the same storage, not counted twice
        loss = w.cos().sum()  # saves w
    assert (saved.now, saved.peak, saved.total) == (12_000, 12_000, 12_000)
    loss.backward()
    assert saved.now == 0 and not saved.live and saved.peak == 12_000
    assert torch.allclose(x.grad, -torch.sin(torch.sin(torch.exp(x * weight))) * torch.cos(torch.exp(x * weight))
                          * torch.exp(x * weight) * weight)


@pytest.mark.slow
def test_tiny_run_at_world_2(tmp_path):
    out = tmp_path / "pipeline.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "bench" / "pipeline.py"), "--layers", "2", "--seq-len", "32", "--rounds", "1", "--pps", "2",
           "--schedules", "1F1B,GPipe,Interleaved1F1B", "--microbatches", "4", "--out", str(out)]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["schedule"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"1F1B", "GPipe", "Interleaved1F1B"}
    # GPipe holds every micro-batch's activations at its peak, 1F1B's first rank min(p, m) = 2: the
    # planner's in-flight counts, measured from the saved storages alone.
    assert rows["GPipe"]["in_flight"] == pytest.approx(4, abs=1e-3)
    assert rows["1F1B"]["in_flight"] == pytest.approx(2, abs=1e-3)
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["bubble_formula"] > 0
        assert 0 <= row["bubble_replay"]["mean"] <= row["bubble_replay"]["worst"] < 1
        assert 0 <= row["bubble_wall"]["mean"] <= row["bubble_wall"]["worst"] < 1
        assert 0 < row["activations"] <= row["activations_planned"]
        # The last stage would keep every micro-batch's fp32 logits (4 x 32 x 4096 x 4 bytes) while torch's
        # schedule step returns them: PipelineEngine.step passes return_outputs=False.
        assert row["held_outputs"] == 0


def test_replay_on_fewer_cores_than_ranks_by_hand():
    # pp 2, m 2, f = 1, b = 2 on one core: rank 0's F0 [0,1]; its F1 and rank 1's F0 share the core
    # [1,3]; rank 1's B0 [3,5]; rank 0's B0 (2) and rank 1's F1 (1) share it: F1 done at 7, B0 half
    # done; B0 and rank 1's B1 share it: B0 done at 9; B1 alone [9,10]; rank 0's B1 [10,12]. Each
    # rank is not ready for 3 of the 12 s (the formula: 1/3 on a core each, a 9 s step).
    got = replay(_one_f_one_b(2, 2, lambda r: 1.0, lambda r: 2.0), 2, cores=1)
    assert got["step"] == pytest.approx(12)
    assert got["bubble"] == pytest.approx({0: 0.25, 1: 0.25})
    assert replay(_one_f_one_b(2, 2, lambda r: 1.0, lambda r: 2.0), 2, cores=2) == replay(
        _one_f_one_b(2, 2, lambda r: 1.0, lambda r: 2.0), 2)
