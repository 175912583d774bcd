"""Two replica groups of 2 ranks (mp 2) through launch/ft_local.sh: rank 1 of group 1 stopped (SIGSTOP,
from outside) at step 8, a hang rather than a death. Group 0 goes on once its all-reduce with the
silent group has timed out and the lighthouse has dropped it, its watchdog never calling it hung;
group 1's own watchdog names the stopped rank with its group, ends it and exits 124, its torchrun
restarts it at once, and it rejoins healed (issue 51)."""

from __future__ import annotations

import json
import re
import signal
import statistics
import time

import pytest

from tests.replicas.jobs import Fault, ranks, start, steps, validation, watch

pytestmark = pytest.mark.slow

STEPS, STOP_AT = 60, 8  # (60: group 0, alone and so faster, must not finish before group 1 is back)
FT_TIMEOUT, TRAIN_TIMEOUT, JOIN = 10.0, 20.0, 10.0  # JOIN: hybridpar lighthouse's --join-timeout
TORCHRUN_GRACE = 30.0  # what torchrun waits for a process that ignores its SIGTERM (a stopped one) before killing it


def test_a_hung_group_is_ended_by_its_own_watchdog_and_rejoins_while_the_other_trains_on(corpus, tmp_path):
    run = tmp_path / "run"
    # RUST_LOG=info: torchft's lighthouse logs each quorum's groups (lighthouse.log), for a failure's message.
    proc = start(corpus, run, STEPS, "--fault_tolerance.timeout", f"{FT_TIMEOUT:g}",
                 "--diagnostics.train_timeout", f"{TRAIN_TIMEOUT:g}", "--diagnostics.watchdog_interval", "0.5",
                 RUST_LOG="info")
    stop, restarted = Fault(run, STOP_AT, signal.SIGSTOP), []

    def restart() -> None:
        if stop.when and not restarted and (now := ranks(run, 1)) and not set(now) & set(stop.pids):
            restarted.append(time.time())  # group 1's processes of its next start, none of the first's left
    out, logs, seen = watch(proc, run, stop, restart)
    healed, restarted = stop.healed, restarted[0] if restarted else None
    assert proc.returncode == 0, out + logs[0][-3000:] + logs[1][-3000:]
    assert stop.when is not None and restarted is not None, logs[1][-3000:]
    # Group 1's watchdog: the stopped rank named with its group and node, ended, the group's exit 124.
    verdict = json.loads((run / "group-1" / "hang_report.json").read_text())
    assert verdict["group"] == 1 and verdict["node_fault"]["ranks"] == [1], verdict
    assert "hybridpar watchdog of replica group 1 at step" in logs[1], logs[1][-3000:]
    assert "rank(s) [1] are stopped (SIGSTOP, a debugger)" in logs[1] and "rank 1: group 1, mp 1, dp 0" in logs[1]
    assert "was stopped and cannot exit by itself: killed" in logs[1] and "the ranks exit with code 124" in logs[1]
    assert re.search(r"failed \(exitcode: (124|-9)\) local_rank", logs[1])  # torchrun's word (the first to end)
    # ... so that its torchrun restarted it at once, not after its grace for the stopped process.
    print(f"\ngroup 1: verdict {verdict['quiet_s']:.1f} s after its rank stopped beating, new processes "
          f"{restarted - verdict['time']:.1f} s after the verdict, healed {healed and round(healed, 1)} s after the stop")
    assert restarted - verdict["time"] < TORCHRUN_GRACE - 10, (restarted, verdict["time"])
    # Group 0: the same processes throughout, never called hung, every step logged once.
    assert sorted(seen[0].values()) == [0, 1], seen
    assert not (run / "group-0" / "hang_report.json").exists() and "hybridpar watchdog" not in logs[0], logs[0][-3000:]
    rows = {g: steps(run, g) for g in (0, 1)}
    assert [r["step"] for r in steps(run, 0)] == list(range(1, STEPS + 1)), rows[0]
    # Its slowest step: the all-reduce's wait for the silent group, then the quorum's for the lighthouse.
    usual = statistics.median(r["step_time"] for r in rows[0] if 1 < r["step"] <= STOP_AT)
    worst = max(r["step_time"] for r in rows[0] if r["step"] > STOP_AT)
    print(f"group 0: usual step {usual:.2f} s, slowest after the stop {worst:.1f} s")
    assert worst < usual + FT_TIMEOUT + JOIN + 10, rows[0]
    # Group 1: rejoined healed within 60 s, trained to the end; both hold the same parameters.
    assert healed is not None and healed < 60, logs[1][-3000:] + (run / "lighthouse.log").read_text()[-6000:]
    assert rows[1][-1]["step"] == STEPS and len({r["step"] for r in rows[1]}) == len(rows[1])
    val = [validation(run, g, STEPS) for g in (0, 1)]
    assert abs(val[0] - val[1]) <= 1e-6 * abs(val[0]), val
