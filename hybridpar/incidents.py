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
        if again:
            lost = max(0, int(f.get("step", 0)) - 1 - int(again.get("resumed_from", 0)))
            line += (f"; training again after {_seconds(again['time'], begun)} on {again.get('nodes')} from step "
                     f"{again.get('resumed_from')}: {lost} step(s) lost")
        lines.append(line)
    return lines
