"""Two replica groups through launch/ft_local.sh as a user starts them, watched from outside: the
helpers of the tests that make a group fail (test_replica_groups.py, test_replica_hang.py,
test_replica_scope.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from tests.launch.common import ROOT, environ_of, script_env, stop_session
from tests.distributed import free_port

TIMEOUT = 600  # seconds a job may take before its test fails


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps(run: Path, group: int) -> list[dict]:
    """The step rows (with a loss) group `group` has logged so far."""
    return [r for r in rows(run / f"group-{group}" / "metrics.jsonl") if "loss" in r]


def heals(run: Path, group: int = 1) -> int:
    """A group's heals so far (one at start-up too, when the other began a step before it)."""
    return sum(e["event"] == "healed" for e in rows(run / f"group-{group}" / "events.jsonl"))


def ranks(run: Path, group: int) -> dict[int, int]:
    """pid -> RANK of the training processes of `group` of the job in `run` now (not another test's)."""
    found = subprocess.run(["pgrep", "-f", f"fault_tolerance.group {group}"], capture_output=True, text=True).stdout
    out = {}
    for pid in map(int, found.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        env = environ_of(pid)
        # a rank (not torchrun itself) of this job
        if str(run).encode() in argv and "LOCAL_RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            out[pid] = int(env["RANK"])
    return out


def stop_leftovers(run: Path) -> None:
    """Ranks of this test's groups still running (a torchrun killed with the session leaves them)."""
    for group in (0, 1):
        for pid in ranks(run, group):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(corpus: dict, run: Path, steps: int, *flags: str, port: int = 0, **env) -> subprocess.Popen:
    """launch/ft_local.sh: a lighthouse on `port` (0: a free one) and two groups of mp 2 training the
    local config for `steps` steps (validated at the last), `flags` overriding the config; `env`: the
    script's variables (RESTARTS, FT_GROUPS...)."""
    env = script_env(**{"RUN_DIR": str(run), "LIGHTHOUSE_PORT": str(port or free_port()), "FT_GROUPS": "2", "PROCS": "2",
                        **env})
    argv = ["bash", str(ROOT / "launch" / "ft_local.sh"), "--train.steps", str(steps), "--train.log_every", "1",
            "--train.eval_every", str(steps), "--checkpoint.every", "0",
            "--data.source", corpus["source"], "--data.tokenizer_vocab_size", "512", "--data.cache_dir", corpus["cache_dir"],
            "--output.tensorboard", "false", "--output.plot", "false", *flags]
    return subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


class Fault:
    """A signal from outside to rank `rank` of group `group` once that group has logged step `at` and
    the other group a step too, both training (tick(), called while the job runs): `when` it was sent
    (monotonic), the group's processes then (`pids`, found ahead), and how many seconds later the
    group was healed (`healed`)."""

    def __init__(self, run: Path, at: int, signum: int, group: int = 1, rank: int = 1) -> None:
        self.run, self.at, self.signum, self.group, self.rank = run, at, signum, group, rank
        self.when: Optional[float] = None
        self.healed: Optional[float] = None
        self.pids: dict[int, int] = {}

    def tick(self) -> None:
        if self.when is None:
            done = steps(self.run, self.group)
            if done and self.rank not in self.pids.values():  # found ahead: the signal goes out when due
                self.pids = ranks(self.run, self.group)
            if done and done[-1]["step"] >= self.at and steps(self.run, 1 - self.group) and self.pids:
                os.kill(next(pid for pid, rank in self.pids.items() if rank == self.rank), self.signum)
                self.when, self._heals = time.monotonic(), heals(self.run, self.group)
        elif self.healed is None and heals(self.run, self.group) > self._heals:
            self.healed = time.monotonic() - self.when


def watch(proc: subprocess.Popen, run: Path, fault: Optional[Fault] = None, also: Callable[[], None] = lambda: None,
          groups: tuple[int, ...] = (0,)) -> tuple[str, dict[int, str], dict[int, dict[int, int]]]:
    """Until the job ends (at most TIMEOUT seconds), every 50 ms: note the processes of `groups`, let
    `fault` strike when due, then `also()`. The job's output, each group's log, and each watched group's
    processes ever seen (pid -> rank); what is left of a job that failed the test is ended."""
    seen: dict[int, dict[int, int]] = {g: {} for g in groups}
    deadline = time.monotonic() + TIMEOUT
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"the job did not end in {TIMEOUT} s"
            for g in seen:
                seen[g].update(ranks(run, g))
            if fault is not None:
                fault.tick()
            also()
            time.sleep(0.05)
    finally:
        out = proc.stdout.read() if proc.poll() is not None else ""
        stop_session(proc)
        stop_leftovers(run)
    logs = {g: (run / f"group-{g}.log").read_text() if (run / f"group-{g}.log").exists() else "" for g in (0, 1)}
    return out, logs, seen


def validation(run: Path, group: int, step: int) -> float:
    return next(r["val_loss"] for r in steps(run, group) if r["step"] == step)
