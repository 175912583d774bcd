"""Is a watchdog verdict a node's fault, and which node's: what a launcher may exclude.

A rank that died, stopped or never joined a collective its peers wait in (a hung GPU, a frozen
process) can be its node's doing: run elsewhere, the job may well succeed. A program's own error
(a rank that raised, collectives out of order or of different sizes) follows the job to any node,
and a verdict that blames every rank blames no node. `launch/slurm.sh` reads the result from
`hang_report.json` (its `node_fault`) and excludes the nodes named.
"""

from __future__ import annotations

import os
import socket
from typing import Iterable, Mapping, Optional

from .liveness import says_peer_loss

def node_name() -> str:
    """The node as the scheduler names it (what a launcher excludes), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def place() -> tuple[str, str]:
    """(host, node) of this process."""
    return socket.gethostname(), node_name()


# Findings (flight.Finding.kind) a node's fault explains; any other finding is the program's.
NODE_FINDINGS = ("dead", "not_arrived")


def node_fault(findings: Iterable, died: Iterable[int], nodes: Mapping[int, str], world_size: int) -> dict:
    """{"kind": "death" | "stall", "nodes": [...], "ranks": [...]} when the culprits' nodes are to
    blame; {"nodes": [], "why": ...} when no node is. `findings`: flight.analyse's; `died`: ranks
    whose process is known gone (the others named dead stopped beating: frozen, or a host that
    vanished); `nodes`: rank -> node."""
    findings = list(findings)
    culprits = sorted({r for f in findings if f.kind in NODE_FINDINGS for r in f.ranks})
    died = set(died)
    if died & set(culprits):
        # A death's verdict comes at once: a live rank that has not yet joined a collective its peers
        # wait in is on its way there (it had no train_timeout to be late by), not its node's stall.
        culprits = sorted({r for f in findings if f.kind == "dead" for r in f.ranks})
    # A rank that raised because a collective lost its peer is the dead rank's casualty, not a cause.
    causes = [f for f in findings if not (culprits and f.kind == "failed" and says_peer_loss(f.text))]
    if not culprits and not causes:
        return {"nodes": [], "why": "no rank is to blame (they wait in the same collective): not a node's fault"}
    other = sorted({f.kind for f in causes if f.kind not in NODE_FINDINGS})
    if other:
        return {"nodes": [], "why": f"the program's own fault ({', '.join(other)}): it follows the job to any node"}
    if not culprits:
        return {"nodes": [], "why": "no rank is to blame (they wait in the same collective): not a node's fault"}
    if len(culprits) == world_size:
        return {"nodes": [], "why": "every rank is to blame: not one node's fault"}
    unknown = [r for r in culprits if r not in nodes]
    if unknown:
        return {"nodes": [], "why": f"the node of rank(s) {unknown} is not known (never registered)"}
    kind = "death" if all(r in died for r in culprits) else "stall"
    return {"kind": kind, "nodes": sorted({nodes[r] for r in culprits}), "ranks": culprits}


def describe(fault: dict, group: Optional[int] = None) -> str:
    """One line for the verdict's text (`group`: the rank's replica group in a fault-tolerant job)."""
    if not fault["nodes"]:
        return f"node fault: none ({fault['why']})"
    return f"node fault: {', '.join(fault['nodes'])} ({fault['kind']} of rank(s) {fault['ranks']}); " + then(group)


def then(group: Optional[int] = None) -> str:
    """What launch/slurm.sh does about a node's fault: a plain job is requeued without the node; a replica
    group (launch/slurm.sh --ft) is restarted by its torchrun and rejoins while the others train on."""
    if group is None:
        return "launch/slurm.sh excludes it and requeues the job (EXCLUDE_ON_FAULT)"
    return (f"under launch/slurm.sh --ft its torchrun restarts replica group {group} on the same node(s) "
            "(MAX_RESTARTS) and it rejoins healed while the other groups train on, no requeue; the job is requeued "
            "without the node only when every group is gone")
