"""A job that heals itself (launch/slurm.sh, EXCLUDE_ON_FAULT): on the local 3-node Slurm cluster a
2-node job meets a fault on one node, made by the test from outside (every rank process of that node
stopped with SIGSTOP; one rank killed with SIGKILL). The watchdog's verdict names the node, the
script excludes it and requeues the job, which resumes from the newest checkpoint on the other two
nodes and finishes with the losses of an undisturbed run. A wrong config is not requeued."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.launch.cluster import JOB_TIMEOUT, job_id, submit, wait_for_step
from tests.launch.common import ROOT, metrics_by_step, tiny_overrides

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY = 10, 3
FAULT_AFTER = 5  # steps logged before the fault (checkpoints every EVERY steps)
# No progress for 30 s is a hang here, a heartbeat silent for 5 s (10 beats) a stopped or dead rank (by
# default 300 s and 50 s).
WATCH = ["--diagnostics.train_timeout=30", "--diagnostics.watchdog_interval=0.5"]
# The requeued job starts once launch/slurm.sh has excluded the node, not at backfill's next pass.
HURRY = "ExcNodeList=n"
BOUND = 1e-6  # the same ranks, data and arithmetic on other nodes: equal losses


def _case_losses(overrides: list[str]):
    import torch.distributed as dist

    from hybridpar.config import find_config, load_config
    from hybridpar.train import Trainer

    history = Trainer(load_config(find_config("local"), overrides)).run()
    return {m["step"]: m["loss"] for m in history} if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def undisturbed(workers, corpus, tmp_path_factory):
    """The job's losses without a fault: its config (launch/slurm.sh's flags and the test's) trained
    by 4 ranks of the session's worker pool, the same mesh, data and arithmetic as the job's 2 nodes x
    2 ranks (a Slurm job of its own took 40 s more, most of it starting processes)."""
    run_dir = tmp_path_factory.mktemp("undisturbed")
    overrides = ["--parallel.mp=2", "--parallel.dp_shard=2", "--parallel.dp_replicate=1", f"--output.run_dir={run_dir}",
                 *tiny_overrides(corpus, STEPS, every=EVERY), *WATCH]
    losses = workers(4).run(_case_losses, overrides)[0]
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    return losses


def _ranks(cluster, job: str) -> dict[int, tuple[str, int]]:
    """rank -> (node, pid) of job `job`'s training ranks."""
    return {int(env["RANK"]): (env.get("SLURMD_NODENAME", "?"), pid) for pid, env in cluster.rank_processes(job)}


def _rank_pids(cluster, job: str, store_host: bool) -> tuple[str, list[int]]:
    """The node of rank 0 (it hosts the job's store), or the other one, and its ranks' pids, in rank order.
    torchrun numbers the nodes in rendezvous order, not Slurm's: rank 0 may be on either."""
    ranks = _ranks(cluster, job)
    assert len(ranks) == 4, f"expected the 4 ranks of job {job}, found {ranks}"
    node = ranks[0][0] if store_host else next(n for n, _ in ranks.values() if n != ranks[0][0])
    return node, [pid for r, (n, pid) in sorted(ranks.items()) if n == node]


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "incidents.jsonl").read_text().splitlines()]


def _completed(slurm_cluster, job: str, run_dir: Path) -> tuple[str, str, list[dict]]:
    """Wait until job `job` completes, through its requeues: its `scontrol show job`, log and incidents."""
    log = run_dir / f"job-{job}" / "job.log"
    try:
        shown = slurm_cluster.wait_completed(job, time.monotonic() + 2 * JOB_TIMEOUT, log, hurry=HURRY)
    finally:
        slurm_cluster.cancel_all()
    return shown, log.read_text(), _events(run_dir)


def _release(pids: list[int]) -> None:
    """Nothing of the test's making outlives it: the processes it stopped are killed."""
    for pid in pids:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _heal(slurm_cluster, corpus, tmp_path, fault: str, store_host: bool, **env) -> dict:
    """Run a job, make `fault` on the node of rank 0 (`store_host`: the host of the job's store and
    its monitor) or on the other one after FAULT_AFTER steps (a stall stops every rank there, a kill
    its last rank), wait until it completes; what happened, measured."""
    run_dir = tmp_path / "run"
    job = job_id(submit(slurm_cluster, run_dir, tmp_path / "slurm.out", STEPS, corpus, every=EVERY,
                        overrides=WATCH, PREFLIGHT=0, **env))
    job_dir = run_dir / f"job-{job}"
    deadline = time.monotonic() + 2 * JOB_TIMEOUT
    hit: list[int] = []
    try:
        wait_for_step(job_dir, FAULT_AFTER, deadline, slurm_cluster)
        node, hit = _rank_pids(slurm_cluster, job, store_host)
        assert len(hit) == 2, f"expected 2 ranks of job {job} on {node}, found {hit}"
        fault_time = time.time()
        for pid in (hit if fault == "stall" else hit[-1:]):
            os.kill(pid, signal.SIGSTOP if fault == "stall" else signal.SIGKILL)
        shown = slurm_cluster.wait_completed(job, deadline, job_dir / "job.log", hurry=HURRY)
    finally:
        _release(hit)
        slurm_cluster.cancel_all()
    log = (job_dir / "job.log").read_text()
    events = _events(run_dir)
    return {"job": job, "node": node, "fault_time": fault_time, "shown": shown,
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


@pytest.mark.parametrize("store_host", [False, True], ids=["other-node", "store-host"])
def test_a_node_whose_ranks_stall_is_excluded_and_the_job_heals(slurm_cluster, corpus, tmp_path, undisturbed,
                                                                store_host):
    """Every rank of one node stopped (SIGSTOP): silent heartbeats, the node's fault. torchrun's
    in-job restarts (MAX_RESTARTS) would meet the same node again: the script does not wait for them.
    Rank 0 hosts the job's store and its monitor: stopped, the others find the store frozen."""
    result = _heal(slurm_cluster, corpus, tmp_path, "stall", store_host, MAX_RESTARTS=3)
    _check_healed(result, undisturbed, "stall")


def test_a_node_that_kills_a_rank_is_excluded_when_no_restart_is_left(slurm_cluster, corpus, tmp_path, undisturbed):
    """A rank killed (SIGKILL) with no in-job restart left (MAX_RESTARTS=0): its node is excluded."""
    result = _heal(slurm_cluster, corpus, tmp_path, "kill", False, MAX_RESTARTS=0)
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


def test_a_node_that_fails_the_preflight_alone_is_excluded(slurm_cluster, corpus, tmp_path):
    """The interpreter breaks on one node (a wrapper that exits there, made by the test): the
    preflight's tasks fail on that node alone, which is excluded; the requeued job trains."""
    wrapper = tmp_path / "python3"
    wrapper.write_text('#!/usr/bin/env bash\n[[ ${SLURMD_NODENAME:-} == n2 ]] && { echo "broken node" >&2; exit 3; }\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    run_dir = tmp_path / "run"
    job = job_id(submit(slurm_cluster, run_dir, tmp_path / "slurm.out", 4, corpus, PYTHON=wrapper))
    job_dir = run_dir / f"job-{job}"
    shown, log, events = _completed(slurm_cluster, job, run_dir)
    assert [(e["event"], e.get("kind")) for e in events] == [
        ("fault", "preflight"), ("requeue", None), ("training_again", None)], events
    assert events[0]["nodes"] == ["n2"] and events[1]["excluded"] == "n2", events
    assert "ExcNodeList=n2" in shown and "Restarts=1" in shown and "n2" not in events[-1]["nodes"]
    assert sorted(metrics_by_step(job_dir)) == [1, 2, 3, 4] and "slurm.sh: verdict: exclude n2" in log


def test_without_a_spare_node_the_job_says_so_and_stops(slurm_cluster, corpus, tmp_path):
    """The third node is drained: after a node's fault no two usable nodes are left, so the job ends
    naming why instead of requeueing into a queue it cannot leave."""
    spare = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N").stdout.split()[-1]
    drained = slurm_cluster.run("scontrol", "update", f"NodeName={spare}", "State=DRAIN", "Reason=test")
    assert drained.returncode == 0, drained.stderr
    run_dir = tmp_path / "run"
    hit: list[int] = []
    try:
        job = job_id(submit(slurm_cluster, run_dir, tmp_path / "slurm.out", STEPS, corpus, every=EVERY,
                            overrides=WATCH, PREFLIGHT=0))
        job_dir = run_dir / f"job-{job}"
        wait_for_step(job_dir, FAULT_AFTER, time.monotonic() + JOB_TIMEOUT, slurm_cluster)
        node, hit = _rank_pids(slurm_cluster, job, store_host=False)
        for pid in hit:
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + JOB_TIMEOUT
        while "JobState=FAILED" not in (shown := slurm_cluster.run("scontrol", "show", "job", job).stdout):
            assert time.monotonic() < deadline and "JobState=PENDING" not in shown, shown
            time.sleep(1)
    finally:
        _release(hit)
        slurm_cluster.cancel_all()
        slurm_cluster.run("scontrol", "update", f"NodeName={spare}", "State=RESUME")
    log = (job_dir / "job.log").read_text()
    other = ({"n1", "n2"} - {node}).pop()
    why = f"no spare node: without {node} the partition has 1 usable node(s) ({other}), the job needs 2"
    assert f"slurm.sh: not requeued: {why}" in log and "Restarts=0" in shown, log[-4000:]
    events = _events(run_dir)
    assert [(e["event"], e.get("action")) for e in events] == [("fault", "stop"), ("stop", None)], events


SLOW_RANK = """
import os
if os.environ.get("RANK") == "3" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    import time
    import hybridpar.models.llama as llama
    forward = llama.Transformer.forward

    def slow(self, *args, **kwargs):  # a slow node: this rank computes 0.2 s longer per step
        time.sleep(0.2)
        return forward(self, *args, **kwargs)

    llama.Transformer.forward = slow
"""


def test_a_node_that_runs_slow_is_excluded_without_losing_a_step(slurm_cluster, corpus, tmp_path):
    """Rank 3 made slow by the test (a sitecustomize on its PYTHONPATH, on the job's first start only,
    as a node that is slow and then left out): over straggler_exclude in two reports in a row, the
    run saves its step and stops naming the node; the job is requeued without it and resumes from
    that very step."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SLOW_RANK)
    run_dir = tmp_path / "run"
    job = job_id(submit(slurm_cluster, run_dir, tmp_path / "slurm.out", 24, corpus, every=100, PREFLIGHT=0,
                        PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{ROOT}",
                        overrides=["--diagnostics.straggler_every=4", "--diagnostics.straggler_exclude=2",
                                   "--diagnostics.straggler_exclude_reports=2"]))
    job_dir = run_dir / f"job-{job}"
    shown, log, events = _completed(slurm_cluster, job, run_dir)
    assert [(e["event"], e.get("kind")) for e in events] == [
        ("fault", "straggler"), ("requeue", None), ("training_again", None)], (events, log[-4000:])
    fault, requeue, again = events
    print(f"\n{fault['reason']}\nrequeued without {requeue['excluded']}, training again on {again['nodes']} "
          f"from step {again['resumed_from']}")
    assert fault["ranks"] == [3] and f"ExcNodeList={requeue['excluded']}" in shown
    assert fault["nodes"] == [requeue["excluded"]] and requeue["excluded"] not in again["nodes"]
    # reports every 4 steps; two in a row over the bound: step 8 at the earliest, later when a loaded
    # machine slows the other ranks too. Whichever step it is, that step is saved: none lost.
    assert fault["step"] in (8, 12, 16, 20) and again["resumed_from"] == fault["step"], (fault, again)
    assert sorted(metrics_by_step(job_dir)) == list(range(1, 25))
