"""The hang watchdog and `hybridpar hang-report`: planted faults in real training jobs, and the
analysis on hand-made traces."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from hybridpar.diagnostics import flight, watchdog
from hybridpar.diagnostics.flight import analyse, format_report
from hybridpar.diagnostics.liveness import process_stopped
from hybridpar.diagnostics.traces import Collective, GroupTrace, RankTrace, trace_from_dump
from hybridpar.mesh.layout import MeshCoords
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
TRAIN_TIMEOUT = 4.0
REPORT_WITHIN = TRAIN_TIMEOUT + 15.0  # the bound: train timeout + 15 s


# --- the analysis on hand-made traces ----------------------------------------------------------

def _trace(rank, groups, stack=("train.py:10 in step",), note=""):
    """groups: {name: (dim, ranks, [(seq, op, order)], completed)}"""
    out = {}
    for name, (dim, ranks, calls, completed) in groups.items():
        recent = [Collective(seq, op, [[4]], order) for seq, op, order in calls]
        out[name] = GroupTrace(name, dim, ranks, recent[-1].seq if recent else 0, completed, recent)
    return RankTrace(rank=rank, host="h", coords=f"r{rank}", stack=list(stack), groups=out, note=note)


def test_a_rank_outside_any_collective_is_named_with_its_line():
    traces = {
        0: _trace(0, {"mp": ("mp", [0, 1], [(1, "all_reduce", 1), (2, "all_reduce", 2)], 1)}),
        1: _trace(1, {"mp": ("mp", [0, 1], [(1, "all_reduce", 1)], 1)}, stack=("train.py:99 in slow_io",)),
    }
    verdict = analyse(traces)
    (finding,) = verdict.findings
    assert (finding.kind, finding.ranks, finding.dim, finding.op, finding.seq) == ("not_arrived", [1], "mp", "all_reduce", 2)
    assert "train.py:99 in slow_io" in finding.text
    assert "CAUSE  rank 1 has not joined all_reduce #2" in format_report(verdict, "headline")


@pytest.mark.parametrize("note", ["", "raised RuntimeError: Connection closed by peer"])
def test_a_skipped_collective_is_told_from_its_victims_by_the_healthy_order(note):
    # dp then world is the program's order (ranks 1 and 3 did both). Rank 2 skipped dp #5 and waits
    # in world #9; rank 0 waits in dp #5 for rank 2 and has not reached world #9: a victim. When the
    # job is torn down, rank 2's wait may end in an error (`note`): it still skipped dp #5 first.
    dp02, dp13 = ("dp", [0, 2]), ("dp", [1, 3])
    world = ("world", [0, 1, 2, 3])
    traces = {
        0: _trace(0, {"dpA": (*dp02, [(5, "all_reduce", 10)], 4), "w": (*world, [(8, "all_reduce", 9)], 8)}),
        1: _trace(1, {"dpB": (*dp13, [(5, "all_reduce", 10)], 5), "w": (*world, [(8, "all_reduce", 9), (9, "all_reduce", 11)], 8)}),
        2: _trace(2, {"dpA": (*dp02, [(4, "all_reduce", 8)], 4), "w": (*world, [(8, "all_reduce", 9), (9, "all_reduce", 11)], 8)},
                  note=note),
        3: _trace(3, {"dpB": (*dp13, [(5, "all_reduce", 10)], 5), "w": (*world, [(8, "all_reduce", 9), (9, "all_reduce", 11)], 8)}),
    }
    verdict = analyse(traces)
    assert verdict.culprits == [2]
    assert (verdict.findings[0].kind, verdict.findings[0].dim, verdict.findings[0].seq) == ("skipped", "dp", 5)


def test_a_shape_mismatch_names_the_odd_rank_even_in_a_group_of_two():
    # Two ranks cannot outvote each other: the other mp groups' call at the same number decides.
    def mp(rank, sizes):
        t = _trace(rank, {f"mp{rank // 2}": ("mp", [rank // 2 * 2, rank // 2 * 2 + 1], [(3, "all_reduce", 3)], 2)})
        t.groups[f"mp{rank // 2}"].recent[0].sizes = sizes
        return t

    traces = {0: mp(0, [[4]]), 1: mp(1, [[4]]), 2: mp(2, [[4]]), 3: mp(3, [[7]])}
    finding = analyse(traces).findings[0]
    assert (finding.kind, finding.ranks, finding.dim, finding.seq) == ("mismatch", [3], "mp", 3)
    assert "7" in finding.text


def test_a_dead_rank_is_named_with_the_collective_its_peers_wait_in():
    traces = {0: _trace(0, {"mp": ("mp", [0, 1], [(6, "all_reduce", 6), (7, "all_reduce", 7)], 6)})}
    verdict = analyse(traces, dead=[1], last_issued={1: {"mp": 6}})
    (finding,) = verdict.findings
    assert (finding.kind, finding.ranks, finding.dim, finding.op, finding.seq) == ("dead", [1], "mp", "all_reduce", 7)
    assert re.search(r"^  rank    1  +gone$", format_report(verdict, "headline"), re.M)  # coordinates unknown: blank


def test_a_ranks_own_error_is_the_cause_and_its_peers_losses_follow():
    from hybridpar.diagnostics.flight import Finding, Verdict

    lost = Finding("failed", [1], "mp", [0, 1], "all_to_all", 28,
                   "rank 1 raised RuntimeError: Connection closed by peer [127.0.0.1]:38323 in all_to_all #28")
    own = Finding("failed", [0], "", [], "", 0, "rank 0 raised ValueError: planted (job.py:31 in write)")
    report = format_report(Verdict([lost, own], [], {}, []), "headline").splitlines()
    print("\n" + "\n".join(report))
    assert report[1].startswith("CAUSE  rank 0 raised ValueError: planted")
    assert report[2].startswith("THEN   rank 1 raised RuntimeError: Connection closed by peer")
    alone = format_report(Verdict([lost], [], {}, []), "headline").splitlines()  # all that is known
    assert alone[1].startswith("CAUSE  rank 1 raised RuntimeError: Connection closed")


def test_rooted_calls_are_not_mismatches():
    """scatter and gather: only the root passes a list, so their sizes differ by design."""
    def rank(r, sizes):
        t = _trace(r, {"w": ("world", [0, 1, 2], [(4, "scatter", 4)], 3)})
        t.groups["w"].recent[0].sizes = sizes
        return t

    assert [f.kind for f in analyse({0: rank(0, [[4, 9]]), 1: rank(1, []), 2: rank(2, [])}).findings] == []
    other = {0: rank(0, [[4]]), 1: rank(1, [[4]]), 2: rank(2, [[4]])}
    other[2].groups["w"].recent[0].op = "all_reduce"  # a different op at the same number still is one
    assert [f.kind for f in analyse(other).findings] == ["mismatch"]


@pytest.mark.parametrize("message,lost", [
    ("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:33191: Connection reset by peer", True),
    ("Connection closed by peer [127.0.0.1]:57010. This is typically caused by a remote worker crashing", True),
    ("NCCL communicator was aborted on rank 3", True),
    ("the data guard found identical batches", False),
    ("CUDA out of memory", False),
])
def test_a_peers_loss_is_told_from_a_ranks_own_error(message, lost):
    from hybridpar.diagnostics.liveness import is_peer_loss

    assert is_peer_loss(RuntimeError(message)) is lost
    assert is_peer_loss(dist.DistNetworkError("anything")) is True


def test_process_alive_tells_running_exited_and_zombie_processes():
    from hybridpar.diagnostics.liveness import process_alive

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # wait for its exit, leaving it unreaped
    try:
        assert process_alive(running.pid) and process_alive(os.getpid())
        assert not process_alive(reaped.pid)
        assert zombie.returncode is None and not process_alive(zombie.pid)  # exited, not yet reaped
    finally:
        running.kill()
        running.wait()
        zombie.wait()


def test_reading_a_dump_leaves_the_callers_groups_alone():
    info = {"rank": 0, "groups": {"0": {"dim": "world", "ranks": [0, 1]}}}
    entry = {"process_group": ("1", "mesh_mp"), "pg_id": 1, "collective_seq_id": 1, "record_id": 0,
             "profiling_name": "gloo:all_reduce", "input_sizes": [[4]]}
    trace = trace_from_dump({"entries": [entry]}, info)
    assert trace.groups["1"].dim == "mp"
    assert info["groups"] == {"0": {"dim": "world", "ranks": [0, 1]}}


# --- the watchdog's own logic, in this process: an in-memory store and a clock the test moves ---


class _Clock:
    """Stands in for the watchdog module's `time`; sleeping moves it on."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _watchdog(tmp_path, rank=0, world=2, timeout=60.0, interval=1.0) -> watchdog.Watchdog:
    """An unstarted watchdog without a process group (no mesh groups); exit codes go to `.exits`.
    timeout 60 s, interval 1 s: a heartbeat silent for 10 s means the process is gone."""
    sizes = (1, 1, world, 1, 1)  # (pp, dp_replicate, dp_shard, cp, mp), as ParallelDims.sizes
    parallel = SimpleNamespace(rank=rank, world_size=world, coords=MeshCoords.of(rank, *sizes), sizes=sizes, cp=1,
                               mp_group=None, cp_group=None, dp_shard_group=None, dp_replicate_group=None,
                               dp_group=None, dp_cp_group=None, pp=1, pp_group=None, ep=1, ep_group=None)
    exits = []
    wd = watchdog.Watchdog(parallel, timeout=timeout, run_dir=tmp_path, trace_dir=tmp_path, interval=interval,
                           exit_fn=exits.append)
    wd.exits = exits
    wd.beat.store = dist.HashStore()
    wd.beat.info = {"host": "h", "pid": 1, "coords": f"r{rank}", "groups": {}}
    return wd


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(watchdog, "time", clock)
    return clock


def test_a_rank_still_setting_up_gets_the_whole_timeout(tmp_path, clock):
    wd = _watchdog(tmp_path)
    wd.beat.publish()
    assert wd.monitor.check() is None
    clock.now += 30  # rank 1 still loads a checkpoint: no heartbeat yet, long past the 10 s of a death
    wd.beat.publish()
    assert wd.monitor.check() is None
    clock.now += 31
    wd.beat.publish()
    assert wd.monitor.check().startswith("rank(s) [1] have not started their watchdog within 60 s (not reached training")
    assert wd.monitor.dead == [1]


def test_rank_1_does_not_wait_for_rank_0s_first_beat(tmp_path):
    wd = _watchdog(tmp_path, rank=1)
    wd.beat.store.set_timeout(timedelta(seconds=1))  # a blocking get would raise after this
    assert wd.monitor.rank0_gone() is False


def test_a_neighbours_death_is_named_at_once_with_its_place(tmp_path, clock):
    """Rank 1's process is gone: rank 0, on the same host, sees it on its next look; the verdict
    names it with its coordinates and last step, without waiting for its heartbeat to go stale."""
    wd = _watchdog(tmp_path, world=3)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for r, pid in ((0, os.getpid()), (1, gone.pid), (2, alive.pid)):
            wd.beat.store.set(wd.beat.who_key(r), json.dumps({"host": "h", "pid": pid}))
        for r in (1, 2):
            wd.beat.put(f"beat/{r}", json.dumps({"beat": 1, "step": 5, "phase": "optimizer", "seqs": {},
                                             "state": "running", "timeout": 60.0, "note": ""}))
        wd.beat.publish()
        wd.beat.look_at_neighbours()
        assert wd.monitor.check() == "rank(s) [1] died (the process is gone: it exited, was killed or crashed)"
        assert wd.monitor.dead == [1]
        assert wd.monitor._gone_info([1])[1] == {"coords": "mp 0, dp 1 (replicate 0, shard 1)", "step": 5,
                                         "phase": "optimizer", "host": "h", "pid": gone.pid}
    finally:
        alive.kill()
        alive.wait()


def test_a_dead_rank_of_a_pipeline_is_placed_by_its_stage(tmp_path):
    """pp 2 x mp 2: the death report places the gone rank 3 on stage 1, and its peer's wait in a
    receive from it names both stages."""
    from hybridpar.diagnostics.traces import P2P

    wd = _watchdog(tmp_path, world=4)
    wd.beat.parallel.sizes = (2, 1, 1, 1, 2)
    gone = wd.monitor._gone_info([3])
    assert gone[3]["coords"] == "pp 1, mp 1, dp 0 (replicate 0, shard 0)"
    recv = P2P("recv", 3, "9", "pp", [1, 3], 4, [[2, 8]])
    verdict = analyse({1: RankTrace(1, coords="pp 0, mp 1, dp 0 (replicate 0, shard 0)", p2p=[recv])}, dead=[3])
    verdict.gone = gone
    report = format_report(verdict, "headline")
    assert "CAUSE  rank 3 (stage 1) is gone: rank 1 (stage 0) waits in recv #4 from rank 3 (stage 1) on the pp " \
           "group [1, 3]" in report, report
    assert "       rank 3: pp 1, mp 1, dp 0 (replicate 0, shard 0) on ?" in report, report


def _put_beat(wd, beat: int, step: int, *, phase: str = "forward", state: str = "running", note: str = "") -> None:
    """Rank 1's heartbeat as its own watchdog would publish it (timeout 60 s, no collectives issued)."""
    wd.beat.put("beat/1", json.dumps({"beat": beat, "step": step, "phase": phase, "seqs": {}, "state": state,
                                      "timeout": 60.0, "note": note}))


def test_a_rank_that_raised_and_exited_is_reported_as_failed_not_gone(tmp_path, clock):
    wd = _watchdog(tmp_path)
    note = "raised RuntimeError: boom"
    _put_beat(wd, 7, 3, state="failed", note=note)
    wd.beat.put("trace/1", json.dumps(dataclasses.asdict(_trace(1, {}, note=note))))
    wd.beat.publish()
    assert wd.monitor.check() is None
    clock.now += 20  # rank 1 published its error and trace, then exited: its heartbeat stopped
    wd.beat.publish()
    reason = wd.monitor.check()
    assert reason == f"rank(s) [1] failed: rank 1 {note}"
    wd.monitor.report(reason)
    report = json.loads((tmp_path / "hang_report.json").read_text())
    assert wd.exits == [watchdog.HANG_EXIT_CODE]
    assert report["dead"] == [] and report["ranks"]["1"]["note"] == note
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("failed", [1])]


@pytest.mark.parametrize("others", ["lost_peer", "stopping"])
def test_a_failure_the_others_already_know_is_reported_at_once(tmp_path, clock, others):
    """Rank 1 raised; rank 2's collective lost it, or the launcher's teardown signal reached rank 2
    (a stop that cannot complete without rank 1): the verdict comes now, not after rank 1's
    heartbeat has gone stale or the stop's deadline has run out."""
    wd = _watchdog(tmp_path, world=3)
    note = "raised ValueError: planted"
    _put_beat(wd, 7, 3, state="failed", note=note)
    wd.beat.put("beat/2", json.dumps({"beat": 7, "step": 3, "phase": "forward", "seqs": {}, "state": "running",
                                  "timeout": 60.0, "note": ""}))
    wd.beat.publish()
    assert wd.monitor.check() is None  # rank 2 may yet raise the same error itself
    wd.beat.put("beat/2", json.dumps({"beat": 8, "step": 3, "phase": "forward", "seqs": {}, "state": others,
                                  "timeout": 60.0, "note": ""}))
    wd.beat.publish()
    assert wd.monitor.check() == f"rank(s) [1] failed: rank 1 {note}"


def test_a_stop_signal_does_not_hide_a_lost_peer(tmp_path):
    wd = _watchdog(tmp_path)
    wd.beat.state = "lost_peer"
    wd.stop_requested("SIGTERM")
    assert wd.beat.state == "lost_peer"


def test_a_stop_on_request_is_neither_a_teardown_nor_a_death(tmp_path, clock):
    """Rank 1 got SIGTERM and is saving ('stopping'), then ran out of time and left ('stopped'):
    nothing to report; had its process vanished without saying so, that would be a death."""
    wd = _watchdog(tmp_path)

    def beat(n, state):
        _put_beat(wd, n, 3, phase="checkpoint", state=state, note="stopping on SIGTERM")
        wd.beat.publish()

    beat(1, "stopping")
    assert wd.monitor.check() is None
    clock.now += 5
    beat(2, "stopped")
    assert wd.monitor.check() is None
    clock.now += 30  # its heartbeat has been silent for 30 s: it left on purpose
    wd.beat.publish()
    assert wd.monitor.check() is None and wd.monitor.dead == []
    beat(3, "stopping")  # the same silence without the goodbye is a death
    assert wd.monitor.check() is None
    clock.now += 30
    wd.beat.publish()
    assert wd.monitor.check() == "rank(s) [1] stopped sending heartbeats (process gone)"


def test_a_stopped_neighbour_is_a_stall_and_its_node_is_named(tmp_path, clock):
    """A rank on this host whose process is stopped (SIGSTOP: alive, not progressing) is judged by
    its silent heartbeat like a rank elsewhere; the verdict names its node for the launcher."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wd = _watchdog(tmp_path)
        wd.beat.neighbours, wd.beat.nodes = {1: child.pid}, {0: "n1", 1: "n2"}
        _put_beat(wd, 1, 6)
        wd.beat.publish()
        assert wd.monitor.check() is None
        clock.now += 30
        wd.beat.publish()
        assert wd.monitor.check() is None  # alive and running on this host: a long C call, not a death
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        reason = wd.monitor.check()
        assert reason == "rank(s) [1] are stopped (SIGSTOP, a debugger): alive, their heartbeat silent"
        wd.monitor.report(reason)
    finally:
        child.kill()
        child.wait()
    report = json.loads((tmp_path / "hang_report.json").read_text())
    assert report["node_fault"] == {"kind": "stall", "nodes": ["n2"], "ranks": [1]}
    assert report["step"] == 6 and report["quiet_s"] == pytest.approx(30.0) and report["attempt"] == 0


def test_a_stalled_rank_holding_hot_experts_is_said_so_in_the_verdict(tmp_path, clock):
    """Issue 52: the hang report names an ep rank whose experts are hot (the trainer's expert balance
    tells the monitor which rank holds them); a rank that holds none gets no such line."""
    hot = "ep rank 1 (experts 2-3) got 100% of layer 1's routed tokens (an even share: 50%): its experts are hot, " \
          "not its node slow"
    for holder, said in ((1, True), (0, False)):
        run = tmp_path / str(holder)
        run.mkdir()
        wd = _watchdog(run)
        wd.monitor.hot = lambda rank, holder=holder: hot if rank == holder else None
        _put_beat(wd, 1, 6)
        wd.beat.publish()
        assert wd.monitor.check() is None
        clock.now += 61
        wd.beat.publish()
        reason = wd.monitor.check()
        assert reason is not None and "[1]" in reason, reason
        wd.monitor.report(reason)
        report = json.loads((run / "hang_report.json").read_text())
        assert (report.get("hot_experts") == hot) is said, report
        assert report.get("hot_experts") is None or said


def test_a_failing_analysis_still_writes_a_report_and_stops_the_job(tmp_path, clock, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug in the analysis")

    monkeypatch.setattr(flight, "analyse", broken)
    wd = _watchdog(tmp_path, world=1)
    wd.monitor.report("no progress on any rank for 61.0 s (timeout 60 s)")
    report = json.loads((tmp_path / "hang_report.json").read_text())
    assert report["reason"] == "no progress on any rank for 61.0 s (timeout 60 s)"
    assert "ValueError: a bug in the analysis" in report["analysis_error"]
    assert wd.beat.has("verdict") and wd.beat.has("abort") and wd.exits == [watchdog.HANG_EXIT_CODE]


def test_close_wakes_the_thread_without_waiting_for_its_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", dist.HashStore)
    wd = _watchdog(tmp_path, world=1, timeout=600.0, interval=30.0).start()
    time.sleep(0.2)  # the thread is now in its 30 s select()
    began = time.monotonic()
    wd.close()
    assert time.monotonic() - began < 2.0
    assert wd.exits == []  # the wake-up is not taken for SIGTERM


def test_a_step_begun_is_published_at_once_whatever_the_interval(tmp_path, monkeypatch):
    """A rank killed in step N must be last seen in step N: its beat at the interval's end (5 s by
    default, tens of steps) named an older step (issue 48: killed in step 45, "last seen in step 22")."""
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", dist.HashStore)
    wd = _watchdog(tmp_path, world=1, timeout=600.0, interval=30.0).start()

    def last_seen() -> int:
        return json.loads(wd.beat.store.get(wd.beat.key("beat/0")))["step"]

    try:
        for step in (1, 2, 3):
            wd.step, wd.phase = step, "data"
            deadline = time.monotonic() + 3
            while last_seen() != step and time.monotonic() < deadline:
                time.sleep(0.01)
            assert last_seen() == step
        began = time.monotonic()
        wd.close()  # a round is still woken at once
        assert time.monotonic() - began < 2.0
    finally:
        wd.close()


def test_a_verdict_given_while_paused_between_set_up_and_run_is_obeyed(tmp_path):
    """One watchdog watches set-up and run with the same keys: a verdict another rank's monitor gives
    while this rank is between the two reaches it once it watches on (two watchdogs once missed it)."""
    wd = _watchdog(tmp_path, world=2, rank=1, interval=0.05).start()
    key = wd.beat.key("abort")
    wd.pause()
    assert wd.paused and wd._thread is None and wd.exits == []
    assert json.loads(wd.beat.store.get(wd.beat.key("beat/1")))["state"] == "paused"  # not watched meanwhile
    wd.beat.put("abort", "1")  # rank 0's verdict
    wd.start()
    deadline = time.monotonic() + 5
    while not wd.exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wd.beat.key("abort") == key and wd.exits == [watchdog.HANG_EXIT_CODE]
    wd.close()


# --- planted faults in real jobs ---------------------------------------------------------------

FAULTS = {
    # case: (fault, world, faulty rank, expected kind, dim, op)
    "sleep_mp": ("sleep_mp", 4, 3, "not_arrived", "mp", "all_reduce"),
    # mp2 x dp2: the next call on the dp group (FSDP's all-gather) meets the skipped all-reduce
    "skip_dp": ("skip_dp", 4, 2, "mismatch", "dp", "all_reduce"),
    "exit": ("exit", 4, 3, "dead", "mp", "all_reduce"),
    "shape": ("shape", 4, 1, "mismatch", "dp", "all_reduce"),
    # mp2 x hybrid 2x2: FSDP gathers on dp_shard, so the skipped dp call stays pending behind it
    "skip_dp_world8": ("skip_dp", 8, 5, "skipped", "dp", "all_reduce"),
    # cp 2 x mp 2: the stalled rank is placed by its cp coordinate too
    "sleep_mp_cp2": ("sleep_mp", 4, 3, "not_arrived", "mp", "all_reduce"),
}
# case: (its layout's flags, where the report places the faulty rank)
FAULT_LAYOUTS = {"sleep_mp_cp2": ({"parallel.dp_shard": 1, "parallel.cp": 2}, "mp 1, cp 1, dp 0 (replicate 0, shard 0)")}
FAULT_STEP = 3

# A rank's process ends abruptly: case -> (fault, world, rank). The job must say which, within the bound.
DEATHS = {
    "exit_optimizer": ("exit_optimizer", 4, 1),
    "kill_forward": ("kill_forward", 4, 2),
    "kill_save": ("kill_save", 4, 3),
    "kill_setup": ("kill_setup", 4, 2),  # while the data is set up, before any step
    # At world 8 (hybrid 2x2 x mp 2) one death: the one that must also keep the last checkpoint.
    "kill_save_world8": ("kill_save", 8, 6),
}


def _flags(corpus, run_dir: Path, world: int) -> dict:
    return {
        "model.preset": "debug", "model.vocab_size": 512, "parallel.mp": 2, "parallel.dp_shard": 2,
        "parallel.dp_replicate": world // 4, "fsdp.sharding_strategy": "full_shard" if world == 4 else "hybrid_shard",
        "fsdp.param_dtype": "float32",
        "data.source": corpus["source"], "data.cache_dir": corpus["cache_dir"], "data.tokenizer_vocab_size": 512,
        "data.seq_len": 32, "data.micro_batch_size": 8 // world, "train.steps": 6, "train.log_every": 1,
        "train.peak_flops": 1e12, "output.run_dir": str(run_dir), "output.tensorboard": False,
        "output.plot": False, "checkpoint.at_end": False,
        "diagnostics.train_timeout": TRAIN_TIMEOUT, "diagnostics.watchdog_interval": 0.25,
    }


def _run_fault(corpus, tmp_path: Path, fault: str, rank: int, world: int = 4,
               **flags) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "tests" / "diagnostics" / "fault_job.py"), fault, str(rank), str(FAULT_STEP),
           json.dumps({**_flags(corpus, tmp_path / "run", world), **flags})]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    fired = re.search(r"FAULT \S+ on rank \d+ at ([\d.]+)", result.stderr)
    assert fired, f"the fault never fired:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result, float(fired.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FAULTS))
def test_planted_fault_is_reported_naming_rank_group_and_collective(corpus, tmp_path, case):
    fault, world, rank, kind, dim, op = FAULTS[case]
    flags, where = FAULT_LAYOUTS.get(case, ({}, None))
    result, fired_at = _run_fault(corpus, tmp_path, fault, rank, world, **flags)
    report_path = tmp_path / "run" / "hang_report.json"
    assert result.returncode != 0, "the job must exit non-zero"
    assert report_path.exists(), f"no report:\n{result.stderr[-4000:]}"
    delay = report_path.stat().st_mtime - fired_at
    report = json.loads(report_path.read_text())
    first = report["findings"][0]
    text = result.stderr[result.stderr.index("hybridpar watchdog"):]
    print(f"\n{case}: report {delay:.1f} s after the fault (bound {REPORT_WITHIN:g} s)\n"
          + "\n".join(text.splitlines()[:6]))
    assert delay <= REPORT_WITHIN
    assert (first["kind"], first["ranks"], first["dim"], first["op"]) == (kind, [rank], dim, op), first
    assert report["step"] == FAULT_STEP
    assert f"rank {rank}" in text.splitlines()[1]
    assert where is None or f"rank {rank}: {where} on " in text, text

    # The same verdict offline, from the dumps every rank left in the run folder.
    from hybridpar.cli import main

    offline = tmp_path / "offline.json"
    assert main(["hang-report", str(tmp_path / "run" / "flight_recorder"), "--json", str(offline)]) == 0
    again = json.loads(offline.read_text())["findings"][0]
    assert (again["kind"], again["ranks"], again["dim"], again["op"], again["seq"]) == \
        (first["kind"], first["ranks"], first["dim"], first["op"], first["seq"])


# A rank of a pipeline's stage 1 stops inside its step (sleep_stage: in its stage's forward): case ->
# (its layout's flags, world, the stalled rank, where the report places it).
PIPELINE_STALLS = {
    "pp2-1F1B": ({"parallel.pp": 2, "parallel.mp": 1, "parallel.dp_shard": 1, "parallel.dp_replicate": 1,
                  "fsdp.sharding_strategy": "full_shard", "parallel.pp_schedule": "1F1B", "parallel.pp_microbatches": 2},
                 2, 1, "pp 1, mp 0, dp 0 (replicate 0, shard 0)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PIPELINE_STALLS))
def test_a_stalled_stage_is_named_with_its_stage_and_the_op_its_peer_waits_in(corpus, tmp_path, case):
    """The issue's must-show: within train_timeout + 15 s the report names the stalled rank, its stage
    and the send or receive its peer stage waits in."""
    flags, world, rank, where = PIPELINE_STALLS[case]
    result, fired_at = _run_fault(corpus, tmp_path, "sleep_stage", rank, world, **flags)
    report_path = tmp_path / "run" / "hang_report.json"
    assert result.returncode != 0, "the job must exit non-zero"
    assert report_path.exists(), f"no report:\n{result.stderr[-4000:]}"
    delay = report_path.stat().st_mtime - fired_at
    report = json.loads(report_path.read_text())
    text = result.stderr[result.stderr.index("hybridpar watchdog"):]
    print(f"\n{case}: report {delay:.1f} s after the stall (bound {REPORT_WITHIN:g} s)\n" + "\n".join(text.splitlines()[:8]))
    assert delay <= REPORT_WITHIN
    first = report["findings"][0]
    assert (first["kind"], first["ranks"], first["dim"], report["step"]) == ("not_arrived", [rank], "pp", FAULT_STEP), first
    assert first["op"] in ("send", "recv"), first  # the stage before it waits to send it activations or to receive gradients
    cause = text.splitlines()[1]
    assert cause.startswith(f"CAUSE  rank {rank} (stage 1) has not "), cause
    assert f"rank 0 (stage 0), which waits in {first['op']} #" in cause, cause
    assert f"rank {rank}: {where} on " in text, text
    assert "fault_job.py" in cause and "in hook" in cause, cause  # where the stalled rank stands


@pytest.mark.slow
def test_a_killed_stage_is_last_seen_in_the_step_it_died_in(corpus, tmp_path):
    """pp 2 (1F1B), rank 1 SIGKILLed in its stage's forward of step FAULT_STEP, heartbeats 5 s apart
    (steps take milliseconds): the report places the gone rank in that step (issue 48: "last seen in
    step 0, start"), and names it and the receive its peer waits in."""
    flags, world, rank, where = PIPELINE_STALLS["pp2-1F1B"]
    result, _ = _run_fault(corpus, tmp_path, "kill_stage", rank, world, **flags, **{
        "diagnostics.train_timeout": 60, "diagnostics.watchdog_interval": 5})
    report = json.loads((tmp_path / "run" / "hang_report.json").read_text())
    text = result.stderr[result.stderr.index("hybridpar watchdog"):]
    print("\n" + "\n".join(text.splitlines()[:4]))
    # Its step's beat goes out within a store write of the step's start: N - 1 only for a death sooner.
    seen = report["gone"][str(rank)]["step"]
    assert report["dead"] == [rank] and seen in (FAULT_STEP - 1, FAULT_STEP), report["gone"]
    assert f"rank {rank} (stage 1) is gone" in text.splitlines()[1]
    assert f"last seen in step {seen}, " in text, text


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DEATHS))
def test_a_rank_that_dies_is_named_live(corpus, tmp_path, case):
    """os._exit in the optimizer step, SIGKILL in a forward or while a checkpoint is written: the
    survivors' collectives raise at once and torchrun starts its teardown within a second, yet the
    job writes hang_report.json naming the dead rank, prints the verdict last, and keeps the last
    complete checkpoint."""
    fault, world, rank = DEATHS[case]
    save = {"checkpoint.every": 1} if fault == "kill_save" else {}
    result, fired_at = _run_fault(corpus, tmp_path, fault, rank, world, **save)
    report_path = tmp_path / "run" / "hang_report.json"
    assert result.returncode != 0
    assert report_path.exists(), f"no report:\n{result.stderr[-4000:]}"
    delay = report_path.stat().st_mtime - fired_at
    report = json.loads(report_path.read_text())
    text = result.stderr[result.stderr.index("hybridpar watchdog"):]
    print(f"\n{case}: report {delay:.1f} s after the death (bound {REPORT_WITHIN:g} s)\n"
          + "\n".join(text.splitlines()[:4]))
    assert delay <= REPORT_WITHIN
    assert report["dead"] == [rank] and report["findings"][0]["kind"] == "dead"
    assert report["findings"][0]["ranks"] == [rank], report["findings"][0]
    assert report["gone"][str(rank)]["pid"] > 0 and "coords" in report["gone"][str(rank)]
    assert text.splitlines()[0].endswith(f"rank(s) [{rank}] died (the process is gone: it exited, was killed or crashed)")
    assert f"rank {rank} is gone" in text.splitlines()[1]
    # Nothing of hybridpar's after the verdict: only the launcher's own summary follows.
    after = text[text.index("the ranks exit with code"):]
    assert not re.search(r"^\[rank\d+\]:", after, re.M), after[:3000]  # no rank's traceback follows it
    if fault == "kill_save":
        from hybridpar.checkpoint.dcp import latest_checkpoint

        checkpoints = tmp_path / "run" / "checkpoints"
        assert latest_checkpoint(checkpoints).name == f"step-{FAULT_STEP - 1:08d}"
        assert (latest_checkpoint(checkpoints) / ".metadata").exists()


def test_hang_report_without_dumps_says_what_it_needs(tmp_path, capsys):
    from hybridpar.cli import main

    assert main(["hang-report", str(tmp_path)]) == 2
    assert "no flight-recorder dumps" in capsys.readouterr().err


def test_a_healthy_run_is_left_alone_and_the_watchdog_stops(corpus, tmp_path, workers):
    results = workers(4).run(_healthy_run, corpus, str(tmp_path / "run"))
    assert all(r["steps"] == 4 and not r["report"] and not r["watchdog_thread"] for r in results), results


def _healthy_run(corpus, run_dir):
    import threading

    from tests.distributed import parallel_dims
    from tests.runs import make_config

    from hybridpar.train import Trainer

    config = make_config(corpus, run_dir, mp=2, dp=2, steps=4, **{
        "diagnostics.train_timeout": 2.0, "diagnostics.watchdog_interval": 0.1})
    history = Trainer(config, parallel_dims(mp=2)).run()
    time.sleep(0.5)  # longer than a beat: a stale monitor would have acted by now
    return {"steps": len(history), "report": (Path(run_dir) / "hang_report.json").exists(),
            "watchdog_thread": any(t.name == "hybridpar-watchdog" for t in threading.enumerate())}
