"""`torchrun --standalone --max-restarts` as users type it, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE:
one rank SIGKILLed from outside as a checkpoint is being written, torchrun restarts both ranks on the store it kept
(pytorch/pytorch#135712), and the new attempt resumes from the newest checkpoint and finishes. On
ec7aedb the new attempt hung in set-up without a word, or died in gloo's connectFullMesh, in 3 of 5
rounds. bench/restarts.py repeats the round many times."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from tests.launch.common import ROOT, children, environ_of, script_env, stop_session, tiny_overrides

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 2
KILL_AT = 4  # rank 1 is killed once this checkpoint's folder appears (its save under way, or just done)
TIMEOUT = 300


def restart_round(corpus: dict, run_dir: Path, share_store: bool = True, root: Path = ROOT,
                  timeout: float = TIMEOUT) -> dict:
    """One job of 2 ranks (mp 2) under `torchrun --standalone --max-restarts 2`, rank 1 killed once
    checkpoint KILL_AT's folder appears. share_store: torch's default (the agent's store kept across
    restarts); False sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. Returns what happened."""
    env = script_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", "2", "-m", "hybridpar", "train", "--config", "local", "--parallel.mp", "2",
            *tiny_overrides(corpus, STEPS, EVERY), "--checkpoint.resume=true", f"--output.run_dir={run_dir}",
            "--checkpoint.exit_save_timeout=3"]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "torchrun.log"
    killed_at: Optional[float] = None
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not (run_dir / "checkpoints" / f"step-{KILL_AT:08d}").exists():
            assert proc.poll() is None, f"the job ended before checkpoint {KILL_AT}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no checkpoint {KILL_AT} after {timeout} s"
            time.sleep(0.05)
        victim = next(pid for pid in children(proc.pid) if environ_of(pid).get("RANK") == "1")
        os.kill(victim, signal.SIGKILL)  # from outside, no chance to clean up
        killed_at = time.monotonic()
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        ended = time.monotonic()
    finally:
        stop_session(proc)
    out = log.read_text()
    resumed = re.findall(r"resumed from \S+/step-(\d+) at step (\d+)", out)
    return {"returncode": proc.returncode, "resumed": [int(s) for s, _ in resumed],
            "finished": (run_dir / "checkpoints" / f"step-{STEPS:08d}" / "train_state.json").exists(),
            "connect_failed": "connectFullMesh" in out or "Connection refused" in out,
            "seconds_after_kill": round(ended - killed_at, 1), "log": out}


@pytest.mark.parametrize("round_", [1, 2])
def test_a_killed_rank_under_torchrun_standalone_restarts_and_finishes(corpus, tmp_path, round_):
    result = restart_round(corpus, tmp_path / "run")
    out = result["log"]
    print(f"\nround {round_}: rc {result['returncode']}, resumed from {result['resumed']}, "
          f"{result['seconds_after_kill']} s from the kill to the end")
    assert result["returncode"] == 0 and result["finished"], out[-6000:]
    assert result["resumed"] and result["resumed"][-1] >= KILL_AT - EVERY, out[-6000:]
    assert "hybridpar watchdog" in out and "rank(s) [1] died" in out  # the kill was seen, and named
