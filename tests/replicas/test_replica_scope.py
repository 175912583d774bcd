"""The honest scope of fault-tolerant replica groups, through launch/ft_local.sh (two groups of mp 2),
each case as docs/training.md's Fault tolerance section says it (issue 51): fewer live groups than
fault_tolerance.min_groups commit nothing and wait until enough are back; a dead lighthouse stops
every group's quorum until one is started again at its address, and no group is called hung
meanwhile; a group that cannot come back leaves the others training on without it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.launch.common import ROOT, script_env, stop_session
from tests.distributed import free_port
from tests.replicas.jobs import Fault, rows, start, steps, validation, watch

pytestmark = pytest.mark.slow


def _groups_events(run, group: int) -> list[dict]:
    return [e for e in rows(run / f"group-{group}" / "events.jsonl") if e["event"] == "groups"]


def _windows(run, step: int) -> list[int]:
    return json.loads((run / "checkpoints" / f"step-{step:08d}" / "train_state.json").read_text())["replicas"]["windows"]


def test_fewer_groups_than_min_groups_commit_nothing_and_wait_until_enough_are_back(corpus, tmp_path):
    """min_groups 2, rank 1 of group 1 killed at step 6: group 0 does not train alone, says why it waits,
    and goes on when group 1, restarted by its torchrun, is back; every step was committed by both."""
    steps_, at = 20, 6
    run = tmp_path / "run"
    proc = start(corpus, run, steps_, "--fault_tolerance.timeout", "10", "--fault_tolerance.min_groups", "2")
    kill = Fault(run, at, signal.SIGKILL)
    out, logs, seen = watch(proc, run, kill)
    assert proc.returncode == 0 and kill.when is not None, out + logs[0][-3000:] + logs[1][-3000:]
    assert sorted(seen[0].values()) == [0, 1], seen  # group 0 waited, it did not fail
    assert [r["step"] for r in steps(run, 0)] == list(range(1, steps_ + 1))
    waits = [line for line in logs[0].splitlines() if line.startswith("hybridpar: replica group 0 waits for the quorum")]
    after = [line for line in waits if int(line.split("before step ")[1].split(":")[0]) > at]
    # Group 1 restarted and back within group 0's first try at the quorum (a quiet machine: torchrun's restart
    # and the heal in seconds) leaves nothing to wait for: the line is checked where group 0 did wait.
    assert all(line.endswith(": 1 group(s) in it, fewer than fault_tolerance.min_groups = 2; it trains on when the "
                             "quorum forms") for line in after), waits
    if after:
        assert "hybridpar: replica group 0 is in a quorum of 2 group(s) after waiting" in logs[0]
    assert logs[0].count("not committed by replica group 0") <= 1, logs[0][-3000:]  # the step the kill broke, once
    # No step committed by one group: every group took part in every step.
    assert all(e["groups"] == [0, 1] for e in _groups_events(run, 0)), _groups_events(run, 0)
    assert _windows(run, steps_) == [steps_, steps_]
    val = [validation(run, g, steps_) for g in (0, 1)]
    assert abs(val[0] - val[1]) <= 1e-6 * abs(val[0]), val


def test_a_dead_lighthouse_holds_every_group_until_one_is_started_at_its_address(corpus, tmp_path):
    """The lighthouse SIGKILLed at step 4 and started again 30 s later at the same port: both groups
    wait for the quorum, say so, and their watchdogs say they have waited longer than train_timeout
    without calling it a hang; then both train to the end, never restarted."""
    steps_, at, outage, train_timeout = 16, 4, 30.0, 20
    run, port = tmp_path / "run", free_port()
    proc = start(corpus, run, steps_, "--fault_tolerance.timeout", "5", "--diagnostics.train_timeout",
                 str(train_timeout), port=port)
    address = f"http://localhost:{port}"
    killed, again = [], []  # when the lighthouse was killed; the one the test started

    def lighthouse() -> None:
        done = steps(run, 0)
        if not killed and done and done[-1]["step"] >= at:
            found = subprocess.run(["pgrep", "-f", f"hybridpar lighthouse --port {port} "], capture_output=True,
                                   text=True).stdout.split()
            assert len(found) == 1, found
            subprocess.run(["kill", "-KILL", found[0]], check=True)
            killed.append(time.monotonic())
        if killed and not again and time.monotonic() - killed[0] > outage:
            again.append(subprocess.Popen([sys.executable, "-m", "hybridpar", "lighthouse", "--port", str(port)],
                                          cwd=ROOT, env=script_env(), start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        out, logs, seen = watch(proc, run, also=lighthouse, groups=(0, 1))
    finally:
        for started in again:
            stop_session(started)
    assert proc.returncode == 0 and again, out + logs[0][-3000:] + logs[1][-3000:]
    why = f"the lighthouse at {address} does not answer: Connection refused"
    for g in (0, 1):
        assert sorted(seen[g].values()) == [0, 1], (g, seen[g])  # never restarted
        assert not (run / f"group-{g}" / "hang_report.json").exists(), logs[g][-3000:]
        waits = [line for line in logs[g].splitlines() if f"replica group {g} waits for the quorum before step" in line
                 and why in line]
        assert waits and waits[0].endswith(f": {why}; it trains on when the quorum forms"), logs[g][-3000:]
        step = int(waits[0].split("before step ")[1].split(":")[0])  # the first after the kill (and the step in flight)
        assert step > at, waits
        # (said again if torchft's first reconfigurations after the new lighthouse fail and its quorum waits again)
        said = [line for line in logs[g].splitlines() if "every rank has waited" in line]
        assert said and said[0].startswith(f"hybridpar watchdog of replica group {g}: every rank has waited "), said
        assert said[0].endswith(f"for the quorum of the replica groups before step {step} ({why}), longer than the "
                                f"watchdog's no-progress limit ({train_timeout} s): not a hang; training goes on when "
                                "the wait ends"), said
        assert f"hybridpar: replica group {g} is in a quorum of" in logs[g]
    assert [r["step"] for r in steps(run, 0)] == list(range(1, steps_ + 1)), steps(run, 0)
    # Group 1 may be left out of the first quorum of the new lighthouse: then it is healed, and ends alike.
    assert steps(run, 1)[-1]["step"] == steps_
    val = [validation(run, g, steps_) for g in (0, 1)]
    assert abs(val[0] - val[1]) <= 1e-6 * abs(val[0]), val


def test_a_group_that_cannot_come_back_leaves_the_others_training(corpus, tmp_path):
    """No restart left (RESTARTS=0): group 1's torchrun gives up after its rank is killed; group 0
    trains every step to the end alone, and the script says which group failed."""
    steps_, at = 12, 4
    run = tmp_path / "run"
    proc = start(corpus, run, steps_, "--fault_tolerance.timeout", "10", RESTARTS="0")
    kill = Fault(run, at, signal.SIGKILL)
    out, logs, _ = watch(proc, run, kill)
    assert proc.returncode == 1 and kill.when is not None, out + logs[0][-3000:]
    assert f"launch/ft_local.sh: group 1 failed (exit 1): see {run}/group-1.log" in out, out
    assert [r["step"] for r in steps(run, 0)] == list(range(1, steps_ + 1)), steps(run, 0)
    changes = _groups_events(run, 0)
    assert changes[-1]["groups"] == [0] and changes[-1]["step"] <= at + 2, changes  # and never back
    assert _windows(run, steps_)[0] == steps_
