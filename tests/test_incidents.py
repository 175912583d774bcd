"""launch/slurm.sh's policy on a verdict (hybridpar.incidents), the node a verdict blames
(diagnostics/node_fault.py) and the incidents' summary; the job itself: tests/launch/test_heal.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridpar import incidents
from hybridpar.cli import incidents_command
from hybridpar.diagnostics.flight import Finding
from hybridpar.diagnostics.node_fault import node_fault

NODES = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


def _finding(kind: str, ranks: list[int], text: str = "") -> Finding:
    return Finding(kind, ranks, "dp", [0, 2], "all_reduce", 7, text)


LOST = "rank 3 raised RuntimeError: Read error [127.0.0.1]:6568: Connection reset by peer. This is typically..."


@pytest.mark.parametrize("findings, died, expected", [
    ([_finding("dead", [2]), _finding("dead", [3])], [], {"kind": "stall", "nodes": ["n2"], "ranks": [2, 3]}),
    ([_finding("dead", [2])], [2], {"kind": "death", "nodes": ["n2"], "ranks": [2]}),
    # the peers whose collectives lost the dead rank raised: its casualties, not causes
    ([_finding("dead", [2]), _finding("failed", [0], LOST), _finding("failed", [3], LOST)], [2],
     {"kind": "death", "nodes": ["n2"], "ranks": [2]}),
    ([_finding("not_arrived", [1])], [], {"kind": "stall", "nodes": ["n1"], "ranks": [1]}),
    ([_finding("dead", [1]), _finding("dead", [3])], [1], {"kind": "stall", "nodes": ["n1", "n2"], "ranks": [1, 3]}),
    # a rank killed: the verdict comes at once, while a live rank is still on its way to the next
    # collective (seen on a loaded machine: rank 0 named beside the killed rank 3, both nodes excluded)
    ([_finding("dead", [3]), _finding("not_arrived", [0])], [3], {"kind": "death", "nodes": ["n2"], "ranks": [3]}),
])
def test_a_nodes_fault_names_its_nodes(findings, died, expected):
    assert node_fault(findings, died, NODES, 4) == expected


@pytest.mark.parametrize("findings, nodes, why", [
    ([], NODES, "no rank is to blame"),
    ([_finding("dead", [2]), _finding("mismatch", [0])], NODES, "the program's own fault (mismatch)"),
    ([_finding("failed", [1])], NODES, "the program's own fault (failed)"),
    ([_finding("dead", [2]), _finding("failed", [1], "rank 1 raised ValueError: planted")], NODES,
     "the program's own fault (failed)"),
    ([_finding("failed", [1], LOST)], NODES, "the program's own fault (failed)"),
    ([_finding("not_arrived", [r]) for r in range(4)], NODES, "every rank is to blame"),
    ([_finding("dead", [3])], {0: "n1", 1: "n1", 2: "n2"}, "the node of rank(s) [3] is not known"),
])
def test_a_programs_fault_names_no_node(findings, nodes, why):
    fault = node_fault(findings, [], nodes, 4)
    assert fault["nodes"] == [] and fault["why"].startswith(why), fault


def _report(kind="stall", nodes=("n2",), attempt=0, time=1000.0, quiet=12.0, step=7):
    return {"reason": "planted", "step": step, "time": time, "quiet_s": quiet, "attempt": attempt,
            "node_fault": {"kind": kind, "nodes": list(nodes), "ranks": [2, 3]} if nodes else
            {"nodes": [], "why": "the program's own fault (failed): it follows the job to any node"}}


def _decide(report, events=(), **given):
    settings = dict(job="7", exclude_on_fault=True, max_requeues=3, restarts_left=0, needed=2,
                    usable=["n1", "n2", "n3"], excluded=[])
    settings.update(given)
    return incidents.decide(report, list(events), **settings)


def test_the_policy():
    # A node's stall: excluded at once, in-job restarts left or not.
    assert _decide(_report(), restarts_left=3) == {"action": "exclude", "nodes": ["n2"], "why": "stall on n2"}
    # The program's fault, or a user who said no: nothing is requeued.
    assert _decide(_report(nodes=()))["action"] == "none"
    assert _decide(_report(), exclude_on_fault=False) == {"action": "none", "nodes": ["n2"], "why": "EXCLUDE_ON_FAULT=0"}
    # A death passes: restarted in the job while torchrun has restarts; a second death there excludes.
    death = _report(kind="death")
    assert _decide(death, restarts_left=2)["action"] == "restart"
    assert _decide(death, restarts_left=0)["action"] == "exclude"
    before = [incidents.fault_event(death, {"action": "restart", "nodes": ["n2"], "why": ""}, "7")]
    assert _decide(death, before, restarts_left=2)["action"] == "exclude"
    # No loop: MAX_REQUEUES requeues of this job, or no spare node, stop it.
    requeues = [{"event": "requeue", "job": "7"}] * 3
    stop = _decide(_report(), requeues)
    assert stop["action"] == "stop" and "MAX_REQUEUES=3" in stop["why"]
    assert _decide(_report(), requeues[:2])["action"] == "exclude"
    assert _decide(_report(), [{"event": "requeue", "job": "6"}] * 3)["action"] == "exclude"  # another job's
    spare = _decide(_report(), excluded=["n3"])
    assert spare == {"action": "stop", "nodes": ["n2"],
                     "why": "no spare node: without n2, n3 the partition has 1 usable node(s) (n1), the job needs 2"}


def test_the_summary_says_fault_detection_exclusion_training_again_and_steps_lost(tmp_path):
    path = tmp_path / "incidents.jsonl"
    decision = {"action": "exclude", "nodes": ["n2"], "why": "stall on n2"}
    incidents.append(path, {**incidents.fault_event(_report(), decision, "7"), "time": 1000.5})
    incidents.append(path, {"event": "requeue", "job": "7", "excluded": "n2", "time": 1003.0})
    assert incidents.training_again(path, step=7, resumed_from=6, job="7", nodes="n[1,3]")
    assert not incidents.training_again(path, step=8, resumed_from=6, job="7", nodes="n[1,3]")  # once per fault
    events = incidents.read(path)
    events[-1]["time"] = 1030.0
    [line] = incidents.summary_lines(events)
    assert line.startswith("incident 1: stall on n2 (ranks [2, 3]) in step 7; verdict after 12.0 s; exclude: "
                           "stall on n2; excluded n2, requeued after 15.0 s; training again after 42.0 s on "
                           "n[1,3] from step 6: 0 step(s) lost"), line
    with open(path, "a") as f:
        f.write('{"event": "requ')  # a crash while writing the last line
    assert [e["event"] for e in incidents.read(path)] == ["fault", "requeue", "training_again"]


def test_the_script_side_records_and_prints_a_decision_without_torch(tmp_path):
    report, path = tmp_path / "hang_report.json", tmp_path / "incidents.jsonl"
    report.write_text(json.dumps(_report(kind="death", attempt=1)))
    code = ("import sys; from hybridpar.cli.incidents_command import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'imported torch'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, "decide", str(path), str(report), "--job", "7",
                          "--max-restarts", "3", "--needed", "2", "--usable", "n1,n2,n3", "--excluded", ""],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("restart n2 a rank died: restarted in the job (2 of MAX_RESTARTS left)")
    [event] = incidents.read(path)
    assert event["event"] == "fault" and event["kind"] == "death" and event["action"] == "restart"
    assert incidents_command.main(["note", str(path), "event=requeue", "job=7", "excluded=n2"]) == 0
    assert incidents.read(path)[-1]["excluded"] == "n2"


def _event(job_dir, in_group: int, **event) -> None:
    folder = job_dir / f"group-{in_group}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


def test_launch_slurm_ft_says_a_groups_drop_out_verdict_restart_and_return_naming_its_nodes(tmp_path):
    """GroupWatch (launch/slurm.sh --ft's watcher) on the files the groups write: what a former start
    left is not news; a group the others commit without is named with its nodes, once; its return too;
    a group's verdict, and a restart by its torchrun that no verdict or drop-out came before."""
    job_dir, path = tmp_path / "job-7", tmp_path / "incidents.jsonl"
    _event(job_dir, 0, step=3, event="groups", groups=[0, 1, 2], was=[0, 1])  # before this start
    (job_dir / "group-2" / "torchrun" / "7-group2_ab" / "attempt_0").mkdir(parents=True)
    watch = incidents.GroupWatch(job_dir, ["n1", "n2", "n3"], path, job="7", max_restarts=3)
    assert watch.poll() == []
    _event(job_dir, 0, step=11, event="groups", groups=[0, 2], was=[0, 1, 2])
    _event(job_dir, 2, step=11, event="groups", groups=[0, 2], was=[0, 1, 2])  # every live group says it
    assert watch.poll() == ["slurm.sh: replica group 1 (n2) dropped out of step 11: group(s) 0, 2 commit it "
                            "without it and train on"]
    _event(job_dir, 1, step=24, event="healed", group=1, from_step=20, to_step=24, seconds=0.6)
    _event(job_dir, 0, step=25, event="groups", groups=[0, 1, 2], was=[0, 2])
    assert watch.poll() == ["slurm.sh: replica group 1 (n2) is back at step 24: healed from a live group in 0.6 s "
                            "(it was at step 20)"]
    # Group 2 restarted by its torchrun with no verdict (every rank of its node killed), back without a heal.
    (job_dir / "group-2" / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (29, 30)))
    (job_dir / "group-2" / "torchrun" / "7-group2_ab" / "attempt_1").mkdir()
    assert watch.poll() == ["slurm.sh: replica group 2 (n3): restarted by its torchrun (attempt 1 of MAX_RESTARTS=3): "
                            "its ranks ended without a verdict (killed, or their node's processes lost); the other "
                            "groups train on"]
    assert watch.poll() == []
    with open(job_dir / "group-2" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 31}) + "\n")
    assert watch.poll() == ["slurm.sh: replica group 2 (n3) is back: it trained step 31"]
    (job_dir / "group-2" / "hang_report.json").write_text(json.dumps(_report(kind="death", attempt=3, step=32)))
    [said] = watch.poll()
    assert said.startswith("slurm.sh: replica group 2 (n3): verdict: death on n2 (") and said.endswith(
        "); no restart left: the group is out of this job, the other groups train on"), said
    dropped, restarted, verdict = incidents.read(path)
    assert (dropped["kind"], dropped["group"], dropped["nodes"], dropped["step"], dropped["action"]) == (
        "dropped", 1, ["n2"], 11, "train-on")
    assert (restarted["kind"], restarted["group"], restarted["nodes"], restarted["step"]) == ("restarted", 2, ["n3"], 31)
    assert (verdict["kind"], verdict["group"], verdict["action"], verdict["nodes"]) == ("death", 2, "train-on", ["n2"])
    # The summary: the group trained again while the others lost nothing.
    assert incidents.training_again(path, step=25, resumed_from=20, job="7", nodes="n[1-3]")
    events = incidents.read(path)
    events[-1]["time"] = events[2]["fault_time"] + 9.0
    assert incidents.summary_lines(events)[-1].endswith("the group training again after 9.0 s: the others lost no step")


def test_a_groups_summary_prints_the_command_that_starts_the_ft_job_again(tmp_path):
    from hybridpar.train.summary import launch_command

    environ = {"SLURM_JOB_ID": "7", "LAYOUT_FILE": "x", "MP": "2", "DP_SHARD": "1", "DP_REPLICATE": "1",
               "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "FT_GROUPS": "3"}
    assert launch_command(tmp_path / "c.toml", tmp_path / "run" / "job-7" / "group-1", environ) == [
        "env", f"RUN_DIR={tmp_path / 'run'}", "MP=2", "DP_SHARD=1", "DP_REPLICATE=1", "PROCS_PER_NODE=2", "FT=1",
        "GROUP_NODES=2", f"CONFIG={tmp_path / 'c.toml'}", "sbatch", "--nodes", "6", "--no-kill", "launch/slurm.sh", "--"]
