"""Two replica groups of 2 ranks (mp 2) through launch/ft_local.sh, as a user starts them: rank 1 of
group 1 SIGKILLed from outside at step 8. Group 0 trains on alone and never restarts; group 1 is
restarted by its torchrun, healed from group 0 and trains to the end with it (issue 51)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.common import ROOT, environ_of, free_port, script_env, stop_session

pytestmark = pytest.mark.slow

STEPS, KILL_AT, TIMEOUT = 40, 8, 600
HEARTBEAT = 5.0  # hybridpar lighthouse's --heartbeat-timeout: how long a silent group stays in the quorum


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _heals(run: Path) -> int:
    """Group 1's heals so far (one at start-up too, when group 0 began a step before it)."""
    return sum(e["event"] == "healed" for e in _rows(run / "group-1" / "events.jsonl"))


def _ranks(group: int) -> dict[int, int]:
    """pid -> RANK of the training processes of `group` now."""
    found = subprocess.run(["pgrep", "-f", f"fault_tolerance.group {group}"], capture_output=True, text=True).stdout
    ranks = {}
    for pid in map(int, found.split()):
        env = environ_of(pid)
        if "LOCAL_RANK" in env and "TORCHELASTIC_RUN_ID" in env:  # a rank, not torchrun itself
            ranks[pid] = int(env["RANK"])
    return ranks


def test_a_killed_group_drops_out_and_rejoins_while_the_other_trains_on(corpus, tmp_path):
    run = tmp_path / "run"
    env = script_env(RUN_DIR=str(run), LIGHTHOUSE_PORT=str(free_port()), FT_GROUPS="2", PROCS="2")
    argv = ["bash", str(ROOT / "launch" / "ft_local.sh"), "--train.steps", str(STEPS), "--train.log_every", "1",
            "--train.eval_every", str(STEPS), "--checkpoint.every", "0", "--fault_tolerance.timeout", "15",
            "--data.source", corpus["source"], "--data.tokenizer_vocab_size", "512", "--data.cache_dir", corpus["cache_dir"],
            "--output.tensorboard", "false", "--output.plot", "false"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen, killed, healed = {}, None, None  # group 0's rank pids ever seen; when the kill and the heal came
    try:
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"the job did not end in {TIMEOUT} s"
            seen.update(_ranks(0))
            steps = [r["step"] for r in _rows(run / "group-1" / "metrics.jsonl") if "loss" in r]
            if killed is None and steps and steps[-1] >= KILL_AT:
                victim = next(pid for pid, rank in _ranks(1).items() if rank == 1)
                os.kill(victim, signal.SIGKILL)
                killed, heals = time.monotonic(), _heals(run)
            if killed and healed is None and _heals(run) > heals:
                healed = time.monotonic() - killed
            time.sleep(0.05)
        out = proc.stdout.read()
    finally:
        stop_session(proc)
    logs = {g: (run / f"group-{g}.log").read_text() for g in (0, 1)}
    assert proc.returncode == 0, out + logs[0][-3000:] + logs[1][-3000:]
    assert killed is not None, logs[1][-3000:]
    # Group 0: the same two processes from start to end, every step logged once.
    assert sorted(seen.values()) == [0, 1], seen
    rows = {g: [r for r in _rows(run / f"group-{g}" / "metrics.jsonl") if "loss" in r] for g in (0, 1)}
    assert [r["step"] for r in rows[0]] == list(range(1, STEPS + 1))
    # Its steps after the kill: one waits for the lighthouse to drop group 1, none other is slow.
    usual = statistics.median(r["step_time"] for r in rows[0][1:KILL_AT])
    slow = [r["step"] for r in rows[0][KILL_AT:] if r["step_time"] > usual + 2.0]
    print(f"\ngroup 0: usual step {usual:.2f} s; slow after the kill: "
          f"{[(r['step'], round(r['step_time'], 1)) for r in rows[0] if r['step'] in slow]}; group 1 healed "
          f"{healed:.1f} s after the kill" if healed else "")
    assert len(slow) <= 1 and max(r["step_time"] for r in rows[0][KILL_AT:]) < usual + HEARTBEAT + 10, rows[0]
    # Group 1: restarted by its torchrun, healed within 60 s, trained to the end.
    assert healed is not None and healed < 60, logs[1][-3000:]
    assert "rank(s) [1] died" in logs[1]  # its own watchdog named the death
    assert rows[1][-1]["step"] == STEPS and len({r["step"] for r in rows[1]}) == len(rows[1])
    # Both end on the same parameters: the same validation loss.
    val = [next(r["val_loss"] for r in rows[g] if r["step"] == STEPS) for g in (0, 1)]
    assert abs(val[0] - val[1]) <= 1e-6 * abs(val[0]), val
    # Which steps had one group: group 0's events, and every group's position in the checkpoint.
    changes = [e for e in _rows(run / "group-0" / "events.jsonl") if e["event"] == "groups"]
    after = [e for e in changes if e["step"] > KILL_AT]  # (at the start one group may have begun alone)
    assert [e["groups"] for e in after] == [[0], [0, 1]] and after[0]["step"] == KILL_AT + 1, changes
    assert after[1]["seconds_fewer"] < 60, after
    # Group 1's windows: the steps it took part in, every step but those group 0 committed alone.
    alone = sum(b["step"] - a["step"] for a, b in zip(changes, changes[1:]) if a["groups"] == [0])
    state = json.loads((run / "checkpoints" / f"step-{STEPS:08d}" / "train_state.json").read_text())
    assert state["replicas"]["windows"] == [STEPS, STEPS - alone], (state["replicas"], changes)
