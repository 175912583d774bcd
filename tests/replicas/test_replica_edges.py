"""A replica group at the edges of its job, through launch/ft_local.sh (issue 51): started while its
lighthouse is not there, it says so in one line and exits for its torchrun to try again; stopped by a
signal while it waits for a quorum that does not form, it leaves the wait at once, saves what it
holds, and exits as a preempted job does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.distributed import free_port
from tests.launch.common import stop_session
from tests.replicas.jobs import rows, start, steps, stop_leftovers

BOUND = 240  # seconds a job of these tests may take (the machine is shared: generous)


class _Stop:
    """The supervisor's StopRequest as the quorum reads it."""

    def __init__(self) -> None:
        self.signal_name = ""

    @property
    def requested(self) -> bool:
        return bool(self.signal_name)


def test_a_try_at_the_quorum_is_left_when_a_stop_signal_comes(monkeypatch):
    """torchft's try at the quorum waits for a lighthouse that is gone (2 x fault_tolerance.timeout): a
    stop signal 0.3 s into it ends the wait STOP_GRACE_S later (the try left to its thread, its heal
    refused), and the group's ranks agree to stop: QuorumStopped, naming why the quorum had not formed.
    A try that forms the quorum within the grace trains the step (the stop ballots end it)."""
    import threading

    from hybridpar.config.fault_tolerance import FaultToleranceConfig
    from hybridpar.replicas import groups, quorum

    monkeypatch.setattr(groups.dist, "get_rank", lambda: 0)
    ft = FaultToleranceConfig(enabled=True, groups=2, lighthouse="http://localhost:1", timeout=30.0)
    replicas = groups.ReplicaGroups(ft, grad_accum=1)
    released = threading.Event()
    replicas.manager = type("Manager", (), {"start_quorum": lambda self: released.wait(60)})()
    replicas.stop = stop = _Stop()
    threading.Timer(0.3, lambda: setattr(stop, "signal_name", "SIGTERM")).start()
    began = time.monotonic()
    with pytest.raises(quorum.QuorumStopped) as stopped:
        quorum.join(replicas, lambda note: None)
    released.set()
    assert time.monotonic() - began < quorum.STOP_GRACE_S + 5
    assert (stopped.value.signal_name, stopped.value.step, stopped.value.group) == ("SIGTERM", 0, 0)
    assert stopped.value.waited_for == "its try at the quorum was not answered yet"
    with pytest.raises(quorum.QuorumStopped):  # a heal that comes now is not loaded: what is saved is whole
        replicas._load({})

    replicas, quick = groups.ReplicaGroups(ft, grad_accum=1), threading.Event()  # a try answered 1 s after the signal
    replicas.manager = type("Manager", (), {"start_quorum": lambda self: quick.wait(60), "num_participants": lambda self: 1,
                                            "participating_rank": lambda self: 0})()
    replicas.stop = stop
    threading.Timer(1.0, quick.set).start()
    quorum.join(replicas, lambda note: None)
    assert replicas.first and replicas.stopped is None


def test_a_stopped_waits_line_says_what_was_saved_or_why_not(tmp_path):
    from hybridpar.replicas.quorum import QuorumStopped

    stopped = QuorumStopped("SIGUSR1", 6, "the lighthouse at http://n0:29510 does not answer: Connection refused", 1)
    head = ("hybridpar: stopped on SIGUSR1 while replica group 1 waited for the quorum before step 7 (the lighthouse at "
            "http://n0:29510 does not answer: Connection refused); ")
    tail = ". To continue, run the same command again."
    six, four = tmp_path / "step-00000006", tmp_path / "step-00000004"
    assert stopped.line(six, False) == head + f"step 6 is saved already: {six}" + tail
    assert stopped.line(four, False) == head + ("step 6 not saved by this group: the first group of its last quorum "
                                                f"writes the job's checkpoints (the newest: {four})") + tail
    assert QuorumStopped("SIGTERM", 0, "x", 0).line(None, True).endswith("(x); no step trained, nothing to save" + tail)
    stopped.saved = six
    assert stopped.line(six, True) == head + f"saved step 6: {six}" + tail


def test_a_lighthouse_that_does_not_answer_is_one_line_naming_where_its_address_comes_from(monkeypatch):
    from hybridpar.config.fault_tolerance import FaultToleranceConfig
    from hybridpar.replicas import quorum

    port = free_port()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{port}")
    with pytest.raises(quorum.LighthouseUnreachable) as refused:
        quorum.reach(FaultToleranceConfig(enabled=True, groups=2, group=1), 1, 1.0)
    assert str(refused.value) == (
        f"replica group 1 cannot reach the lighthouse at http://127.0.0.1:{port} (TORCHFT_LIGHTHOUSE) in 1 s "
        f"(fault_tolerance.timeout): Connection refused; start it there (`hybridpar lighthouse --port {port}`) or "
        "correct TORCHFT_LIGHTHOUSE; the group exits for its launcher to try again")
    assert refused.value.every_rank  # said once, by the group's rank 0 (reporting.report_error)
    with pytest.raises(quorum.LighthouseUnreachable, match=rf"\(fault_tolerance.lighthouse\) in 0.5 s \(fault_tolerance."
                                                           rf"timeout\): 127.0.0.1:{port} is not a URL \(write it as "
                                                           r"http://HOST:PORT\); start it there"):
        quorum.reach(FaultToleranceConfig(enabled=True, groups=2, lighthouse=f"127.0.0.1:{port}"), 0, 0.5)


def _ended(proc: subprocess.Popen, run, seconds: float = BOUND) -> str:
    try:
        return proc.communicate(timeout=seconds)[0]
    finally:
        stop_session(proc)
        stop_leftovers(run)


@pytest.mark.slow
def test_a_group_started_without_its_lighthouse_says_so_once_and_exits_for_torchrun_to_retry(corpus, tmp_path):
    """fault_tolerance.lighthouse names a port nothing listens on: each of torchrun's two tries says one
    line (rank 0 of the group, not each rank), no traceback, and the group exits non-zero."""
    run, port = tmp_path / "run", free_port()
    address = f"http://localhost:{port}"
    proc = start(corpus, run, 4, "--fault_tolerance.lighthouse", address, "--fault_tolerance.timeout", "3",
                 FT_GROUPS="1", RESTARTS="1")
    out = _ended(proc, run)
    log = (run / "group-0.log").read_text()
    said = [line for line in log.splitlines() if "cannot reach the lighthouse" in line]
    line = (f"hybridpar: error: replica group 0 cannot reach the lighthouse at {address} (fault_tolerance.lighthouse) "
            "in 3 s (fault_tolerance.timeout): Connection refused; start it there (`hybridpar lighthouse --port "
            f"{port}`) or correct fault_tolerance.lighthouse; the group exits for its launcher to try again")
    assert said and said[0].startswith(line), log[-3000:]
    assert len(said) == 2, said  # once per try: torchrun's first and its one restart
    # No traceback of hybridpar's or torchft's (torchrun's own, of its ChildFailedError, ends the log) nor verdict.
    assert "torchft" not in log and 'hybridpar/' not in log and "hybridpar watchdog" not in log, log[-3000:]
    assert proc.returncode == 1 and "launch/ft_local.sh: group 0 failed" in out, out


def _stopped(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("hybridpar: stopped on SIGTERM")]


def _until_stopped(run, sent: float) -> float:
    """Seconds from `sent` until the group's stop line (60 at most)."""
    while not _stopped((run / "group-0.log").read_text()):
        assert time.monotonic() < sent + 60, "the group did not stop within 60 s of SIGTERM: " + \
            (run / "group-0.log").read_text()[-3000:]
        time.sleep(0.2)
    return time.monotonic() - sent


def _signal_when(run, proc, ready, what: str) -> float:
    """SIGTERM to the job's process group (as scancel signals a job) once ready(log) says so; when it was sent."""
    deadline = time.monotonic() + BOUND
    while not ready((run / "group-0.log").read_text() if (run / "group-0.log").exists() else ""):
        assert proc.poll() is None, f"the job ended before {what}: " + proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"no {what} in {BOUND} s"
        time.sleep(0.2)
    time.sleep(2.0)  # into the wait
    os.killpg(proc.pid, signal.SIGTERM)
    return time.monotonic()


@pytest.mark.slow
def test_a_stop_signal_ends_a_wait_for_too_few_groups(corpus, tmp_path):
    """min_groups 2 and one group started: it waits for the quorum before step 1; SIGTERM ends the
    wait within seconds (not start_wait's minutes), saying it had trained nothing to save."""
    run = tmp_path / "run"
    # (one group of two started: --fault_tolerance.groups 2 after ft_local.sh's own)
    proc = start(corpus, run, 8, "--fault_tolerance.groups", "2", "--fault_tolerance.min_groups", "2",
                 "--fault_tolerance.timeout", "10", FT_GROUPS="1")
    try:
        sent = _signal_when(run, proc, lambda log: "fewer than fault_tolerance.min_groups = 2" in log,
                            "wait for the quorum")
        took = _until_stopped(run, sent)
    finally:
        _ended(proc, run)
    log = (run / "group-0.log").read_text()
    print(f"\nstopped {took:.1f} s after SIGTERM: {_stopped(log)[0]}")
    assert _stopped(log) == [
        "hybridpar: stopped on SIGTERM while replica group 0 waited for the quorum before step 1 (1 group(s) in it, "
        "fewer than fault_tolerance.min_groups = 2); no step trained, nothing to save. To continue, run the same "
        "command again."], log[-3000:]
    assert took < 30, took
    marker = json.loads((run / "group-0" / "stopped.json").read_text())
    assert marker == {"signal": "SIGTERM", "step": 0, "checkpoint": None}
    # torchrun says the signal it got (its SignalException's traceback); hybridpar says no more.
    assert 'hybridpar/' not in log and not (run / "group-0" / "hang_report.json").exists(), log[-3000:]


@pytest.mark.slow
def test_a_stop_signal_ends_a_wait_for_a_lighthouse_that_is_gone_and_saves_the_last_step(corpus, tmp_path):
    """One group trains, its lighthouse is killed after step 3 and SIGTERM follows 3 s later: the group,
    waiting for a quorum (a try of torchft's may wait 2 x fault_tolerance.timeout, 90 s), leaves the
    wait within seconds, saves its last committed step (it was the first group of its last quorum) and
    exits as a preempted job does: its stop line, stopped.json, its summary."""
    run, port = tmp_path / "run", free_port()
    proc = start(corpus, run, 200, "--fault_tolerance.timeout", "45", FT_GROUPS="1", port=port)
    try:
        deadline = time.monotonic() + BOUND
        while not steps(run, 0) or steps(run, 0)[-1]["step"] < 3:
            assert proc.poll() is None and time.monotonic() < deadline, (run / "group-0.log").read_text()[-3000:]
            time.sleep(0.2)
        found = subprocess.run(["pgrep", "-f", f"hybridpar lighthouse --port {port} "], capture_output=True,
                               text=True).stdout.split()
        assert len(found) == 1, found
        os.kill(int(found[0]), signal.SIGKILL)
        time.sleep(1.0)
        sent = _signal_when(run, proc, lambda log: True, "")
        took = _until_stopped(run, sent)
    finally:
        _ended(proc, run)
    log = (run / "group-0.log").read_text()
    last = steps(run, 0)[-1]["step"]
    checkpoint = run / "checkpoints" / f"step-{last:08d}"
    said = _stopped(log)
    print(f"\nstopped {took:.1f} s after SIGTERM: {said}")
    # What it waited for: its try at the quorum still out, or the lighthouse found silent.
    why = (r"\((its try at the quorum was not answered yet|the lighthouse at http://localhost:\d+ does not answer: "
           r"Connection refused)\)")
    assert len(said) == 1 and re.fullmatch(
        rf"hybridpar: stopped on SIGTERM while replica group 0 waited for the quorum before step {last + 1} {why}; "
        rf"saved step {last}: {re.escape(str(checkpoint))}\. To continue, run the same command again\.", said[0]), said
    assert took < 40, took
    assert json.loads((checkpoint / "train_state.json").read_text())["replicas"]["windows"] == [last]
    assert [e["step"] for e in rows(run / "group-0" / "events.jsonl") if e["event"] == "checkpoint"] == [last]
    marker = json.loads((run / "group-0" / "stopped.json").read_text())
    assert marker == {"signal": "SIGTERM", "step": last, "checkpoint": str(checkpoint)}
    summary = json.loads((run / "group-0" / "summary.json").read_text())
    assert summary["last_step"] == last, summary
