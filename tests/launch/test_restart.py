"""Two torchrun agents on loopback (two "nodes", no Slurm) running the command launch/slurm.sh builds;
then the same job with one rank killed by SIGKILL mid-run: torchrun restarts every rank, they resume
from the newest complete checkpoint, and the run ends bit-exactly where the uninterrupted one did;
and the same job stopped with SIGTERM to its agents: it saves the step it is in and a second job
continues from there to the same end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.launch.common import (
    ROOT, SLURM_SH, children, environ_of, flat_tensors, free_port, load_checkpoint, metrics_by_step,
    printed_command, printed_env, run_script, script_env, stop_session, tiny_overrides,
)

pytestmark = pytest.mark.slow

NODES, PROCS_PER_NODE, MP = 2, 2, 2
STEPS, EVERY = 12, 4
KILL_AFTER = "step-00000004"  # kill once this checkpoint is complete, with 8 steps still to go
KILLED_RANK = 3
TIMEOUT = 600


def _launch(corpus, run_dir: Path, max_restarts: int, every: int = EVERY, attempt: str = "", overrides=(), **env):
    """Start the dry run's torchrun command twice, as the agents of two nodes; returns (procs, logs, job_dir)."""
    env = script_env(NODES=NODES, PROCS_PER_NODE=PROCS_PER_NODE, MP=MP, RUN_DIR=run_dir, RDZV_HOST="127.0.0.1",
                     RDZV_PORT=free_port(), MAX_RESTARTS=max_restarts, **env)
    dry = run_script(SLURM_SH, "--dry-run", "--", *tiny_overrides(corpus, STEPS, every), *overrides, env=env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    argv = printed_command(dry.stdout, "torchrun")
    env.update(printed_env(dry.stdout))  # what slurm.sh exports before srun
    job_dir = Path(argv[argv.index("--output.run_dir") + 1])
    run_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for node in range(NODES):
        log = run_dir / f"agent{node}{attempt}.log"
        with open(log, "w") as f:
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        logs.append(log)
    return procs, logs, job_dir


def _wait(procs, logs) -> str:
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in procs:
            stop_session(proc)
    output = "\n".join(log.read_text() for log in logs)
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, f"agent {node} exited with {proc.returncode}:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("loopback") / "straight"
    procs, logs, job_dir = _launch(corpus, run_dir, max_restarts=0)
    output = _wait(procs, logs)
    return {"run_dir": run_dir, "job_dir": job_dir, "output": output}


def test_two_agents_on_loopback_train_together(uninterrupted):
    out = uninterrupted["output"]
    assert "4 ranks = dp_replicate 1 x dp_shard 2 x mp 2" in out
    # Each agent started its own two ranks: two torchrun log folders, each with local ranks 0 and 1.
    agents = sorted((uninterrupted["job_dir"] / "torchrun").iterdir())
    assert len(agents) == NODES
    for agent in agents:
        assert sorted(p.name for p in (agent / "attempt_0").iterdir()) == ["0", "1"]
    rows = metrics_by_step(uninterrupted["job_dir"])
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert rows[STEPS]["loss"] < rows[1]["loss"] - 0.5
    assert (uninterrupted["run_dir"] / "checkpoints" / f"step-{STEPS:08d}").is_dir()


def _find_rank(agent_pids: list[int], rank: int) -> int:
    for agent in agent_pids:
        for pid in children(agent):
            if environ_of(pid).get("RANK") == str(rank):
                return pid
    raise AssertionError(f"no worker process with RANK={rank} under the agents {agent_pids}")


def test_killed_rank_restarts_and_ends_bit_exact(uninterrupted, corpus, tmp_path):
    run_dir = tmp_path / "killed"
    # torchrun stops the survivors with SIGTERM; stuck in a collective with the dead rank, their stop
    # cannot finish its step and gives up after exit_save_timeout (25 s by default) before the restart.
    # On torch's default store (the agents', kept across restarts, whose restart counts differ after
    # the kill): hybridpar's own rendezvous keeps each attempt's keys apart (slurm.sh sets the other).
    procs, logs, job_dir = _launch(corpus, run_dir, max_restarts=1, overrides=["--checkpoint.exit_save_timeout=3"],
                                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (run_dir / "checkpoints" / KILL_AFTER).is_dir():
            assert all(p.poll() is None for p in procs), "an agent ended before the first checkpoint"
            assert time.monotonic() < deadline, f"no {KILL_AFTER} after {TIMEOUT} s"
            time.sleep(0.05)
        victim = _find_rank([p.pid for p in procs], KILLED_RANK)
        steps_at_kill = len((job_dir / "metrics.jsonl").read_text().splitlines())
        os.kill(victim, signal.SIGKILL)  # from outside, no chance to clean up: a crashed node or OOM kill
    except BaseException:
        for proc in procs:
            stop_session(proc)
        raise
    out = _wait(procs, logs)
    print(f"\nkilled rank {KILLED_RANK} (pid {victim}) after {steps_at_kill} logged steps")

    resumed = re.findall(r"resumed from \S+/step-(\d+) at step (\d+)", out)
    assert resumed, f"no resume after the kill:\n{out[-6000:]}"
    start = int(resumed[-1][1])
    assert EVERY <= start < STEPS, resumed
    assert steps_at_kill < STEPS, "the run had finished before the kill"
    assert any((job_dir / "torchrun").glob("*/attempt_1")), "torchrun did not restart the ranks"

    _assert_ends_like(uninterrupted, run_dir, job_dir, tmp_path)


def _assert_ends_like(uninterrupted, run_dir: Path, job_dir: Path, tmp_path: Path) -> None:
    """Every step's loss (the later attempt's where both logged it) and the final state: identical."""
    straight, resumed = metrics_by_step(uninterrupted["job_dir"]), metrics_by_step(job_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s]["loss"] for s in resumed] == [straight[s]["loss"] for s in resumed]
    final = f"step-{STEPS:08d}"
    a = flat_tensors(load_checkpoint(uninterrupted["run_dir"] / "checkpoints" / final, tmp_path / "a.pt"))
    b = flat_tensors(load_checkpoint(run_dir / "checkpoints" / final, tmp_path / "b.pt"))
    assert a.keys() == b.keys() and any(k.startswith("model.") for k in a) and any(k.startswith("optimizer.") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:5]}"
    print(f"final loss {resumed[STEPS]['loss']!r} == {straight[STEPS]['loss']!r}; "
          f"{len(a)} model and optimizer tensors bit-identical")


def test_sigterm_to_the_agents_saves_the_step_in_progress_and_the_next_job_continues(uninterrupted, corpus, tmp_path):
    """No periodic checkpoint is due (every 100 steps): the stop's own checkpoint is all there is.
    Both agents get SIGTERM, as scancel or a preemption sends it to every task, and pass it to
    their ranks, which stop after the same step and save; the agents exit within torchrun's 30 s
    grace, and no watchdog verdict is printed. (One rank alone signalled: tests/train/test_stop.py.
    One agent alone is not a launcher's case: the other then waits in torchrun's exit barrier.)"""
    run_dir = tmp_path / "stopped"
    procs, logs, job_dir = _launch(corpus, run_dir, max_restarts=1, every=100)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (job_dir / "metrics.jsonl").exists() or len((job_dir / "metrics.jsonl").read_text().splitlines()) < 3:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no step 3"
            time.sleep(0.05)
        for proc in procs:
            os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        codes = [proc.wait(timeout=60) for proc in procs]
        took = time.monotonic() - sent
    finally:
        for proc in procs:
            stop_session(proc)
    out = "\n".join(log.read_text() for log in logs)
    stopped = re.findall(r"hybridpar: stopped on SIGTERM after step (\d+); checkpoint (\S+)\.", out)
    print(f"\nSIGTERM to both agents: they exited after {took:.1f} s; exit codes {codes}; {stopped}")
    assert len(stopped) == 1, out[-6000:]
    step = int(stopped[0][0])
    assert 3 <= step < STEPS, out[-6000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step-{step:08d}"]
    assert "hybridpar watchdog" not in out and took < 30, out[-6000:]
    assert json.loads((job_dir / "stopped.json").read_text())["step"] == step

    procs, logs, job_dir = _launch(corpus, run_dir, max_restarts=0, every=100, attempt="-again")
    out = _wait(procs, logs)
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step:08d}'} at step {step}" in out
    _assert_ends_like(uninterrupted, run_dir, job_dir, tmp_path)
