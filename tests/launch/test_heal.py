"""A job that heals itself (launch/slurm.sh, EXCLUDE_ON_FAULT): on the local 3-node Slurm cluster a
2-node job meets a fault on one node, made by the test from outside (every rank process of that node
stopped with SIGSTOP; one rank killed with SIGKILL). The watchdog's verdict names the node, the
script excludes it and requeues the job, which resumes from the newest checkpoint on the other two
nodes and finishes with the losses of an undisturbed run. A wrong config is not requeued."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.launch.cluster import JOB_TIMEOUT, job_id, sbatch_wait, submit, wait_for_step
from tests.launch.common import metrics_by_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY = 10, 3
FAULT_AFTER = 5  # steps logged before the fault (checkpoints every EVERY steps)
# No progress for 30 s is a hang here, a heartbeat silent for 10 s a stopped or dead rank (by default
# 300 s and 50 s).
WATCH = ["--diagnostics.train_timeout=30", "--diagnostics.watchdog_interval=1"]
BOUND = 1e-6  # the same ranks, data and arithmetic on other nodes: equal losses


@pytest.fixture(scope="module")
def undisturbed(slurm_cluster, corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("undisturbed")
    log, job_dir = sbatch_wait(slurm_cluster, folder / "run", folder / "slurm.out", STEPS, corpus, every=EVERY,
                               overrides=WATCH, PREFLIGHT=0)
    rows = metrics_by_step(job_dir)
    assert sorted(rows) == list(range(1, STEPS + 1)), log[-4000:]
    return {step: row["loss"] for step, row in rows.items()}


def _rank_pids(job: str, node: str) -> list[int]:
    """The training ranks of job `job` on `node` (torchrun's workers: they have LOCAL_RANK)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(v.split("=", 1) for v in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in v)
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (env.get("SLURM_JOB_ID") == job and env.get("SLURMD_NODENAME") == node and "LOCAL_RANK" in env
                and b"hybridpar" in cmdline and b"train" in cmdline):
            pids.append(int(entry.name))
    return pids


def _heal(slurm_cluster, corpus, tmp_path, fault: str, index: int, **env) -> dict:
    """Run a job, make `fault` on its node `index` (0: ranks 0 and 1, the batch script's node and the
    host of the job's store) after FAULT_AFTER steps, wait until it completes; what happened, measured."""
    run_dir = tmp_path / "run"
    job = job_id(submit(slurm_cluster, run_dir, tmp_path / "slurm.out", STEPS, corpus, every=EVERY,
                        overrides=WATCH, PREFLIGHT=0, **env))
    job_dir = run_dir / f"job-{job}"
    deadline = time.monotonic() + 2 * JOB_TIMEOUT
    hit: list[int] = []
    try:
        wait_for_step(job_dir, FAULT_AFTER, deadline, slurm_cluster)
        shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
        first_nodes = slurm_cluster.run("scontrol", "show", "hostnames",
                                        shown.split(" NodeList=")[1].split()[0]).stdout.split()
        node = first_nodes[index]
        hit = _rank_pids(job, node)
        assert len(hit) == 2, f"expected 2 ranks of job {job} on {node}, found {hit}"
        fault_time = time.time()
        for pid in (hit if fault == "stall" else hit[:1]):
            os.kill(pid, signal.SIGSTOP if fault == "stall" else signal.SIGKILL)
        shown = slurm_cluster.wait_completed(job, deadline, job_dir / "job.log")
    finally:
        for pid in hit:  # nothing of the test's making outlives it
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        slurm_cluster.cancel_all()
    log = (job_dir / "job.log").read_text()
    events = [json.loads(line) for line in (run_dir / "incidents.jsonl").read_text().splitlines()]
    return {"job": job, "node": node, "first_nodes": first_nodes, "fault_time": fault_time, "shown": shown,
            "log": log, "events": events, "losses": {s: r["loss"] for s, r in metrics_by_step(job_dir).items()},
            "run_dir": run_dir}


def _check_healed(result: dict, undisturbed: dict, kind: str) -> None:
    log, events, node = result["log"], result["events"], result["node"]
    by = {e["event"]: e for e in events}
    assert [e["event"] for e in events] == ["fault", "requeue", "training_again"], (events, log[-6000:])
    fault, requeue, again = by["fault"], by["requeue"], by["training_again"]
    # The verdict named the node; the script excluded it and requeued the same job.
    assert fault["kind"] == kind and fault["nodes"] == [node] and fault["action"] == "exclude", fault
    assert requeue["excluded"] == node and f"excluding {node} and requeueing job {result['job']}" in log
    assert f"ExcNodeList={node}" in result["shown"] and "Restarts=1" in result["shown"], result["shown"]
    # It ran again on the two other nodes, from the newest complete checkpoint.
    newest = EVERY * ((fault["step"] - 1) // EVERY)  # the newest checkpoint before the step in flight
    assert node not in again["nodes"] and again["resumed_from"] == newest, (again, fault)
    assert f"resumed from {result['run_dir']}/checkpoints/step-{again['resumed_from']:08d}" in log, log[-6000:]
    # Every step's loss equals the undisturbed run's.
    assert sorted(result["losses"]) == list(range(1, STEPS + 1)), sorted(result["losses"])
    worst = max(abs(result["losses"][s] - undisturbed[s]) / abs(undisturbed[s]) for s in undisturbed)
    print(f"\nlosses after healing vs undisturbed: worst relative error {worst:.2e} (bound {BOUND:g})")
    assert worst <= BOUND
    t0 = result["fault_time"]
    lost = max(0, fault["step"] - 1 - again["resumed_from"])
    print(f"{kind} on {node}: verdict {fault['verdict_time'] - t0:.1f} s after the fault, requeue "
          f"{requeue['time'] - t0:.1f} s, training again {again['time'] - t0:.1f} s (on {again['nodes']}); "
          f"{lost} step(s) lost")
    assert fault["verdict_time"] >= t0 - 1 and again["time"] > requeue["time"] > fault["verdict_time"]
    assert "incidents of this run" in log and "training again after" in log


@pytest.mark.parametrize("index", [1, 0], ids=["second-node", "first-node"])
def test_a_node_whose_ranks_stall_is_excluded_and_the_job_heals(slurm_cluster, corpus, tmp_path, undisturbed, index):
    """Every rank of one node stopped (SIGSTOP): silent heartbeats, the node's fault. torchrun's
    in-job restarts (MAX_RESTARTS) would meet the same node again: the script does not wait for them.
    The first node's rank 0 hosts the job's store and its monitor: the others find it frozen."""
    result = _heal(slurm_cluster, corpus, tmp_path, "stall", index, MAX_RESTARTS=3)
    _check_healed(result, undisturbed, "stall")


def test_a_node_that_kills_a_rank_is_excluded_when_no_restart_is_left(slurm_cluster, corpus, tmp_path, undisturbed):
    """A rank killed (SIGKILL) with no in-job restart left (MAX_RESTARTS=0): its node is excluded."""
    result = _heal(slurm_cluster, corpus, tmp_path, "kill", 1, MAX_RESTARTS=0)
    _check_healed(result, undisturbed, "death")


def test_a_wrong_config_is_not_requeued(slurm_cluster, corpus, tmp_path):
    run_dir = tmp_path / "run"
    submitted = submit(slurm_cluster, run_dir, tmp_path / "slurm.out", STEPS, corpus,
                       overrides=["--optim.lr=-1"], wait=True)
    job = job_id(submitted)
    shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
    log = (tmp_path / "slurm.out").read_text()
    assert submitted.returncode != 0 and "JobState=FAILED" in shown and "Restarts=0" in shown, shown
    assert "optim.lr" in log and "requeue" not in log, log[-3000:]
    assert not (run_dir / "incidents.jsonl").exists()
