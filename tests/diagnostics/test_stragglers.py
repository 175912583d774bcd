"""Straggler detection: a slow rank is named with its place in the mesh and its host, a healthy run
and a slow collective blame nobody; the analysis and the collective timer on their own."""

import re

import pytest
import torch

from hybridpar.diagnostics.stragglers import CollectiveTimer, analyse, analyse_stages, describe, metrics_row
from hybridpar.mesh.layout import MeshCoords
from tests.runs import make_config

SLEEP_S = 0.2

# --- the analysis: per-rank figures in, a verdict out --------------------------------------------


def test_one_slow_rank_is_named_against_the_others_median():
    compute, wait = [0.20, 0.21, 0.19, 0.41], [0.22, 0.21, 0.23, 0.01]
    v = analyse(compute, wait, threshold=1.5, previous=3)
    assert (v.rank, v.over, v.straggler) == (3, True, True)
    assert v.compute == 0.41 and v.median_compute == 0.20 and v.ratio == pytest.approx(2.05)
    assert v.spread == pytest.approx(0.22) and v.median_wait == pytest.approx(0.215)


def test_a_rank_is_named_when_over_the_threshold_in_two_reports_in_a_row():
    compute, wait = [0.20, 0.21, 0.19, 0.41], [0.22, 0.21, 0.23, 0.01]
    for previous in (None, 0, 2):  # first time over, or another rank was over last time: a hiccup so far
        v = analyse(compute, wait, threshold=1.5, previous=previous)
        assert (v.rank, v.over, v.straggler) == (3, True, False)
    assert not analyse(compute, wait, threshold=2.1, previous=3).over


def test_even_ranks_and_a_slow_link_blame_nobody():
    healthy = analyse([0.20, 0.21, 0.19, 0.20], [0.05] * 4, threshold=1.5)
    assert not healthy.straggler and healthy.ratio == pytest.approx(0.21 / 0.20)
    # Every member waits long in its collectives: a link, not a rank. It shows as the wait share.
    link = analyse([0.20, 0.21, 0.19, 0.20], [0.80, 0.79, 0.81, 0.80], threshold=1.5)
    assert not link.straggler and link.wait_share == pytest.approx(0.80 / 1.00)


def test_two_ranks_compare_with_the_other_not_the_mean():
    v = analyse([0.1, 0.25], [0.15, 0.0], threshold=1.5, previous=1)
    assert (v.rank, v.median_compute, v.straggler) == (1, 0.1, True)
    assert v.ratio == pytest.approx(2.5)  # the median of both (0.175) would give 1.43: missed


def test_config_defaults_and_bad_values():
    from hybridpar.config import ConfigError, load_config

    d = load_config(None, []).diagnostics
    assert (d.straggler_every, d.straggler_threshold) == (50, 1.5)
    assert load_config(None, ["--diagnostics.straggler_every", "0"]).diagnostics.straggler_every == 0
    with pytest.raises(ConfigError, match=r"diagnostics.straggler_every must be >= 0 \(0: never\), got -1"):
        load_config(None, ["--diagnostics.straggler_every", "-1"])
    with pytest.raises(ConfigError, match=r"diagnostics.straggler_threshold must be > 1 .*, got 1.0"):
        load_config(None, ["--diagnostics.straggler_threshold", "1"])
    assert (d.straggler_exclude, d.straggler_exclude_reports) == (3.0, 3)
    assert load_config(None, ["--diagnostics.straggler_exclude", "0"]).diagnostics.straggler_exclude == 0
    with pytest.raises(ConfigError, match=r"straggler_exclude must be 0 \(never\) or above straggler_threshold "
                                          r"\(1.5\), got 1.2"):
        load_config(None, ["--diagnostics.straggler_exclude", "1.2"])


def test_analysis_refuses_fewer_than_two_ranks():
    with pytest.raises(ValueError, match="two or more ranks"):
        analyse([0.1], [0.0], threshold=1.5)


def test_pipeline_stages_are_compared_within_themselves():
    """pp 2 x dp 2: stage 1 (the head) computes 1.6x stage 0 by design, which is no straggler; a rank
    1.5x its own stage's peer is, named by its global rank; with one rank per stage, every rank is
    compared as at pp 1."""
    even = ([0.20, 0.20, 0.32, 0.32], [0.3, 0.3, 0.18, 0.18])
    assert analyse(*even, threshold=1.3).over  # compared across stages, the head's stage looks slow
    v = analyse_stages(*even, pp=2, threshold=1.3)
    assert not v.over and v.ratio == pytest.approx(1.0)
    slow = analyse_stages([0.20, 0.20, 0.32, 0.48], [0.3, 0.3, 0.3, 0.14], pp=2, threshold=1.3, previous=3)
    assert (slow.rank, slow.over, slow.straggler) == (3, True, True) and slow.ratio == pytest.approx(1.5)
    assert slow.median_compute == pytest.approx(0.32)
    first = analyse_stages([0.45, 0.20, 0.32, 0.32], [0.0, 0.3, 0.2, 0.2], pp=2, threshold=1.3, previous=3)
    assert (first.rank, first.over, first.straggler) == (0, True, False)
    alone = analyse_stages([0.20, 0.41], [0.2, 0.0], pp=2, threshold=1.5, previous=1)
    assert alone == analyse([0.20, 0.41], [0.2, 0.0], threshold=1.5, previous=1)


def test_warning_names_rank_coordinates_and_host():
    v = analyse([0.20, 0.20, 0.20, 0.41], [0.2, 0.2, 0.2, 0.0], threshold=1.5, previous=3)
    line = describe(v, 200, MeshCoords.of(3, 1, 1, 2, 1, 2), "node7")
    assert line == ("straggler at step 200: rank 3 (mp 1, dp 1 (replicate 0, shard 1), host node7) computes "
                    "0.41 s per step against a median of 0.20 s (2.05x); the others wait for it")
    # pp 2 x mp 2: the straggler's stage first, in the warning and in the metrics' row
    pp = MeshCoords.of(3, 2, 1, 1, 1, 2)
    assert describe(v, 200, pp, "node7").startswith("straggler at step 200: rank 3 (pp 1, mp 1, dp 0 (replicate 0, "
                                                    "shard 0), host node7)")
    assert metrics_row(v, pp, "node7")["straggler/coords"] == "pp 1, mp 1, dp 0 (replicate 0, shard 0)"


def test_a_straggler_holding_hot_experts_is_not_its_nodes_fault():
    import types

    from hybridpar.diagnostics.stragglers import StragglerMonitor

    parallel = types.SimpleNamespace(world_size=2, device=torch.device("cpu"))
    monitor = StragglerMonitor(parallel, 2, 1.5, exclude=3.0, exclude_reports=1, places=[("vm", "node0")] * 2,
                               hot=lambda rank: "its experts are hot" if rank == 1 else None)
    monitor._judge(analyse([0.1, 0.5], [0.4, 0.0], threshold=1.5), step=2)
    assert monitor.excluding is None  # rank 1, 5x: its experts, not its node
    monitor._judge(analyse([0.5, 0.1], [0.0, 0.4], threshold=1.5), step=4)
    assert monitor.excluding == {"rank": 0, "host": "vm", "node": "node0", "ratio": 5.0, "reports": 1, "step": 4}


def test_a_straggler_holding_hot_experts_says_so():
    v = analyse([0.20, 0.41], [0.2, 0.0], threshold=1.5, previous=1)
    hot = "ep rank 1 (experts 2-3) got 100% of layer 1's routed tokens: its experts are hot, not its node slow"
    assert describe(v, 4, MeshCoords.of(1, 1, 1, 2, 1, 1), "node7", hot=hot) == (
        "straggler at step 4: rank 1 (mp 0, dp 1 (replicate 0, shard 1), host node7) computes 0.41 s per step against "
        f"a median of 0.20 s (2.05x); the others wait for it; {hot}")


# --- the collective timer, on stand-ins for torch.distributed's functions -------------------------


def test_timer_counts_time_inside_wrapped_collectives_once_and_restores(monkeypatch):
    import time

    import torch.distributed as dist

    def barrier(*args, **kwargs):
        time.sleep(0.05)

    def all_reduce(tensor, *args, **kwargs):  # a collective that calls another: counted once
        dist.barrier()

    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    syncs = []
    with CollectiveTimer(sync=lambda: syncs.append(1)) as timer:
        assert dist.all_reduce is not all_reduce and dist.barrier is not barrier
        dist.all_reduce(None)  # not measuring: not timed, no sync
        assert timer.wait == 0 and not syncs
        timer.measuring = True
        dist.all_reduce(None)
        dist.barrier(async_op=True)
        timer.measuring = False
    assert 0.1 <= timer.wait < 0.3
    assert len(syncs) == 3  # before and after the blocking call, before the async one only
    assert dist.all_reduce is all_reduce and dist.barrier is barrier


def test_timer_restores_on_error():
    import torch.distributed as dist

    originals = (dist.all_reduce, dist.Work.wait)
    with pytest.raises(RuntimeError, match="boom"):
        with CollectiveTimer():
            assert dist.all_reduce is not originals[0]
            raise RuntimeError("boom")
    assert (dist.all_reduce, dist.Work.wait) == originals


def test_hang_report_looks_through_the_layer_and_the_compat_names(monkeypatch):
    """A rank blocked in a collective (or in the timer's sync before it) is at the line that called
    it, not in a pass-through: the stacks are taken inside a collective with the timer and a counter
    listening, the torch function at their end put in by hand (no process group here)."""
    import threading

    import torch
    import torch.distributed as dist

    from hybridpar.compat.torch import all_gather_single
    from hybridpar.diagnostics.collectives import CollectiveCounter
    from hybridpar.diagnostics.traces import python_stack, where

    def stack_here(torch_frame: str) -> list[str]:
        return python_stack(threading.get_ident())[:-3] + [torch_frame]  # less python_stack, this and the fake

    stacks = {}

    def gather(output, input, group=None, async_op=False):
        stacks["collective"] = stack_here("torch/distributed/distributed_c10d.py:3900 in all_gather_single")

    def sync():
        stacks.setdefault("sync", stack_here("torch/cuda/__init__.py:1000 in synchronize"))

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    monkeypatch.setattr(dist, name, gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with CollectiveTimer(sync=sync) as timer, CollectiveCounter():
        timer.measuring = True
        all_gather_single(torch.zeros(2), torch.zeros(1))
    assert any("wrap.py" in frame for frame in stacks["collective"]), stacks  # the layer was on the stack
    here = r"tests/diagnostics/test_stragglers.py:\d+ in test_hang_report_looks_through_the_layer_and_the_compat_names"
    assert re.fullmatch(f"{here}  ->  all_gather_single\\(\\)", where(stacks["collective"])), stacks
    assert re.fullmatch(f"{here}  ->  synchronize\\(\\)", where(stacks["sync"])), stacks
    # The monitor's own report is a place of its own.
    assert where(["hybridpar/diagnostics/stragglers.py:210 in report", "hybridpar/compat/torch.py:38 in "
                  "all_gather_single", "torch/distributed/distributed_c10d.py:3900 in all_gather_single"]) == \
        "hybridpar/diagnostics/stragglers.py:210 in report  ->  all_gather_single()"


# --- whole runs -----------------------------------------------------------------------------------


def _case_stragglers(config, slow_rank=None, slow_collective_rank=None, sleep_s=SLEEP_S):
    """Train; `slow_rank` sleeps `sleep_s` in its model's forward (outside any collective),
    `slow_collective_rank` inside its own dist.all_reduce, installed before the trainer runs.
    Rank 0: output and metrics."""
    import contextlib
    import io
    import time

    import torch.distributed as dist

    from hybridpar.train import Trainer
    from hybridpar.train.metrics import read_metrics

    trainer = Trainer(config)
    rank, real_all_reduce = dist.get_rank(), dist.all_reduce
    if rank == slow_rank:
        trainer.model.register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
    if rank == slow_collective_rank:
        def all_reduce(*args, **kwargs):
            time.sleep(sleep_s)
            return real_all_reduce(*args, **kwargs)
        dist.all_reduce = all_reduce
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            trainer.run()
    finally:
        dist.all_reduce = real_all_reduce
    if rank != 0:
        return None
    rows = [r for r in read_metrics(trainer.metrics.jsonl_path) if "straggler/slowest_rank" in r]
    return {"out": out.getvalue(), "reports": rows}


def _warnings(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("straggler at step")]


# world: (layout, the slow rank, where it sits, its extra seconds per step). Eight ranks share two
# cores here, so a step's own compute is about twice that at four and varies more: the slow rank's
# sleep is set well clear of the threshold (1.5x) against both.
SLOW_LAYOUTS = {
    "world4": (4, dict(mp=2, dp_shard=2, strategy="hybrid_shard", dp=2), 3, "mp 1, dp 1 (replicate 0, shard 1)", 0.2),
    "world8": (8, dict(mp=2, dp_shard=2, dp_replicate=2, strategy="hybrid_shard", dp=4), 5,
               "mp 1, dp 2 (replicate 1, shard 0)", 0.6),
    # cp 2 x dp 2: the slow rank is placed by its cp coordinate too
    # (its step, whose attention all-gathers K/V, varied past 0.2 s x 1.5 on a loaded machine)
    "cp2-world4": (4, dict(dp_shard=2, dp=2, **{"parallel.cp": 2}), 3, "mp 0, cp 1, dp 1 (replicate 0, shard 1)", 0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_LAYOUTS))
def test_slow_rank_is_named_within_two_reports(workers, corpus, tmp_path, case):
    """Over the threshold at the first report, named at the second."""
    import socket

    world, layout, slow, where, sleep_s = SLOW_LAYOUTS[case]
    config = make_config(corpus, tmp_path, steps=4, **layout, **{"diagnostics.straggler_every": 2})
    result = workers(world).run(_case_stragglers, config, slow_rank=slow, sleep_s=sleep_s)[0]
    warnings, reports = _warnings(result["out"]), result["reports"]
    print("\n" + "\n".join(warnings))
    assert [r["step"] for r in reports] == [2, 4]
    assert [(r["straggler/slowest_rank"], r["straggler/over"]) for r in reports] == [(slow, True)] * 2, reports
    named = reports[1]
    assert named["straggler/flagged"] and not reports[0]["straggler/flagged"]
    assert named["straggler/coords"] == where and named["straggler/host"] == socket.gethostname()
    assert named["straggler/compute_s"] > sleep_s
    assert len(warnings) == 1
    assert warnings[0].startswith(f"straggler at step 4: rank {slow} ({where}, host {socket.gethostname()}) computes")


@pytest.mark.slow
def test_healthy_run_warns_nothing(workers, corpus, tmp_path):
    """100 steps, a report every 5. The reports go into the log rows of their steps, or rows of
    their own, and to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = make_config(corpus, tmp_path, steps=100, mp=2, dp_shard=2, strategy="hybrid_shard", dp=2,
                         **{"diagnostics.straggler_every": 5, "train.log_every": 25, "output.tensorboard": True})
    result = workers(4).run(_case_stragglers, config)[0]
    reports = result["reports"]
    ratios = [round(r["straggler/ratio"], 2) for r in reports]
    print(f"\nhealthy max/median compute per report: {ratios}")
    assert _warnings(result["out"]) == []
    assert [(r["step"], "loss" in r) for r in reports] == [(step, step % 25 == 0) for step in range(5, 101, 5)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("straggler/ratio")] == list(range(5, 101, 5))
    assert {"straggler/median_wait_s", "straggler/spread_s", "straggler/flagged"} <= set(events.Tags()["scalars"])


def test_slow_collective_blames_nobody(workers, corpus, tmp_path):
    """Rank 1's all_reduce sleeps inside the call: the time is wait on every rank, not rank 1's compute."""
    config = make_config(corpus, tmp_path, steps=6, mp=1, dp_shard=4, dp=4, **{"diagnostics.straggler_every": 2})
    result = workers(4).run(_case_stragglers, config, slow_collective_rank=1)[0]
    reports = result["reports"]
    print(f"\nslow all_reduce: ratios {[round(r['straggler/ratio'], 2) for r in reports]}, "
          f"median wait {[round(r['straggler/median_wait_s'], 3) for r in reports]} s")
    assert len(reports) == 3 and _warnings(result["out"]) == []
    # Three all_reduces per step (the target count, the loss, the gradient norm), each 0.2 s late.
    assert all(r["straggler/median_wait_s"] > 2.5 * SLEEP_S for r in reports)


def _case_straggler_stops(config, slow_rank, sleep_s):
    """Train with `slow_rank` sleeping `sleep_s` in each forward; the step every rank stopped at, and
    on rank 0 its output and the verdict it wrote."""
    import contextlib
    import io
    import json
    import time
    from pathlib import Path

    import torch.distributed as dist

    from hybridpar.train import Trainer

    trainer = Trainer(config)
    if dist.get_rank() == slow_rank:
        trainer.model.register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.run()
    report = Path(config.output.run_dir) / "hang_report.json"
    return {"step": trainer.step, "out": out.getvalue(),
            "report": json.loads(report.read_text()) if dist.get_rank() == 0 else None}


@pytest.mark.slow
def test_a_straggler_over_the_exclusion_threshold_stops_the_run_with_a_checkpoint_naming_its_node(
        workers, corpus, tmp_path):
    """Over straggler_exclude in straggler_exclude_reports reports in a row: every rank stops at the same
    step, after saving it, and the verdict names the node (for launch/slurm.sh): no step is lost."""
    import socket

    config = make_config(corpus, tmp_path, steps=12, mp=2, dp_shard=2, strategy="hybrid_shard", dp=2, **{
        "diagnostics.straggler_every": 2, "diagnostics.straggler_exclude": 2.0,
        "diagnostics.straggler_exclude_reports": 2, "checkpoint.every": 100})
    results = workers(4).run(_case_straggler_stops, config, slow_rank=3, sleep_s=0.8)
    # Reports every 2 steps, two in a row over the bound: step 4 at the earliest, a later report step
    # when a loaded machine slows the other ranks too. Every rank stops at that one step, saved.
    step = results[0]["step"]
    assert step in (4, 6, 8, 10) and [r["step"] for r in results] == [step] * 4, [r["step"] for r in results]
    report = results[0]["report"]
    print("\n" + report["reason"])
    assert report["node_fault"] == {"kind": "straggler", "nodes": [socket.gethostname()], "ranks": [3]}
    assert report["straggler"]["reports"] == 2 and report["straggler"]["ratio"] > 2.0
    assert report["checkpoint"].endswith(f"step-{step:08d}") and (tmp_path / "checkpoints" / f"step-{step:08d}").is_dir()
    assert "hybridpar: rank 3 (node " in results[0]["out"] and f"saved step {step}" in results[0]["out"]
