"""launch/slurm.sh on a real Slurm cluster: one controller and two slurmd "nodes" on this machine
(<repo>/../shared/slurm/local-cluster.sh), `sbatch --wait`, 2 nodes x 2 CPU ranks (mp 2 x dp 2, gloo).

The cluster needs root and Debian's slurm-wlm (installed with apt on first use). Where slurm cannot
start although root and apt are there, the test fails rather than skips: a launch path that only
works on paper is what this test exists to catch. Only a machine without root, or without both
slurm and apt, skips it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.common import (
    LAYOUT_LINE, ROOT, SLURM_SH, documented_coords, free_port, mesh_table, metrics_by_step, script_env,
    tiny_overrides,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HARNESS = ROOT.parent / "shared" / "slurm" / "local-cluster.sh"
NODES, PROCS_PER_NODE, MP = 2, 2, 2
STEPS = 4
JOB_TIMEOUT = 600


def _ports_free(ports) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _port_base() -> int:
    """A base for the harness's ports (base, base+1, base+10..): not the default 16800, so a cluster
    someone else runs on this machine is left alone."""
    for _ in range(200):
        base = random.randrange(20000, 30000, 20)
        if _ports_free([base, base + 1] + [base + 10 + i for i in range(NODES)]):
            return base
    raise RuntimeError("no free port range for the Slurm daemons")


class Cluster:
    def __init__(self, folder: Path, conf: str) -> None:
        self.folder, self.conf = folder, conf

    def env(self, **extra) -> dict:
        return script_env(SLURM_CONF=self.conf, **extra)

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.folder / "log").glob("*.log")))

    def cancel_all(self) -> None:
        """Cancel every job and wait until none is left (slurmd alone would not end running steps)."""
        jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
        if jobs:
            self.run("scancel", "--full", *jobs)
        deadline = time.monotonic() + 60
        while self.run("squeue", "-h", "-o", "%i").stdout.split() and time.monotonic() < deadline:
            time.sleep(1)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("slurm-wlm is not installed and there is no apt-get to install it")
    assert HARNESS.is_file(), (
        f"{HARNESS} is missing: the CI clones the repository with ../shared beside it (shared/slurm/local-cluster.sh)")
    folder = tmp_path_factory.mktemp("slurm")
    env = script_env(SLURM_LOCAL_PORT_BASE=_port_base())
    cluster = None
    try:
        start = subprocess.run(["bash", str(HARNESS), "start", str(folder), str(NODES), str(PROCS_PER_NODE)],
                               env=env, capture_output=True, text=True, timeout=900)
        conf = re.search(r"export SLURM_CONF=(\S+)", start.stdout)
        assert start.returncode == 0 and conf, f"the Slurm cluster did not start:\n{start.stdout}\n{start.stderr}"
        cluster = Cluster(folder, conf.group(1))
        idle = cluster.run("sinfo", "-h", "-t", "idle", "-o", "%D").stdout.split()
        assert idle and int(idle[0]) == NODES, f"expected {NODES} idle nodes, sinfo says {idle}:\n{cluster.logs()}"
        yield cluster
    finally:
        if cluster is not None:
            cluster.cancel_all()
        subprocess.run(["bash", str(HARNESS), "stop", str(folder)], env=env, capture_output=True, timeout=120)


def _sbatch(cluster: Cluster, run_dir: Path, output: Path, steps: int, corpus, **env) -> tuple[str, Path]:
    """Submit launch/slurm.sh with `sbatch --wait`; returns the job's output and its job folder."""
    env = cluster.env(MP=MP, PROCS_PER_NODE=PROCS_PER_NODE, RUN_DIR=run_dir, MAX_RESTARTS=0,
                      RDZV_HOST="127.0.0.1", RDZV_PORT=free_port(), **env)  # every node name is this machine
    cmd = ["sbatch", "--wait", f"--nodes={NODES}", f"--output={output}", str(SLURM_SH),
           "--", *tiny_overrides(corpus, steps, every=2)]
    try:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        cluster.cancel_all()
        pytest.fail(f"the job did not end in {JOB_TIMEOUT} s:\n{output.read_text()[-5000:] if output.exists() else ''}")
    log = output.read_text() if output.exists() else ""
    assert result.returncode == 0, f"sbatch --wait exited {result.returncode}\n{result.stderr}\n{log[-6000:]}\n{cluster.logs()}"
    job_id = re.search(r"Submitted batch job (\d+)", result.stdout).group(1)
    return log, run_dir / f"job-{job_id}"


def test_sbatch_two_nodes_trains_checkpoints_and_reports_the_documented_layout(slurm_cluster, corpus, tmp_path):
    run_dir = tmp_path / "run"
    log, job_dir = _sbatch(slurm_cluster, run_dir, tmp_path / "slurm-1.out", STEPS, corpus)

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
    log2, job_dir2 = _sbatch(slurm_cluster, run_dir, tmp_path / "slurm-2.out", STEPS + 2, corpus, PREFLIGHT=0)
    assert f"resumed from {run_dir}/checkpoints/step-{STEPS:08d} at step {STEPS}" in log2, log2[-4000:]
    assert sorted(metrics_by_step(job_dir2)) == [STEPS + 1, STEPS + 2]
    assert (run_dir / "checkpoints" / f"step-{STEPS + 2:08d}").is_dir() and job_dir2 != job_dir
    assert "preflight" not in log2


def test_usr1_to_the_job_saves_the_step_requeues_and_the_requeued_job_finishes(slurm_cluster, corpus, tmp_path):
    """`scancel --signal=USR1` (what `#SBATCH --signal=USR1@120` sends ahead of the time limit): the
    torchrun agents pass it to their ranks, which save the step they are in; slurm.sh requeues the
    job, and the same job id starts again, resumes from that checkpoint and trains to the end."""
    steps, run_dir = 16, tmp_path / "run"
    env = slurm_cluster.env(MP=MP, PROCS_PER_NODE=PROCS_PER_NODE, RUN_DIR=run_dir, MAX_RESTARTS=0, PREFLIGHT=0,
                            RDZV_HOST="127.0.0.1", RDZV_PORT=free_port())
    cmd = ["sbatch", f"--nodes={NODES}", f"--output={tmp_path / 'slurm.out'}", str(SLURM_SH),
           "--", *tiny_overrides(corpus, steps, every=100)]
    submitted = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    job_id = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    job_dir = run_dir / f"job-{job_id}"
    deadline = time.monotonic() + 2 * JOB_TIMEOUT  # two starts of the job
    try:
        while not (job_dir / "metrics.jsonl").exists() or len((job_dir / "metrics.jsonl").read_text().splitlines()) < 3:
            assert time.monotonic() < deadline, f"no step 3:\n{slurm_cluster.logs()}"
            time.sleep(0.2)
        signalled = slurm_cluster.run("scancel", "--signal=USR1", job_id)
        assert signalled.returncode == 0, signalled.stderr
        state, hurried, ended_at = "", False, None
        while state != "COMPLETED":
            shown = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
            state = re.search(r"JobState=(\S+)", shown).group(1)
            if state == "PENDING" and "Reason=BeginTime" in shown and not hurried:
                # Slurm holds a requeued job back for a while before it may start again; only the
                # test's clock, not what it checks: let it start now.
                hurried = slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now").returncode == 0
            # On a busy machine slurmctld may show the first start's end (FAILED: its srun step was
            # cancelled) for a moment before it applies the requeue the batch script asked for: a
            # final state only when it stays.
            ended = state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
            ended_at = (ended_at or time.monotonic()) if ended else None
            assert not (ended and time.monotonic() - ended_at > 15) and time.monotonic() < deadline, \
                f"{state}:\n{(job_dir / 'job.log').read_text()[-6000:]}"
            time.sleep(1)
    finally:
        slurm_cluster.cancel_all()
    log = (job_dir / "job.log").read_text()
    stopped = re.search(r"hybridpar: stopped on SIGUSR1 after step (\d+); checkpoint (\S+)\.", log)
    assert stopped, log[-6000:]
    step = int(stopped.group(1))
    print(f"\nstopped after step {step}, requeued, resumed: {re.findall(r'resumed from .*', log)}")
    assert f"requeued job {job_id}" in log and "Restarts=1" in shown
    assert f"resumed from {run_dir}/checkpoints/step-{step:08d} at step {step}" in log, log[-6000:]
    assert sorted(metrics_by_step(job_dir)) == list(range(1, steps + 1))
    assert (run_dir / "checkpoints" / f"step-{steps:08d}").is_dir() and "hybridpar watchdog" not in log
