"""launch/slurm.sh on a real Slurm cluster (tests/launch/cluster.py: slurmd "nodes" on this machine),
sbatch, waited for, 2 nodes x 2 CPU ranks (mp 2 x dp 2, gloo)."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.launch.cluster import (
    JOB_TIMEOUT, MP, NODES, PROCS_PER_NODE, job_id, sbatch_wait, submit, wait_for_step,
)
from tests.launch.common import LAYOUT_LINE, documented_coords, mesh_table, metrics_by_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 4


def test_sbatch_two_nodes_trains_checkpoints_and_reports_the_documented_layout(slurm_cluster, corpus, tmp_path):
    run_dir = tmp_path / "run"
    log, job_dir = sbatch_wait(slurm_cluster, run_dir, tmp_path / "slurm-1.out", STEPS, corpus)

    # Trained the steps and left a complete checkpoint of the 4-rank job.
    rows = metrics_by_step(job_dir)
    assert sorted(rows) == list(range(1, STEPS + 1)), log[-4000:]
    state = json.loads((run_dir / "checkpoints" / f"step-{STEPS:08d}" / "train_state.json").read_text())
    assert state["step"] == STEPS and state["world_size"] == NODES * PROCS_PER_NODE
    assert "4 ranks = dp_replicate 1 x dp_shard 2 x mp 2" in log
    assert f"done: checkpoints in {run_dir}/checkpoints" in log

    # The layout every rank reported from the real mesh is the documented one: node k holds ranks
    # 2k and 2k+1, which form one model-parallel group, and each rank sits where the mesh formula says.
    ranks = [m.groupdict() for m in map(LAYOUT_LINE.search, log.splitlines()) if m]
    assert sorted(int(r["rank"]) for r in ranks) == list(range(NODES * PROCS_PER_NODE)), log[-4000:]
    nodes_of: dict[str, set[int]] = {}
    for r in ranks:
        rank = int(r["rank"])
        assert rank == int(r["node_rank"]) * PROCS_PER_NODE + int(r["local_rank"]), r
        assert {k: int(r[k]) for k in ("mp_rank", "dp_rank", "replicate", "shard")} == documented_coords(rank, MP, 2)
        nodes_of.setdefault(r["node"], set()).add(int(r["node_rank"]))
    assert sorted(nodes_of) == ["n1", "n2"] and all(len(v) == 1 for v in nodes_of.values()), nodes_of
    mp_groups = {}
    for r in ranks:
        mp_groups.setdefault(int(r["dp_rank"]), set()).add(r["node"])
    assert all(len(nodes) == 1 for nodes in mp_groups.values()), f"a model-parallel group spans nodes: {mp_groups}"
    assert "model-parallel groups span nodes" not in log
    # ... and agrees with the plan the job printed (`hybridpar mesh`) and with layout.txt.
    plan = {row[0]: row for row in mesh_table(log)}
    for r in ranks:
        rank = int(r["rank"])
        assert plan[rank][1:] == (int(r["node_rank"]), int(r["mp_rank"]), int(r["dp_rank"]), int(r["replicate"]),
                                  int(r["shard"]))
    assert sorted(m.group(0) for m in map(LAYOUT_LINE.search, (job_dir / "layout.txt").read_text().splitlines()) if m) \
        == sorted(m.group(0) for m in map(LAYOUT_LINE.search, log.splitlines()) if m)

    # The job folder: its log, the exact command, the flight-recorder folder, torchrun's per-rank logs.
    assert (job_dir / "job.log").read_text().strip().splitlines()[-1] == log.strip().splitlines()[-1]
    assert "--kill-on-bad-exit=1" in (job_dir / "command.sh").read_text()
    assert (job_dir / "flight_recorder").is_dir() and (job_dir / "config.toml").is_file()
    assert len(list((job_dir / "torchrun").glob("*/attempt_0"))) == NODES

    # A second job of the same run (a resubmission after a time limit, say) continues from the newest
    # checkpoint: the first job's last step.
    log2, job_dir2 = sbatch_wait(slurm_cluster, run_dir, tmp_path / "slurm-2.out", STEPS + 2, corpus, PREFLIGHT=0)
    assert f"resumed from {run_dir}/checkpoints/step-{STEPS:08d} at step {STEPS}" in log2, log2[-4000:]
    assert sorted(metrics_by_step(job_dir2)) == [STEPS + 1, STEPS + 2]
    assert (run_dir / "checkpoints" / f"step-{STEPS + 2:08d}").is_dir() and job_dir2 != job_dir
    assert "preflight" not in log2


def test_usr1_to_the_job_saves_the_step_requeues_and_the_requeued_job_finishes(slurm_cluster, corpus, tmp_path):
    """`scancel --signal=USR1` (what `#SBATCH --signal=USR1@120` sends ahead of the time limit): the
    torchrun agents pass it to their ranks, which save the step they are in; slurm.sh requeues the
    job, and the same job id starts again, resumes from that checkpoint and trains to the end.
    The job runs at --cp 2 (mp 2 x cp 2): its preflight and its trainer place every rank by cp too."""
    steps, run_dir = 16, tmp_path / "run"
    job = job_id(submit(slurm_cluster, run_dir, tmp_path / "slurm.out", steps, corpus, every=100, options=["--cp", "2"]))
    job_dir = run_dir / f"job-{job}"
    deadline = time.monotonic() + 2 * JOB_TIMEOUT  # two starts of the job
    try:
        wait_for_step(job_dir, 3, deadline, slurm_cluster)
        signalled = slurm_cluster.run("scancel", "--signal=USR1", job)
        assert signalled.returncode == 0, signalled.stderr
        # Slurm holds a requeued job back for a while before it may start again; only the test's
        # clock, not what it checks: let it start now.
        shown = slurm_cluster.wait_completed(job, deadline, job_dir / "job.log", hurry="")
    finally:
        slurm_cluster.cancel_all()
    log = (job_dir / "job.log").read_text()
    stopped = re.search(r"hybridpar: stopped on SIGUSR1 after step (\d+); checkpoint (\S+)\.", log)
    assert stopped, log[-6000:]
    step = int(stopped.group(1))
    print(f"\nstopped after step {step}, requeued, resumed: {re.findall(r'resumed from .*', log)}")
    assert f"requeued job {job}" in log and "Restarts=1" in shown
    assert f"resumed from {run_dir}/checkpoints/step-{step:08d} at step {step}" in log, log[-6000:]
    assert sorted(metrics_by_step(job_dir)) == list(range(1, steps + 1))
    assert (run_dir / "checkpoints" / f"step-{steps:08d}").is_dir() and "hybridpar watchdog" not in log
    # cp reached the mesh: the preflight's places (from init_parallel) and the trainer's start line.
    places = [m.groupdict() for m in map(LAYOUT_LINE.search, log.splitlines()) if m]
    assert places and {(p["cp_rank"], p["cp"]) for p in places} == {("0", "2"), ("1", "2")}, log[-4000:]
    assert "dp_replicate 1 x dp_shard 1 x cp 2 x mp 2" in log, log[-4000:]
