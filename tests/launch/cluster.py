"""A real Slurm cluster on this machine for the launch tests: one controller and CLUSTER_NODES slurmd
"nodes" (<repo>/../shared/slurm/local-cluster.sh), started once per session (tests/launch/conftest.py).

The cluster needs root and Debian's slurm-wlm (installed with apt on first use). Where slurm cannot
start although root and apt are there, the tests fail rather than skip: a launch path that only
works on paper is what they exist to catch. Only a machine without root, or without both slurm and
apt, skips them.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest

from tests.launch.common import ROOT, SLURM_SH, free_port, script_env, tiny_overrides

HARNESS = ROOT.parent / "shared" / "slurm" / "local-cluster.sh"
CLUSTER_NODES, CPUS_PER_NODE = 3, 2  # a 2-node job and a spare node to heal onto
NODES, PROCS_PER_NODE, MP = 2, 2, 2  # the jobs: mp 2 x dp 2, a model-parallel group per node
JOB_TIMEOUT = 600


def _ports_free(ports) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (launch/slurm.sh --ft: RDZV_PORT + g for group g, then
    the lighthouse's), below the kernel's ephemeral range and the Slurm daemons' (_port_base)."""
    for _ in range(200):
        base = random.randrange(10000, 15000 - count)
        if _ports_free(range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def _port_base(nodes: int) -> int:
    """A base for the harness's ports (base, base+1, base+10..): not the default 16800, so a cluster
    someone else runs on this machine is left alone."""
    for _ in range(200):
        base = random.randrange(20000, 30000, 20)
        if _ports_free([base, base + 1] + [base + 10 + i for i in range(nodes)]):
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

    def wait_completed(self, job: str, deadline: float, log: Path, *, hurry: Optional[str] = None) -> str:
        """Wait until job `job` is COMPLETED, through its requeues; its `scontrol show job` then.
        `hurry`: start a requeued job as soon as Slurm's hold allows (StartTime=now), once `scontrol
        show job` contains `hurry` ("ExcNodeList=n": after launch/slurm.sh's update, which sets the
        excluded node and the start time together; before it, the job could start on that node)."""
        state, hurried, ended_at, settled_at = "", False, None, None
        while state != "COMPLETED":
            shown = self.run("scontrol", "show", "job", job).stdout
            state = re.search(r"JobState=(\S+)", shown).group(1)
            if (hurry is not None and hurry in shown and state == "PENDING" and "Reason=BeginTime" in shown
                    and not hurried):
                # Otherwise backfill's next pass (up to 30 s) starts it: only the test's clock. Not
                # before the last start has left every node and 2 s have passed: slurmd refuses a
                # credential made in the second its job's previous one was revoked ("credential revoked").
                completing = self.run("sinfo", "-h", "-t", "completing", "-o", "%N").stdout.strip()
                settled_at = None if completing else (settled_at or time.monotonic())
                if settled_at is not None and time.monotonic() - settled_at >= 2:
                    hurried = self.run("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0
            # On a busy machine slurmctld may show a start's end (its srun step was cancelled) for a
            # moment before it applies the requeue the batch script asked for: final only when it stays.
            ended = state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
            ended_at = (ended_at or time.monotonic()) if ended else None
            assert not (ended and time.monotonic() - ended_at > 60) and time.monotonic() < deadline, \
                f"{state}:\n{shown}\n{log.read_text()[-6000:] if log.exists() else ''}"
            time.sleep(1)
        return shown

    def rank_processes(self, job: str) -> list[tuple[int, dict]]:
        """(pid, environment) of each training rank of job `job` of this cluster now (torchrun's workers:
        they have RANK). Its slurm.conf tells them from the ranks of another cluster's job of the same id
        (the tests of another checkout may run one on this machine)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = dict(v.split("=", 1) for v in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                           if "=" in v)
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (env.get("SLURM_JOB_ID") == job and env.get("SLURM_CONF") == self.conf and "RANK" in env
                    and b"hybridpar" in cmdline and b"train" in cmdline):
                found.append((int(entry.name), env))
        return found

    def cancel_all(self) -> None:
        """Cancel every job and wait until none is left (slurmd alone would not end running steps)."""
        jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
        if jobs:
            self.run("scancel", "--full", *jobs)
        deadline = time.monotonic() + 60
        while self.run("squeue", "-h", "-o", "%i").stdout.split() and time.monotonic() < deadline:
            time.sleep(1)


@contextmanager
def local_cluster(folder: Path, nodes: int = CLUSTER_NODES, cpus: int = CPUS_PER_NODE) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("slurm-wlm is not installed and there is no apt-get to install it")
    assert HARNESS.is_file(), (
        f"{HARNESS} is missing: the CI clones the repository with ../shared beside it (shared/slurm/local-cluster.sh)")
    env = script_env(SLURM_LOCAL_PORT_BASE=_port_base(nodes))
    cluster = None
    try:
        start = subprocess.run(["bash", str(HARNESS), "start", str(folder), str(nodes), str(cpus)],
                               env=env, capture_output=True, text=True, timeout=900)
        conf = re.search(r"export SLURM_CONF=(\S+)", start.stdout)
        assert start.returncode == 0 and conf, f"the Slurm cluster did not start:\n{start.stdout}\n{start.stderr}"
        cluster = Cluster(folder, conf.group(1))
        idle = cluster.run("sinfo", "-h", "-t", "idle", "-o", "%D").stdout.split()
        assert idle and int(idle[0]) == nodes, f"expected {nodes} idle nodes, sinfo says {idle}:\n{cluster.logs()}"
        yield cluster
    finally:
        if cluster is not None:
            cluster.cancel_all()
        subprocess.run(["bash", str(HARNESS), "stop", str(folder)], env=env, capture_output=True, timeout=120)


def job_env(cluster: Cluster, run_dir: Path, **env) -> dict:
    """The environment of a 2-node job of launch/slurm.sh; `env` overrides (MAX_RESTARTS=0 unless given)."""
    return cluster.env(**{"MP": MP, "PROCS_PER_NODE": PROCS_PER_NODE, "RUN_DIR": run_dir, "MAX_RESTARTS": 0,
                          "RDZV_HOST": "127.0.0.1", "RDZV_PORT": free_port(), **env})  # every node name is this machine


def submit(cluster: Cluster, run_dir: Path, output: Path, steps: int, corpus, *, every: int = 2,
           overrides: Sequence[str] = (), options: Sequence[str] = (), wait: bool = False, nodes: int = NODES,
           sbatch_options: Sequence[str] = (), **env) -> subprocess.CompletedProcess:
    """sbatch launch/slurm.sh for a 2-node job of the tiny model (`wait`: until it ends; then its
    returncode is the job's exit code, as `sbatch --wait` returns it); `options`: slurm.sh's own, before its --;
    `sbatch_options`: sbatch's."""
    cmd = ["sbatch", f"--nodes={nodes}", *sbatch_options, f"--output={output}", str(SLURM_SH), *options,
           "--", *tiny_overrides(corpus, steps, every=every), *overrides]
    submitted = subprocess.run(cmd, cwd=ROOT, env=job_env(cluster, run_dir, **env), capture_output=True, text=True,
                               timeout=60)
    if not wait or submitted.returncode != 0:
        return submitted
    # What `sbatch --wait` does, without its sleeps (2, 8, then 32 s between looks: up to half a
    # minute after the job ended): the job's exit code once it has ended.
    job, deadline = job_id(submitted), time.monotonic() + JOB_TIMEOUT
    while (state := re.search(r"JobState=(\S+)", shown := cluster.run("scontrol", "show", "job", job).stdout)) \
            and state.group(1) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING"):
        if time.monotonic() > deadline:
            cluster.cancel_all()
            pytest.fail(f"the job did not end in {JOB_TIMEOUT} s:\n{output.read_text()[-5000:] if output.exists() else ''}")
        time.sleep(0.5)
    exit_code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
    assert exit_code, f"no ExitCode for job {job}:\n{shown}"
    code = int(exit_code.group(1)) or (128 + int(exit_code.group(2)) if int(exit_code.group(2)) else 0)
    return subprocess.CompletedProcess(cmd, code, submitted.stdout, submitted.stderr + shown)


def job_id(submitted: subprocess.CompletedProcess) -> str:
    found = re.search(r"Submitted batch job (\d+)", submitted.stdout)
    assert found, f"sbatch failed: {submitted.stdout}\n{submitted.stderr}"
    return found.group(1)


def sbatch_wait(cluster: Cluster, run_dir: Path, output: Path, steps: int, corpus, *, every: int = 2,
                overrides: Sequence[str] = (), **env) -> tuple[str, Path]:
    """Submit and wait until the job ends (exit code 0 asserted); returns its output and its job folder."""
    result = submit(cluster, run_dir, output, steps, corpus, every=every, overrides=overrides, wait=True, **env)
    log = output.read_text() if output.exists() else ""
    assert result.returncode == 0, f"the job exited {result.returncode}\n{result.stderr}\n{log[-6000:]}\n{cluster.logs()}"
    return log, run_dir / f"job-{job_id(result)}"


def wait_for_step(job_dir: Path, step: int, deadline: float, cluster: Cluster) -> None:
    """Until the job's metrics.jsonl has `step` rows."""
    metrics = job_dir / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < step:
        assert time.monotonic() < deadline, f"no step {step}:\n{cluster.logs()}"
        time.sleep(0.2)
