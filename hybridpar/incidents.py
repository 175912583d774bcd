"""A run's incidents: the faults that stopped it, what was done, and when it trained again.

`incidents.jsonl` in the run folder holds one event per line, appended by launch/slurm.sh (the
verdict it acted on: `fault`; the node it excluded and the requeue: `requeue`; a stop: `stop`) and by
the trainer (its first step after a resume: `training_again`). `decide` is the script's policy:
  - a fault that is not a node's (a rank's own error, a bad config, a NaN, a full disk, a hang with
    nobody to blame) is never requeued: the job ends with its error;
  - a rank that died is restarted in the job (torchrun's MAX_RESTARTS) unless its node already
    lost a rank in this run; a second death there, a stall, a hung collective or a straggler
    excludes the node at once, and the job is requeued without it;
  - unless the job was requeued MAX_REQUEUES times already, or no spare node is left.
Torch-free: the script calls `python -m hybridpar.cli.incidents_command` (the arguments, the printed
answer), which must start in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

INCIDENTS_ENV = "HYBRIDPAR_INCIDENTS"  # the file, set by launch/slurm.sh for the trainer


def append(path: Path, event: dict) -> None:
    """One event as one line: a single write in append mode, so concurrent writers do not interleave
    and a crash loses at most the line being written."""
    line = json.dumps({"time": time.time(), **event}, separators=(",", ":")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path) -> list[dict]:
    """Every event; a torn last line (a crash while writing it) is left out."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


# --- the policy ---------------------------------------------------------------------------------


def decide(report: dict, events: list[dict], *, job: str, exclude_on_fault: bool, max_requeues: int,
           restarts_left: int, needed: int, usable: Sequence[str], excluded: Sequence[str]) -> dict:
    """What launch/slurm.sh does about a verdict (hang_report.json): {"action": "exclude" | "restart" |
    "stop" | "none", "nodes": [...], "why": ...}. `needed`: the job's node count; `usable`: the
    partition's nodes that can run jobs; `excluded`: the job's current ExcNodeList."""
    fault = report.get("node_fault") or {"nodes": [], "why": "the verdict names no node"}
    nodes = list(fault.get("nodes") or [])
    if not nodes:
        return {"action": "none", "nodes": [], "why": fault.get("why", "not a node's fault")}
    if not exclude_on_fault:
        return {"action": "none", "nodes": nodes, "why": "EXCLUDE_ON_FAULT=0"}
    died_before = {n for e in events if e.get("event") == "fault" and e.get("kind") == "death"
                   for n in e.get("nodes", [])}
    if fault.get("kind") == "death" and restarts_left > 0 and not died_before & set(nodes):
        return {"action": "restart", "nodes": nodes,
                "why": f"a rank died: restarted in the job ({restarts_left} of MAX_RESTARTS left); "
                       "its node is excluded if it loses a rank again"}
    requeues = sum(1 for e in events if e.get("event") == "requeue" and str(e.get("job")) == str(job))
    if requeues >= max_requeues:
        return {"action": "stop", "nodes": nodes,
                "why": f"the job was requeued {requeues} times already (MAX_REQUEUES={max_requeues})"}
    left = sorted(set(usable) - set(excluded) - set(nodes))
    if len(left) < needed:
        return {"action": "stop", "nodes": nodes,
                "why": f"no spare node: without {', '.join(sorted(set(excluded) | set(nodes)))} the partition "
                       f"has {len(left)} usable node(s) ({', '.join(left) or 'none'}), the job needs {needed}"}
    return {"action": "exclude", "nodes": nodes, "why": f"{fault.get('kind')} on {', '.join(nodes)}"}


def fault_event(report: dict, decision: dict, job: str) -> dict:
    """The `fault` event for a verdict and what was decided about it."""
    fault = report.get("node_fault") or {}
    verdict_time = report.get("time", time.time())
    quiet = float(report.get("quiet_s", 0.0))
    return {"event": "fault", "job": job, "kind": fault.get("kind", "other"), "nodes": decision["nodes"],
            "ranks": fault.get("ranks", []), "reason": report.get("reason", ""), "step": report.get("step", 0),
            "fault_time": verdict_time - quiet, "verdict_time": verdict_time, "action": decision["action"],
            "why": decision["why"]}


def training_again(path: Path, *, step: int, resumed_from: int, job: str, nodes: str) -> bool:
    """The trainer's first step after a fault: recorded when the last fault has no such event yet."""
    events = read(path)
    faults = [i for i, e in enumerate(events) if e.get("event") == "fault"]
    if not faults or any(e.get("event") == "training_again" for e in events[faults[-1]:]):
        return False
    append(path, {"event": "training_again", "job": job, "step": step, "resumed_from": resumed_from,
                  "nodes": nodes})
    return True


# --- replica groups (launch/slurm.sh --ft) -------------------------------------------------------


class GroupWatch:
    """What launch/slurm.sh --ft says of its replica groups while they train, each in <job>/group-<g>/:
    a group's verdict (its hang_report.json), its restart by its torchrun (a new attempt_<n>/ in its
    torchrun/ logs: ranks that ended without a verdict, a node's processes killed), its dropping out
    of the steps the others commit (their `groups` events), and its return (its `healed` event, or a
    step it trained since). poll() returns the new lines; the first sign of each incident goes to
    incidents.jsonl as a fault (action `train-on`: the others went on). `nodes`: each group's nodes,
    comma-separated. What an earlier start of the job left is not news."""

    def __init__(self, job_dir: Path, nodes: Sequence[str], incidents: Path, *, job: str, max_restarts: int) -> None:
        self.job_dir, self.nodes, self.incidents = Path(job_dir), list(nodes), Path(incidents)
        self.job, self.max_restarts = job, max_restarts
        self.open: dict[int, int] = {}  # group -> the last step it trained before its open incident
        groups = range(len(self.nodes))
        self.verdicts = {g: self._stamp(g) for g in groups}
        self.attempts = {g: self._attempts(g) for g in groups}
        self.seen = {g: set(self._lines(g)) for g in groups}

    def _folder(self, g: int) -> Path:
        return self.job_dir / f"group-{g}"

    def _stamp(self, g: int) -> Optional[tuple]:
        try:
            st = os.stat(self._folder(g) / "hang_report.json")
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _attempts(self, g: int) -> set[str]:
        """torchrun's attempt folders (<log-dir>/<run id>_<suffix>/attempt_<n>, one run id per start)."""
        return {str(p.relative_to(self._folder(g))) for p in self._folder(g).glob("torchrun/*/attempt_*")}

    def _lines(self, g: int) -> list[str]:
        try:
            return (self._folder(g) / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []

    def _last_step(self, g: int) -> int:
        """The step of the group's last metrics row (its file's tail: a long run's file is large)."""
        try:
            with open(self._folder(g) / "metrics.jsonl", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
        return 0

    def _name(self, g: int) -> str:
        return f"replica group {g} ({self.nodes[g]})"

    def _opens(self, g: int, step: int, fault: dict) -> bool:
        """A new incident of group g (noted as a fault), unless one is open: then False."""
        if g in self.open:
            return False
        self.open[g] = step
        append(self.incidents, {"event": "fault", "job": self.job, "group": g, "ranks": [], "step": step + 1,
                                "action": "train-on", **fault})
        return True

    def poll(self) -> list[str]:
        said = []
        for g in range(len(self.nodes)):
            stamp = self._stamp(g)
            if stamp is not None and stamp != self.verdicts[g]:
                self.verdicts[g] = stamp
                said += self._verdict(g)
            attempts = self._attempts(g)
            restarts = sorted(int(a.rsplit("_", 1)[1]) for a in attempts - self.attempts[g])
            self.attempts[g] = attempts
            if restarts and restarts[-1] > 0 and g not in self.open:  # (attempt_0: a new start of the job)
                said += self._restarted(g, restarts[-1])
        new = []
        for g in range(len(self.nodes)):
            for line in self._lines(g):
                if line in self.seen[g]:
                    continue
                try:
                    new.append((g, json.loads(line)))
                except json.JSONDecodeError:  # being written: read again next time
                    continue
                self.seen[g].add(line)
        for g, event in sorted(new, key=lambda item: item[1].get("step", 0)):  # the groups' files in step order
            said += self._event(g, event)
        for g, before in list(self.open.items()):
            step = self._last_step(g)
            if step > before:
                del self.open[g]
                said.append(f"slurm.sh: {self._name(g)} is back: it trained step {step}")
        return said

    def _verdict(self, g: int) -> list[str]:
        try:
            report = json.loads((self._folder(g) / "hang_report.json").read_text())
        except (OSError, json.JSONDecodeError):
            return []
        fault = report.get("node_fault") or {}
        nodes = list(fault.get("nodes") or [])
        left = self.max_restarts - int(report.get("attempt", 0))
        then = (f"torchrun restarts the group ({left} of MAX_RESTARTS={self.max_restarts} left)" if left > 0 else
                "no restart left: the group is out of this job")
        why = f"{self._name(g)}: {then}; the other groups train on"
        event = fault_event(report, {"action": "train-on", "nodes": nodes, "why": why}, self.job)
        self._opens(g, int(report.get("step", 1)) - 1, {k: v for k, v in event.items() if k not in ("event", "job")})
        where = f"{fault.get('kind', 'fault')} on {', '.join(nodes)}" if nodes else "no node blamed"
        reason = str(report.get("reason") or "").splitlines()[0][:200] if report.get("reason") else ""
        return [f"slurm.sh: {self._name(g)}: verdict: {where} ({reason}); {then}, the other groups train on"]

    def _restarted(self, g: int, attempt: int) -> list[str]:
        line = (f"slurm.sh: {self._name(g)}: restarted by its torchrun (attempt {attempt} of MAX_RESTARTS="
                f"{self.max_restarts}): its ranks ended without a verdict (killed, or their node's processes lost); "
                "the other groups train on")
        now = time.time()
        self._opens(g, self._last_step(g), {"kind": "restarted", "nodes": self.nodes[g].split(","), "reason": line,
                                            "fault_time": now, "verdict_time": now,
                                            "why": f"{self._name(g)}: the other groups train on"})
        return [line]

    def _event(self, g: int, event: dict) -> list[str]:
        said, step = [], event.get("step")
        if event.get("event") == "groups":
            members, was = list(event.get("groups") or []), list(event.get("was") or [])
            for x in (x for x in was if x not in members and x < len(self.nodes)):
                line = (f"slurm.sh: {self._name(x)} dropped out of step {step}: group(s) "
                        f"{', '.join(map(str, members))} commit it without it and train on")
                now = time.time()
                if x not in self.open or self.open[x] < step:  # each live group says it: once
                    said.append(line)
                self._opens(x, step - 1, {"kind": "dropped", "nodes": self.nodes[x].split(","), "reason": line,
                                          "fault_time": now, "verdict_time": now,
                                          "why": f"{self._name(x)}: the other groups train on"})
                self.open[x] = step  # said: the other groups' same event is not said again
        elif event.get("event") == "healed" and g in self.open:
            del self.open[g]
            said.append(f"slurm.sh: {self._name(g)} is back at step {step}: healed from a live group in "
                        f"{event.get('seconds')} s (it was at step {event.get('from_step')})")
        return said


# --- the summary --------------------------------------------------------------------------------


def fold(events: list[dict]) -> list[dict]:
    """One dict per fault, with what followed it: requeue (or stop) and training again."""
    incidents: list[dict] = []
    for e in events:
        kind = e.get("event")
        if kind == "fault":
            incidents.append({"fault": e})
        elif incidents and kind in ("requeue", "stop", "training_again") and kind not in incidents[-1]:
            incidents[-1][kind] = e
    return incidents


def _seconds(after: Optional[float], since: float) -> str:
    return f"{after - since:.1f} s" if after is not None else "-"


def summary_lines(events: list[dict]) -> list[str]:
    """The incidents as lines for people: fault, detection, excluded node, training again, steps lost."""
    lines = []
    for n, inc in enumerate(fold(events), 1):
        f = inc["fault"]
        begun = f.get("fault_time", f["time"])
        where = ", ".join(f.get("nodes") or []) or "no node"
        line = (f"incident {n}: {f.get('kind')} on {where} (ranks {f.get('ranks')}) in step {f.get('step')}; "
                f"verdict after {_seconds(f.get('verdict_time'), begun)}; {f.get('action')}: {f.get('why')}")
        if "requeue" in inc:
            r = inc["requeue"]
            line += f"; excluded {r.get('excluded')}, requeued after {_seconds(r['time'], begun)}"
        if "stop" in inc:
            line += f"; stopped: {inc['stop'].get('why')}"
        again = inc.get("training_again")
        if again and f.get("action") == "train-on":  # a replica group's: the others did not stop
            line += f"; the group training again after {_seconds(again['time'], begun)}: the others lost no step"
        elif again:
            lost = max(0, int(f.get("step", 0)) - 1 - int(again.get("resumed_from", 0)))
            line += (f"; training again after {_seconds(again['time'], begun)} on {again.get('nodes')} from step "
                     f"{again.get('resumed_from')}: {lost} step(s) lost")
        lines.append(line)
    return lines
