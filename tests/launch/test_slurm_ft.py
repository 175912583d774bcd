"""launch/slurm.sh --ft: fault-tolerant replica groups on Slurm (launch/slurm_ft.sh). Without Slurm: the
dry run's lighthouse and per-group commands, and the refusals. On the local 3-node cluster
(tests/launch/cluster.py), one group per node: every rank of one node SIGKILLed from outside at step
10; the other groups train on, the killed group is restarted and rejoins, the job ends at step 40
without a requeue, and slurm.sh's line names the node (issue 51)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.launch.cluster import JOB_TIMEOUT, free_ports, job_id, submit
from tests.launch.common import SLURM_SH, printed_command, run_script, script_env


def _dry_run(*args: str, **env) -> tuple[int, str]:
    result = run_script(SLURM_SH, "--dry-run", *args, env=script_env(**env))
    return result.returncode, result.stdout + result.stderr


def test_the_dry_run_prints_the_lighthouse_and_a_torchrun_of_its_own_per_group(tmp_path):
    code, out = _dry_run("--ft", "--mp", "8", "--", "--train.steps", "7", NODES=4, GROUP_NODES=2, PROCS_PER_NODE=8,
                         RDZV_PORT=29400, RUN_DIR=tmp_path / "run", MIN_GROUPS=1)
    assert code == 0, out
    job = f"{tmp_path}/run/job-dryrun"
    assert "2 replica groups of 2 node(s) x 8 processes = 16 ranks, each mp 8 x dp_shard 2" in out
    assert printed_command(out, "lighthouse")[:7] == [
        "python3", "-m", "hybridpar", "lighthouse", "--port", "29402", "--min-groups"]
    # Group 1: the allocation's nodes 2 and 3, its rendezvous on its own first node (node2 in a dry run).
    assert printed_command(out, "group 1 srun") == [
        "srun", "--nodes=2", "--ntasks=2", "--relative=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label"]
    argv = printed_command(out, "group 1 torchrun")
    assert argv[:12] == [
        "python3", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node2:29401", "--rdzv-id=dryrun-group1", "--max-restarts=3", f"--log-dir={job}/group-1/torchrun",
        "--tee=3", "-m"]
    assert argv[argv.index("--parallel.dp_replicate") + 1] == "1" and argv[argv.index("--parallel.mp") + 1] == "8"
    lighthouse = argv[argv.index("--fault_tolerance.lighthouse") + 1]
    assert lighthouse.startswith("http://") and lighthouse.endswith(":29402")
    assert argv[-12:-2] == ["--train.steps", "7", "--fault_tolerance.enabled", "true", "--fault_tolerance.groups", "2",
                            "--fault_tolerance.min_groups", "1", "--fault_tolerance.lighthouse", lighthouse]
    assert argv[-2:] == ["--fault_tolerance.group", "1"]  # the script's, after the user's overrides
    assert printed_command(out, "group 0 torchrun")[-1] == "0" and "group 2 torchrun" not in out
    assert "world 16 = dp_replicate 1 x dp_shard 2 x mp 8" in out  # a group's mesh
    assert not (tmp_path / "run").exists()


def test_a_given_rendezvous_host_takes_every_group_and_the_lighthouse(tmp_path):
    code, out = _dry_run("--ft", NODES=3, PROCS_PER_NODE=2, MP=2, RDZV_HOST="127.0.0.1", RDZV_PORT=25000,
                         RUN_DIR=tmp_path / "run")
    assert code == 0, out
    for g in range(3):
        assert f"--rdzv-endpoint=127.0.0.1:{25000 + g}" in printed_command(out, f"group {g} torchrun")
    assert "at http://127.0.0.1:25003" in out


@pytest.mark.parametrize("env, said", [
    ({"NODES": 4, "GROUP_NODES": 3}, "GROUP_NODES=3 does not divide the job's 4 nodes: submit a multiple of it"),
    ({"NODES": 4, "DP_REPLICATE": 2}, "DP_REPLICATE must be 1, got 2; for more replicas make more, smaller groups"),
    ({"NODES": 2, "MIN_GROUPS": 3}, "MIN_GROUPS must be in 1 .. 2 (the job's replica groups), got '3'"),
    ({"NODES": 2, "GROUP_NODES": 0}, "GROUP_NODES must be a positive integer, got '0'"),
], ids=["group-nodes", "dp-replicate", "min-groups", "zero"])
def test_sizes_that_do_not_make_groups_are_refused_in_one_line(tmp_path, env, said):
    code, out = _dry_run("--ft", PROCS_PER_NODE=2, MP=2, RUN_DIR=tmp_path / "run", **env)
    errors = [line for line in out.splitlines() if "error" in line]
    assert code == 2 and errors == [f"slurm.sh: error: {errors[0].split('error: ', 1)[1]}"] and said in errors[0], out


# --- on the local Slurm cluster -------------------------------------------------------------------

STEPS, KILL_AT, GROUPS = 40, 10, 3
# The tiny Llama of the `local` config (about a second a step here, as tests/replicas' groups): a
# restarted group is back before the others reach step 40 (the debug model's steps are 4x shorter).
MODEL = ["--model.preset=tiny", "--data.seq_len=128", "--fault_tolerance.timeout=15", "--diagnostics.train_timeout=60",
         "--data.val_fraction=0.05", f"--train.eval_every={STEPS}", "--train.eval_steps=2"]


def _rows(job_dir: Path, group: int, name: str = "metrics.jsonl") -> list[dict]:
    path = job_dir / f"group-{group}" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _groups_pids(cluster, job: str) -> dict[int, dict[int, str]]:
    """group -> {pid: node} of job `job`'s ranks now (the group: its --fault_tolerance.group)."""
    found: dict[int, dict[int, str]] = {}
    for pid, env in cluster.rank_processes(job):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone since
            continue
        if "--fault_tolerance.group" not in argv:  # a helper process the rank started
            continue
        group = int(argv[len(argv) - argv[::-1].index("--fault_tolerance.group")])
        found.setdefault(group, {})[pid] = env.get("SLURMD_NODENAME", "?")
    return found


def ft_round(cluster, corpus, folder: Path, *, groups: int = GROUPS, steps: int = STEPS, kill_at: int = KILL_AT) -> dict:
    """A --ft job of `groups` nodes, one group each, `steps` steps of MODEL (checkpoints every 10): once
    group 1 has trained step `kill_at` with every group and that step's checkpoint is complete, every
    rank on its node is SIGKILLed; watched until the job completes. What happened, timed from the kill
    (bench/fault_tolerance.py runs it too)."""
    run_dir = folder / "run"
    # All the "nodes" are this machine: the groups' ranks use their agents' stores at the ports the
    # script gives them (RDZV_PORT + g, all free), rather than each picking a free port for its own,
    # beside two other groups' sockets.
    started = time.monotonic()
    job = job_id(submit(cluster, run_dir, folder / "slurm.out", steps, corpus, every=10, nodes=groups,
                        sbatch_options=["--no-kill"], options=["--ft"], overrides=MODEL, PREFLIGHT=0, MAX_RESTARTS=3,
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0, RDZV_PORT=free_ports(groups + 1)))
    job_dir, checkpoint = run_dir / f"job-{job}", run_dir / "checkpoints" / f"step-{kill_at:08d}"
    deadline = time.monotonic() + JOB_TIMEOUT
    r = {"job": job, "job_dir": job_dir, "run_dir": run_dir, "seen": {}, "killed": None, "back_s": None,
         "last_step_s": None, "named_s": None}
    try:
        while "JobState=COMPLETED" not in (shown := cluster.run("scontrol", "show", "job", job).stdout):
            assert time.monotonic() < deadline and "JobState=FAILED" not in shown, shown
            for g, pids in _groups_pids(cluster, job).items():
                r["seen"].setdefault(g, {}).update(pids)  # every rank pid of each group ever seen
            rows, killed = _rows(job_dir, 1), r["killed"]
            # (a group that starts late joins at the others' step: the kill waits until all train together)
            if killed is None and rows and rows[-1]["step"] >= kill_at and rows[-1].get("groups") == groups \
                    and checkpoint.is_dir():
                victims = _groups_pids(cluster, job)[1]
                r["node"], r["killed_at"], r["killed"] = next(iter(victims.values())), rows[-1]["step"], time.monotonic()
                assert set(victims.values()) == {r["node"]}, victims
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
            elif killed is not None:
                now = time.monotonic() - killed
                if r["back_s"] is None and rows and rows[-1]["step"] > r["killed_at"] + 1:
                    r["back_s"] = now
                if r["last_step_s"] is None and any(row["step"] == steps for row in _rows(job_dir, 0)):
                    r["last_step_s"] = now
                if r["named_s"] is None and "slurm.sh: replica group 1 (" in (job_dir / "job.log").read_text():
                    r["named_s"] = now
            time.sleep(0.2)
    finally:
        cluster.cancel_all()
    r.update(shown=shown, log=(job_dir / "job.log").read_text(), total_s=time.monotonic() - started)
    return r


@pytest.mark.slurm
@pytest.mark.slow
def test_a_nodes_killed_ranks_cost_their_group_steps_and_the_job_no_requeue(slurm_cluster, corpus, tmp_path):
    r = ft_round(slurm_cluster, corpus, tmp_path)
    shown, log, job_dir, seen = r["shown"], r["log"], r["job_dir"], r["seen"]
    assert r["killed"] is not None, log[-6000:]
    node, killed_at, back = r["node"], r["killed_at"], r["back_s"]
    seconds = {k: "-" if r[k] is None else f"{r[k]:.1f}" for k in ("named_s", "back_s", "last_step_s")}
    print(f"\nkilled group 1's ranks on {node} after step {killed_at}; slurm.sh named it {seconds['named_s']} s later, "
          f"group 1 trained again {seconds['back_s']} s later, step {STEPS} {seconds['last_step_s']} s after the kill")
    # No requeue: the same start of the job, completed.
    assert "Restarts=0" in shown and "ExitCode=0:0" in shown and "requeue" not in log, shown + log[-6000:]
    # slurm.sh's lines name the node the group ran on: its restart by torchrun (no verdict: every rank of
    # it was killed) or its drop-out, whichever it saw first, then its return. incidents.jsonl has the fault.
    said = [line for line in log.splitlines() if line.startswith(f"slurm.sh: replica group 1 ({node})")]
    assert said and said[0].split(f"({node})", 1)[1].startswith((
        ": restarted by its torchrun (attempt 1 of MAX_RESTARTS=3)",
        f" dropped out of step {killed_at + 1}: group(s) 0, 2 commit it without it")), log[-6000:]
    assert any(" is back" in line for line in said) and said[-1].endswith(" finished"), said
    events = [json.loads(line) for line in (r["run_dir"] / "incidents.jsonl").read_text().splitlines()]
    fault = events[0]
    assert (fault["event"], fault["kind"] in ("restarted", "dropped"), fault["group"], fault["nodes"],
            fault["action"]) == ("fault", True, 1, [node], "train-on"), events
    assert not any(e["event"] in ("requeue", "stop") for e in events), events
    assert f"incident 1: {fault['kind']} on {node}" in log
    # Groups 0 and 2: never restarted (the same two ranks throughout), every step from their first to the
    # last logged once; group 1 restarted (other pids), and trained again to the end.
    for g in (0, 2):
        steps = [row["step"] for row in _rows(job_dir, g) if "loss" in row]
        assert len(seen[g]) == 2 and steps == list(range(steps[0], STEPS + 1)) and steps[0] <= killed_at, (g, seen[g], steps)
    assert len(seen[1]) == 4 and back is not None and back < 60, seen
    after = [row["step"] for row in _rows(job_dir, 1) if "loss" in row and row["step"] > killed_at]
    assert after and after[-1] == STEPS and after == list(range(after[0], STEPS + 1)), after
    # Every group ends on the same parameters: the same validation loss at the last step.
    val = [next(row["val_loss"] for row in _rows(job_dir, g) if row["step"] == STEPS and "val_loss" in row)
           for g in range(GROUPS)]
    assert max(val) - min(val) <= 1e-6 * abs(val[0]), val
