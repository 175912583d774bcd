"""Two replica groups of 2 ranks (mp 2) through launch/ft_local.sh, as a user starts them: rank 1 of
group 1 SIGKILLed from outside at step 8. Group 0 trains on alone and never restarts; group 1 is
restarted by its torchrun, healed from group 0 and trains to the end with it (issue 51). Its records:
the summaries, the periodic checkpoints (written by group 0 alone, every group's position in each),
the replica check after the heal. Then the whole job again with the same flags and more steps, as a
normal resume, stopped by SIGTERM to its process group (a preemption): both groups stop after the same
step with one checkpoint. Over both runs every window of each group's share of the data, counted from
the loaders' record (windows.jsonl), was trained exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.common import ROOT, stop_session
from tests.replicas.jobs import TIMEOUT, start
from tests.replicas.jobs import ranks as _ranks
from tests.replicas.jobs import rows as _rows
from tests.replicas.jobs import stop_leftovers as _stop_leftovers

pytestmark = pytest.mark.slow

STEPS, KILL_AT = 40, 8
HEARTBEAT = 5.0  # hybridpar lighthouse's --heartbeat-timeout: how long a silent group stays in the quorum
EVERY = 10  # checkpoint.every: a checkpoint while group 1 is away, and after it is back
MORE, STOP_AFTER = 46, 42  # the resumed run's train.steps, and the step after which SIGTERM comes
MICRO_BATCH = 4  # the local config's data.micro_batch_size (train.grad_accum 1, dp 1 inside a group)


def _events(run: Path, group: int, kind: str) -> list[dict]:
    return [e for e in _rows(run / f"group-{group}" / "events.jsonl") if e["event"] == kind]


# Group 1's ranks, once its torchrun restarted them, wait until the file RETURN_WHEN exists (the test
# writes it when group 0 has committed a step alone): on a quiet machine a restart can be back within group
# 0's next try at the quorum (the lighthouse waits for a group that heartbeated lately), which then includes
# it and no step is committed alone; held back longer, group 1 can find group 0 done with every step.
RETURN_LATE = """
import os
cmdline = open("/proc/self/cmdline", "rb").read().split(b"\\0")
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and b"--fault_tolerance.group" in cmdline and \\
        cmdline[cmdline.index(b"--fault_tolerance.group") + 1] == b"1":
    import time
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["RETURN_WHEN"]) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _start(run: Path, corpus: dict, steps: int, **env) -> subprocess.Popen:
    return start(corpus, run, steps, "--train.eval_every", str(STEPS), "--checkpoint.every", str(EVERY),
                 "--fault_tolerance.timeout", "15", "--fault_tolerance.record_windows", "true", **env)


def _alone(changes: list[dict], before: int) -> int:
    """Steps up to `before` that group 0 committed alone, from its "groups" events."""
    edges = changes + [{"step": before + 1, "groups": None}]
    return sum(min(b["step"], before + 1) - a["step"] for a, b in zip(edges, edges[1:])
               if a["groups"] == [0] and a["step"] <= before)


def _windows(run: Path, step: int) -> list[int]:
    return json.loads((run / "checkpoints" / f"step-{step:08d}" / "train_state.json").read_text())["replicas"]["windows"]


def test_a_killed_group_drops_out_and_rejoins_while_the_other_trains_on(corpus, tmp_path):
    run = tmp_path / "run"
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(RETURN_LATE)
    go = tmp_path / "group 0 trained alone"
    proc = _start(run, corpus, STEPS, PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{ROOT}", RETURN_WHEN=go)
    seen, killed, healed = {}, None, None  # group 0's rank pids ever seen; when the kill and the heal came
    try:
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"the job did not end in {TIMEOUT} s"
            seen.update(_ranks(run, 0))
            steps = [r["step"] for r in _rows(run / "group-1" / "metrics.jsonl") if "loss" in r]
            if killed is None and steps and steps[-1] >= KILL_AT:
                victim = next(pid for pid, rank in _ranks(run, 1).items() if rank == 1)
                os.kill(victim, signal.SIGKILL)
                killed, heals = time.monotonic(), len(_events(run, 1, "healed"))
            if killed and not go.exists() and _events(run, 0, "groups"):
                go.touch()
            if killed and healed is None and len(_events(run, 1, "healed")) > heals:
                healed = time.monotonic() - killed
            time.sleep(0.05)
        out = proc.stdout.read()
    finally:
        stop_session(proc)
        _stop_leftovers(run)
    logs = {g: (run / f"group-{g}.log").read_text() for g in (0, 1)}
    assert proc.returncode == 0, out + logs[0][-3000:] + logs[1][-3000:]
    assert killed is not None, logs[1][-3000:]
    # Group 0: the same two processes from start to end, every step logged once (the first step waited
    # for group 1: neither group was healed at the start).
    assert sorted(seen.values()) == [0, 1], seen
    rows = {g: [r for r in _rows(run / f"group-{g}" / "metrics.jsonl") if "loss" in r] for g in (0, 1)}
    assert [r["step"] for r in rows[0]] == list(range(1, STEPS + 1)), _rows(run / "group-0" / "events.jsonl")
    # Its steps after the kill: one waits for the lighthouse to drop group 1, none other is slow.
    usual = statistics.median(r["step_time"] for r in rows[0][1:KILL_AT])
    slow = [r["step"] for r in rows[0][KILL_AT:] if r["step_time"] > usual + 2.0]
    print(f"\ngroup 0: usual step {usual:.2f} s; slow after the kill: "
          f"{[(r['step'], round(r['step_time'], 1)) for r in rows[0] if r['step'] in slow]}; group 1 healed "
          f"{healed:.1f} s after the kill" if healed else "")
    # Group 1: restarted by its torchrun, healed within 60 s, trained to the end.
    assert healed is not None and healed < 60, logs[1][-3000:]
    assert "rank(s) [1] died" in logs[1]  # its own watchdog named the death
    assert rows[1][-1]["step"] == STEPS and len({r["step"] for r in rows[1]}) == len(rows[1])
    # Both end on the same parameters: the same validation loss.
    val = [next(r["val_loss"] for r in rows[g] if r["step"] == STEPS) for g in (0, 1)]
    assert abs(val[0] - val[1]) <= 1e-6 * abs(val[0]), val
    # Which steps had one group: group 0's events, and every group's position in the checkpoint.
    changes = _events(run, 0, "groups")
    # (the first step without group 1 is the one it was in when killed: the kill follows its step line)
    assert [e["groups"] for e in changes] == [[0], [0, 1]] and KILL_AT < changes[0]["step"] <= KILL_AT + 3, changes
    gone, back = changes[0]["step"], changes[1]["step"]
    # (a step that saves a checkpoint takes that long too, and so does the one group 1 rejoins in: group 0
    # sends it the state)
    slow = [s for s in slow if s % EVERY and s != back]
    assert len(slow) <= 1 and max(r["step_time"] for r in rows[0][KILL_AT:]) < usual + HEARTBEAT + 10, rows[0]
    assert changes[1]["seconds_fewer"] < 60, changes
    alone = back - gone
    assert _windows(run, STEPS) == [STEPS, STEPS - alone], changes

    # The summaries. Group 0: the steps it committed alone and how long until group 1 was back.
    summary = {g: json.loads((run / f"group-{g}" / "summary.json").read_text()) for g in (0, 1)}
    assert summary[0]["replica_groups"]["fewer_groups"] == [
        {"first": gone, "last": back - 1, "groups": [0], "all_back_s": changes[1]["seconds_fewer"]}]
    assert summary[0]["replica_groups"]["steps_with_fewer_groups"] == alone and not summary[0]["replica_groups"]["heals"]
    assert (f"steps committed with fewer groups: {alone}: {gone}-{back - 1} by group 0 (all back "
            f"{changes[1]['seconds_fewer']:.1f} s after the groups became fewer)") in logs[0]
    assert "wall time" in logs[0] and f"; steps 1-{STEPS}\n" in logs[0]
    # Group 1, restarted: the steps of this start (from its heal), not 1-40, and the heal.
    heal = _events(run, 1, "healed")[-1]
    assert heal["to_step"] == back - 1, (heal, changes)
    assert (summary[1]["first_step"], summary[1]["last_step"]) == (back, STEPS), summary[1]
    assert summary[1]["replica_groups"]["heals"] == [
        {"step": heal["to_step"], "from_step": heal["from_step"], "seconds": heal["seconds"]}]
    block = logs[1][logs[1].rindex("=== run summary"):]
    assert f"; steps {back}-{STEPS}\n" in block and (
        f"healed from a live group at step {back - 1} (this start was at step {heal['from_step']})") in block, block
    line = next(x for x in logs[1].splitlines() if x.startswith(f"step {back:>5}/{STEPS}"))
    assert f"groups 2 (healed from step {heal['from_step']} in " in line, line
    # The replica check across groups after the heal, in both groups: the same parameters.
    for g in (0, 1):
        checked = [e for e in _events(run, g, "replica_check") if e["step"] == back]
        assert [(e["groups"], e["healed"], e["differ"]) for e in checked] == [([0, 1], [1], {})], checked
    # The periodic checkpoints: written by group 0 (the quorum's first) alone, each holding both positions.
    assert [e["step"] for e in _events(run, 0, "checkpoint")] == list(range(EVERY, STEPS + 1, EVERY))
    assert _events(run, 1, "checkpoint") == []
    kept = sorted(int(p.name[len("step-"):]) for p in (run / "checkpoints").glob("step-????????"))
    assert kept == list(range(STEPS - 2 * EVERY, STEPS + 1, EVERY)), kept  # checkpoint.keep = 3
    assert all(_windows(run, s) == [s, s - _alone(changes, s)] for s in kept), [(s, _windows(run, s)) for s in kept]
    not_committed = "not committed by replica group 0" in logs[0]

    # The whole job again, the same flags but more steps: each group continues at its own position.
    # SIGTERM to its process group once group 0 logged step STOP_AFTER: a preemption.
    proc = _start(run, corpus, MORE)
    try:
        deadline = time.monotonic() + TIMEOUT / 2
        while proc.poll() is None and max((r["step"] for r in _rows(run / "group-0" / "metrics.jsonl")), default=0) < STOP_AFTER:
            assert time.monotonic() < deadline, "the resumed job did not reach its step in time"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
        assert not _ranks(run, 0) and not _ranks(run, 1), "ranks still running after the script ended"
    finally:
        stop_session(proc)
        _stop_leftovers(run)
    logs = {g: (run / f"group-{g}.log").read_text() for g in (0, 1)}
    stopped = {g: re.findall(r"hybridpar: stopped on SIGTERM after step (\d+); checkpoint (\S+)\. ", logs[g])
               for g in (0, 1)}
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, (stopped, out, logs[0][-3000:], logs[1][-3000:])
    last = int(stopped[0][0][0])  # both name the checkpoint of that step, which group 0 wrote
    assert stopped[0][0][1] == str(run / "checkpoints" / f"step-{last:08d}"), stopped
    assert STOP_AFTER <= last < MORE
    assert [e["step"] for e in _events(run, 0, "resumed")] == [STEPS]
    assert [e["step"] for e in _events(run, 0, "checkpoint")][-1] == last and _events(run, 1, "checkpoint") == []
    assert _windows(run, last) == [last, last - alone]  # both groups took part in every step of this run

    # Every window of each group's share trained exactly once, from the loaders' record.
    trained, reads = _trained(run)
    expected = _shares(run, last)
    for g, windows in enumerate(_windows(run, last)):
        assert len(trained[g]) == windows * MICRO_BATCH and trained[g] == expected[g][:len(trained[g])], g
    union = trained[0] + trained[1]
    assert len(set(union)) == len(union)  # one pass over the data: every window at most once
    # A step group 0 did not commit at the kill was read again: the same windows, counted once.
    again = [s for s, r in reads[0].items() if len(r) > 1]
    assert again or not not_committed, logs[0]
    print(f"windows trained: group 0 {len(trained[0])}, group 1 {len(trained[1])}; read again by group 0: steps {again}")


def _trained(run: Path) -> tuple[dict[int, list], dict[int, dict]]:
    """Each group's windows in the steps committed with it (the last read of each such step), and its
    reads by step; a step read more than once was read alike each time."""
    lines = {g: _rows(run / f"group-{g}" / "windows.jsonl") for g in (0, 1)}
    members: dict[int, list[int]] = {}
    for g in (0, 1):
        for line in lines[g]:
            if "committed" in line:  # the groups agree on who committed each step
                assert members.setdefault(line["step"], line["committed"]) == line["committed"], line
    trained, reads = {}, {}
    for g in (0, 1):
        reads[g] = {}
        for line in lines[g]:
            if "read" in line:
                reads[g].setdefault(line["step"], []).append([tuple(p) for p in line["read"]])
        assert all(r == rs[0] for rs in reads[g].values() for r in rs), g
        trained[g] = [p for s in sorted(members) if g in members[s] for p in reads[g][s][-1]]
    return trained, reads


def _shares(run: Path, step: int) -> dict[int, list]:
    """Each group's share of the data, in order: the (source, window) pairs of the job's micro-batches
    (two readers, group g the g-th of each pair), from the order the data position follows."""
    from hybridpar.data.loader import Position, Source

    class Windows:  # a source of n windows: the order needs its size only
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    data = json.loads((run / "checkpoints" / f"step-{step:08d}" / "train_state.json").read_text())["data"]
    sources = [Source(name, s["weight"], Windows(s["windows"])) for name, s in data["sources"].items()]
    position = Position(sources, data["seed"], "repeat")
    shares: dict[int, list] = {0: [], 1: []}
    for _ in range(step):
        for i, pair in enumerate(position.group(MICRO_BATCH * 2)):
            shares[i % 2].append(pair)
    return shares
