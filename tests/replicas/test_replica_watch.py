"""What a fault-tolerant group's watchdog and quorum do without a second group (issue 51): a wait for
the quorum is not a hang, but is said once it outlasts the no-progress limit; a quorum that does not
form, or forms with fewer than fault_tolerance.min_groups groups, is waited out and said in one line;
a stopped rank is ended after the verdict (its launcher then restarts the group at once); and every
verdict names the rank's replica group."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import subprocess
import sys
import threading
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from hybridpar.config.fault_tolerance import FaultToleranceConfig
from hybridpar.diagnostics.liveness import process_stopped
from hybridpar.diagnostics.stragglers import Verdict, describe
from hybridpar.mesh.layout import MeshCoords
from hybridpar.replicas import groups, quorum
from tests.diagnostics.test_watchdog import _watchdog, clock  # noqa: F401 (clock: a fixture)
from tests.distributed import free_port

# torchft's lighthouse status page (/status) as it reads while a quorum waits for its --min-groups.
STATUS = ("Current quorum_id: 3 <br>\nNext quorum status: New quorum not ready, only have 1 participants, need "
          "min_replicas 2 [1/1 participants healthy][1 heartbeating][shrink_only=false]\n<h3>Previous Quorum</h3>")


def _beat(wd, rank: int, state: str, step: int = 9, phase: str = "replica quorum", note: str = "",
          beat: int = 1, seqs: Optional[dict] = None) -> None:
    """Rank `rank`'s heartbeat number `beat` (a new number: it beats), as its thread publishes it."""
    wd.beat.put(f"beat/{rank}", json.dumps({"beat": beat, "step": step, "phase": phase, "seqs": seqs or {}, "state": state,
                                            "timeout": 60.0, "note": note, "waits": 1}))


def test_a_wait_outside_the_job_is_no_hang_and_is_said_once_past_the_limit(tmp_path, clock, capsys):
    """Every rank of group 1 waits for the quorum (Watchdog.waiting): no verdict however long; one line
    once the wait outlasts the 60 s limit, naming the group and what it waits for."""
    wd = _watchdog(tmp_path)
    wd.beat.group = 1
    what = "the quorum of the replica groups before step 9 (the lighthouse at http://n0:29510 does not answer)"
    with wd.waiting("the quorum of the replica groups before step 9") as say:
        say(what)
        assert (wd.beat.state, wd.beat.note) == ("waiting", what)
        _beat(wd, 1, "waiting", note=what)
        wd.beat.publish()
        assert wd.monitor.check() is None
        for beat in range(2, 5):  # 150 s: said once, never a verdict
            clock.now += 50
            # Its heartbeat goes on, and so do the collectives by which the group's ranks agree to ask again.
            _beat(wd, 1, "waiting", note=what, beat=beat, seqs={"world": beat})
            wd.beat.publish()
            assert wd.monitor.check() is None
    assert (wd.beat.state, wd.beat.note) == ("running", "")
    said = [line for line in capsys.readouterr().err.splitlines() if "every rank has waited" in line]
    assert said == [f"hybridpar watchdog of replica group 1: every rank has waited 100 s for {what}, longer than "
                    "the watchdog's no-progress limit (60 s): not a hang; training goes on when the wait ends"], said


def test_a_rank_stuck_while_the_others_wait_for_the_quorum_is_still_a_hang(tmp_path, clock):
    """Rank 0 waits for the quorum, rank 1 never got there: rank 1's lack of progress is judged."""
    wd = _watchdog(tmp_path)
    with wd.waiting("the quorum of the replica groups before step 9"):
        _beat(wd, 1, "running", phase="data")
        wd.beat.publish()
        assert wd.monitor.check() is None
        clock.now += 61
        _beat(wd, 1, "running", phase="data", beat=2)
        wd.beat.publish()
        assert wd.monitor.check() == "no progress on any rank for 61.0 s (timeout 60 s)"


def test_a_stopped_rank_is_ended_after_the_verdict_and_every_line_names_its_group(tmp_path, clock, capsys):
    """A rank of this host stopped (SIGSTOP) cannot obey the verdict: the monitor kills it (torchrun
    would wait 30 s first). The verdict names group 1 with the rank, in the text and the report."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wd = _watchdog(tmp_path)
        wd.beat.group = 1
        wd.beat.neighbours, wd.beat.nodes = {1: child.pid}, {0: "n1", 1: "n1"}
        _beat(wd, 1, "running", step=6, phase="forward")
        wd.beat.publish()
        assert wd.monitor.check() is None
        child.send_signal(19)  # SIGSTOP
        deadline = time.monotonic() + 10
        while not process_stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        clock.now += 30
        wd.beat.publish()
        reason = wd.monitor.check()
        assert reason == "rank(s) [1] are stopped (SIGSTOP, a debugger): alive, their heartbeat silent"
        wd.monitor.report(reason)
        assert child.wait(timeout=10) == -9  # killed, not left stopped
    finally:
        child.kill()
        child.wait()
    report = json.loads((tmp_path / "hang_report.json").read_text())
    assert report["group"] == 1 and report["node_fault"] == {"kind": "stall", "nodes": ["n1"], "ranks": [1]}
    assert report["gone"]["1"]["coords"] == "group 1, mp 0, dp 1 (replicate 0, shard 1)", report["gone"]
    assert wd.beat.has("verdict")
    text = wd.beat.get_many(["verdict"])[0].decode()
    assert text.startswith("hybridpar watchdog of replica group 1 at step 6: rank(s) [1] are stopped"), text
    # Its advice: what launch/slurm.sh --ft does about a group's node fault, not a plain job's requeue.
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("node fault:")]
    assert said == ["node fault: n1 (stall of rank(s) [1]); " + FT_THEN], said


# What launch/slurm.sh --ft does about a node's fault in a group (slurm_ft.sh): the group restarts, no requeue.
FT_THEN = ("under launch/slurm.sh --ft its torchrun restarts replica group 1 on the same node(s) (MAX_RESTARTS) and it "
           "rejoins healed while the other groups train on, no requeue; the job is requeued without the node only when "
           "every group is gone")


def test_every_advice_of_a_requeue_is_a_groups_restart_under_fault_tolerance(tmp_path, capsys):
    """The verdicts' node-fault line, the line of a rank's node lost with rank 0, and a straggler's stop:
    in a plain job launch/slurm.sh requeues without the node; in a replica group (slurm.sh --ft) its
    torchrun restarts the group, which exits as failed for it (exit 1: a group that ends 0 has finished)."""
    from types import SimpleNamespace

    from hybridpar.config import Config
    from hybridpar.diagnostics.node_fault import describe as describe_fault
    from hybridpar.train.supervisor import Supervisor

    fault = {"kind": "death", "nodes": ["n2"], "ranks": [3]}
    assert describe_fault(fault) == ("node fault: n2 (death of rank(s) [3]); launch/slurm.sh excludes it and requeues "
                                     "the job (EXCLUDE_ON_FAULT)")
    assert describe_fault(fault, 1) == "node fault: n2 (death of rank(s) [3]); " + FT_THEN
    wd = _watchdog(tmp_path, rank=1)
    wd.beat.group, wd.beat.nodes, wd.beat.step = 1, {0: "n0", 1: "n1"}, 7
    wd.monitor.store_lost(40.0, ConnectionResetError("Connection reset by peer"))
    assert json.loads((tmp_path / "hang_report.json").read_text())["group"] == 1
    assert "node fault: n0 (death of rank(s) [0]); " + FT_THEN in capsys.readouterr().err.splitlines()

    x = {"rank": 3, "host": "h2", "node": "n2", "ratio": 3.4, "reports": 2, "step": 12}
    for group in (None, 1):
        config = Config()
        config.output.run_dir = str(tmp_path / f"run-{group}")
        config.fault_tolerance.enabled = group is not None
        supervisor = Supervisor(config)
        supervisor.stragglers = SimpleNamespace(excluding=dict(x, **({"group": group} if group is not None else {})))
        supervisor.straggler_stop(12, tmp_path / "step-00000012")
        line = json.loads((tmp_path / f"run-{group}" / "hang_report.json").read_text())["reason"]  # the line said
        head = (f"hybridpar: rank 3 ({'replica group 1, ' if group else ''}node n2, host h2) computed 3.4x the others' "
                "median in 2 straggler reports in a row (diagnostics.straggler_exclude = 3.0); saved step 12 "
                f"({tmp_path / 'step-00000012'}) and stopped")
        assert line == head + (" so that node n2 can be left out (launch/slurm.sh excludes it and requeues the job)"
                               if group is None else f"; {FT_THEN}; to leave node n2 out now, resubmit with --exclude n2")
        assert supervisor.exit_code == (group is not None)


def test_a_straggler_is_named_with_its_group():
    verdict = Verdict(rank=3, compute=2.0, median_compute=1.0, ratio=2.0, median_wait=0.1, spread=0.0,
                      wait_share=0.1, over=True, straggler=True)
    line = describe(verdict, 40, MeshCoords.of(3, 1, 1, 2, 1, 2), "n2", group=1)
    assert line.startswith("straggler at step 40: rank 3 (group 1, mp 1, dp 1 (replicate 0, shard 1), host n2)"), line


# --- the quorum's waits (ReplicaGroups.begin_step), with torchft's Manager played by a stand-in ---

class _Manager:
    """torchft's Manager as begin_step sees it: each start_quorum takes the next outcome, a number of
    groups or "timeout"; like torchft 0.2, a failed quorum's error is raised again by the next start."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes, self._quorum_future, self.groups = list(outcomes), None, 0
        self._quorum_id = 1  # one quorum throughout: no replica check across groups is due

    def errored(self) -> None:
        return None

    def start_quorum(self) -> None:
        if self._quorum_future is not None:
            self._quorum_future.result()
        outcome = self.outcomes.pop(0)
        self._quorum_future = future = concurrent.futures.Future()
        if outcome == "timeout":
            future.set_exception(TimeoutError('status: Cancelled, message: "Timeout expired"'))
        else:
            future.set_result(None)
            self.groups = outcome
        future.result()

    def num_participants(self) -> int:
        return self.groups

    def participating_rank(self) -> int:
        return 0


class _Status(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = STATUS.encode()
        self.send_response(200 if self.path == "/status" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def lighthouse():
    """A stand-in for torchft's lighthouse: its /status page, nothing more."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _groups(monkeypatch, address: str, outcomes: list, min_groups: int = 2):
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(quorum, "RETRY_S", 0.0)
    ft = FaultToleranceConfig(enabled=True, groups=2, group=0, lighthouse=address, min_groups=min_groups, timeout=3.0)
    replicas = groups.ReplicaGroups(ft, grad_accum=1)
    notes: list[str] = []

    class Waiting:
        def __init__(self, what):
            notes.append(what)

        def __enter__(self):
            return notes.append

        def __exit__(self, *exc):
            notes.append("done")

    replicas.manager, replicas.waiting, replicas.at = _Manager(outcomes), Waiting, lambda *a, **k: None
    replicas._started, replicas._quorum_id = True, 1  # past the first step's wait for every group
    replicas.loader = type("Loader", (), {"state_dict": lambda self: {}, "record": None})()
    return replicas, notes


def _said(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("hybridpar: replica group")]


def test_a_quorum_of_fewer_than_min_groups_is_waited_out_and_said_once(monkeypatch, capsys, lighthouse):
    replicas, notes = _groups(monkeypatch, lighthouse, [1, 1, 1, 2])
    assert replicas.begin_step(8) == 8 and replicas.manager.outcomes == []
    why = "1 group(s) in it, fewer than fault_tolerance.min_groups = 2"
    said = _said(capsys)
    assert said[0] == f"hybridpar: replica group 0 waits for the quorum before step 9: {why}; it trains on when the " \
                      "quorum forms"
    assert len(said) == 2 and said[1].startswith("hybridpar: replica group 0 is in a quorum of 2 group(s) after waiting ")
    assert notes == ["the quorum of the replica groups before step 9"] + \
        [f"the quorum of the replica groups before step 9 ({why})"] * 3 + ["done"]


def test_a_quorum_that_does_not_form_is_waited_out_saying_what_the_lighthouse_waits_for(monkeypatch, capsys,
                                                                                     lighthouse):
    replicas, _ = _groups(monkeypatch, lighthouse, ["timeout", "timeout", 2])
    replicas.begin_step(8)
    said = _said(capsys)
    assert said[0] == ("hybridpar: replica group 0 waits for the quorum before step 9: no quorum in 6 s; the lighthouse: "
                       "New quorum not ready, only have 1 participants, need min_replicas 2; it trains on when the "
                       "quorum forms") and len(said) == 2, said


def test_a_lighthouse_that_does_not_answer_is_waited_for(monkeypatch, capsys):
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    replicas, notes = _groups(monkeypatch, address, ["timeout", "timeout", "timeout", 1], min_groups=1)
    replicas.begin_step(0)
    assert _said(capsys)[0] == (f"hybridpar: replica group 0 waits for the quorum before step 1: the lighthouse at "
                                f"{address} does not answer: Connection refused; it trains on when the quorum forms")
    assert len(notes) == 5


def test_an_error_that_is_not_the_quorums_is_raised(monkeypatch, lighthouse):
    """A heal's state that does not load (start_quorum's own code, not the quorum's future) is a bug to see."""
    replicas, _ = _groups(monkeypatch, lighthouse, [2])

    def broken():
        raise ValueError("a state that does not fit")

    replicas.manager.start_quorum = broken
    with pytest.raises(ValueError, match="a state that does not fit"):
        replicas.begin_step(3)


def test_a_quorum_another_rank_missed_is_asked_again_by_every_rank(monkeypatch, capsys, lighthouse):
    """This rank got the quorum, another of its group did not (its try timed out first): both ask again,
    or the other would ask alone and wait in torchft's manager for this one, gone on to train."""
    replicas, _ = _groups(monkeypatch, lighthouse, [2, 2], min_groups=1)
    other = iter([True, False])  # the other rank of the group: first it missed the quorum, then not
    monkeypatch.setattr(quorum, "gather_objects", lambda mine: [mine, (next(other), mine[1], "")])
    replicas.begin_step(4)
    assert replicas.manager.outcomes == []
    assert _said(capsys)[0] == ("hybridpar: replica group 0 waits for the quorum before step 5: another rank of this "
                                "group missed it; it trains on when the quorum forms")


def test_a_heal_that_reached_some_ranks_only_stops_the_group(monkeypatch, lighthouse):
    """The live group failed while this one was healed from it: another rank of this group left the
    quorum at the live group's step, this one at its own. Training on would run the ranks' collectives
    out of step (a hang at the first evaluation): the group stops, for its launcher to restart it."""
    replicas, _ = _groups(monkeypatch, lighthouse, [2], min_groups=1)
    monkeypatch.setattr(quorum, "gather_objects", lambda mine: [mine, (False, 4, "")])  # another rank: step 4
    with pytest.raises(quorum.GroupOutOfStep, match=r"replica group 0: its ranks left the quorum at steps 0 and 4, a "
                                                    r"heal from a live group reached some of them only"):
        replicas.begin_step(0)


def test_the_all_reduce_with_the_other_groups_is_a_wait_not_a_collective_of_this_group(monkeypatch, lighthouse):
    """A silent group holds the groups' all-reduce for up to fault_tolerance.timeout: the watchdog is told
    it waits (Supervisor.waiting) for the other groups, as in the quorum, and judges nothing there."""
    replicas, notes = _groups(monkeypatch, lighthouse, [], min_groups=1)
    seen = []

    class Work:
        def wait(self) -> None:
            seen.append(notes[-1])  # what the watchdog was told while the all-reduce waited

    replicas.manager.allreduce, replicas.manager.groups = lambda flat: Work(), 1
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    replicas.step = 6
    replicas.average([param])
    assert seen == ["the other replica groups' gradients of step 7"] and notes[-1] == "done"
