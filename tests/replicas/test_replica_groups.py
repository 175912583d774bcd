"""Two replica groups of 2 ranks (mp 2) through launch/ft_local.sh, as a user starts them: rank 1 of
group 1 SIGKILLed from outside at step 8. Group 0 trains on alone and never restarts; group 1 is
restarted by its torchrun, healed from group 0 and trains to the end with it (issue 51)."""

from __future__ import annotations

import json
import signal
import statistics

import pytest

from tests.replicas.jobs import Fault, start, steps, watch
from tests.replicas.jobs import rows as _rows

pytestmark = pytest.mark.slow

STEPS, KILL_AT = 40, 8
HEARTBEAT = 5.0  # hybridpar lighthouse's --heartbeat-timeout: how long a silent group stays in the quorum


def test_a_killed_group_drops_out_and_rejoins_while_the_other_trains_on(corpus, tmp_path):
    run = tmp_path / "run"
    proc = start(corpus, run, STEPS, "--fault_tolerance.timeout", "15")
    kill = Fault(run, KILL_AT, signal.SIGKILL)
    out, logs, seen = watch(proc, run, kill)
    seen = seen[0]  # group 0's rank pids ever seen
    killed, healed = kill.when, kill.healed
    assert proc.returncode == 0, out + logs[0][-3000:] + logs[1][-3000:]
    assert killed is not None, logs[1][-3000:]
    # Group 0: the same two processes from start to end, every step logged once.
    assert sorted(seen.values()) == [0, 1], seen
    rows = {g: steps(run, g) for g in (0, 1)}
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
