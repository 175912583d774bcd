"""What every rank was doing when a job stopped making progress, and who is to blame: the analysis
the live watchdog and `hybridpar hang-report DIR` share, over one trace per rank
(hybridpar.diagnostics.traces reads them).

Collectives are matched per group by sequence number; groups of one mesh dimension run the same
program, so a sequence number also compares across them. Culprits, in order of confidence:
  mismatch    at one (dimension, sequence number) a rank issued another op or other shapes;
  dead        a rank whose heartbeat stopped or that left no trace, while peers wait for it;
  not_arrived a rank the peers wait for that is not in any collective (its Python line shows why);
  skipped     a rank waiting in a later collective than one its peers wait for it in;
  order       a rank waiting in another collective than the one its peers wait for it in, when no
              other rank issued both to tell which comes first;
  failed      a rank that raised an exception, when nothing above explains the hang.
Sends and receives (a pipeline's: traces carry them from diagnostics.p2p) are matched per pair of
ranks: a rank's n-th receive from a peer with the peer's n-th send to it. The peer that has not
issued its side and waits in nothing is not_arrived; ranks that wait for each other round a
circle of sends, receives and collectives are order. On a `pp` group each rank is named with its
stage (its position in the group).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterable, Optional

from .liveness import says_peer_loss
from .traces import P2P, Collective, GroupTrace, RankTrace

__all__ = ["Finding", "Wait", "P2PWait", "Verdict", "analyse", "format_report"]


@dataclasses.dataclass
class Finding:
    kind: str  # 'dead', 'mismatch', 'not_arrived', 'skipped', 'order', 'failed'
    ranks: list[int]  # the culprit(s)
    dim: str  # the mesh dimension of the group involved
    group: list[int]  # its ranks
    op: str
    seq: int
    text: str  # one sentence for people


@dataclasses.dataclass
class Wait:
    dim: str
    group: list[int]
    op: str
    seq: int
    waiting: list[int]
    missing: list[int]


@dataclasses.dataclass
class P2PWait:
    rank: int  # the rank waiting
    op: P2P  # the send or receive it waits in
    peer_issued: Optional[int]  # how many matching ops the peer has issued (None: no trace of it)
    text: str  # 'rank 0 (stage 0) waits in recv #3 from rank 1 (stage 1) on the pp group [0, 1]'

    @property
    def peer_missing(self) -> bool:
        """The peer has not issued the op that matches this one (or is not known to have)."""
        return self.op.peer >= 0 and (self.peer_issued is None or self.peer_issued < self.op.n)


@dataclasses.dataclass
class Verdict:
    findings: list[Finding]
    waits: list[Wait]
    traces: dict[int, RankTrace]
    dead: list[int]
    # What is known of ranks without a trace (dead): host, pid, coords and the last step and phase
    # their heartbeat gave; filled in by the live monitor.
    gone: dict[int, dict] = dataclasses.field(default_factory=dict)
    p2p_waits: list[P2PWait] = dataclasses.field(default_factory=list)

    @property
    def culprits(self) -> list[int]:
        return sorted({r for f in self.findings for r in f.ranks})

    def to_json(self) -> dict:
        return {
            "culprits": self.culprits,
            "dead": self.dead,
            "gone": {str(r): info for r, info in self.gone.items()},
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "waits": [dataclasses.asdict(w) for w in self.waits],
            "p2p_waits": [dataclasses.asdict(w) for w in self.p2p_waits],
            "ranks": {
                str(r): {"host": t.host, "pid": t.pid, "coords": t.coords, "step": t.step, "phase": t.phase,
                         "where": t.where, "note": t.note,
                         "waiting_in": _waiting_in(t)}
                for r, t in sorted(self.traces.items())
            },
        }


def analyse(traces: dict[int, RankTrace], dead: Iterable[int] = (),
            last_issued: Optional[dict[int, dict[str, int]]] = None) -> Verdict:
    """Who is behind, dead or out of step. `dead`: ranks known gone; `last_issued`: their last known
    issued count per group name (from heartbeats), to tell which collective they never joined."""
    dead = sorted(set(dead))
    last_issued = last_issued or {}
    groups = _all_groups(traces)
    waits = _waits(traces, groups, dead, last_issued)
    p2p_waits = _p2p_waits(traces)
    findings = [_dead_finding(d, waits, p2p_waits) for d in dead] + _mismatches(traces)
    blamed = {r for f in findings for r in f.ranks}
    for w in waits:
        for r in w.missing:
            if r in blamed or r in dead or r not in traces:
                continue
            t = traces[r]
            pending = t.pending()
            raised = t.note.startswith("raised")
            if not pending:
                if raised or t.p2p:
                    continue  # failed outside any collective ('failed' below), or waits in a send or receive (below)
                findings.append(Finding("not_arrived", [r], w.dim, w.group, w.op, w.seq,
                                        f"rank {r} has not joined {w.op} #{w.seq} on the {w.dim} group {w.group} "
                                        f"that ranks {w.waiting} wait in; it is not in any collective: {t.where}"))
                blamed.add(r)
                continue
            g, c = pending[0]
            later = _issued_later(traces, r, (w.dim, w.seq), (g.dim, c.seq))
            if raised and not later:
                continue  # it failed in a collective it reached in order: often a peer's exit; below
            if later is None:
                findings.append(Finding("order", [r], w.dim, w.group, w.op, w.seq,
                                        f"rank {r} waits in {c.op} #{c.seq} on the {g.dim} group {g.ranks} while ranks "
                                        f"{w.waiting} wait for it in {w.op} #{w.seq} on the {w.dim} group {w.group}: "
                                        f"collectives issued in a different order ({t.where})"))
                blamed.add(r)
            elif later:
                findings.append(Finding("skipped", [r], w.dim, w.group, w.op, w.seq,
                                        f"rank {r} skipped {w.op} #{w.seq} on the {w.dim} group {w.group} that ranks "
                                        f"{w.waiting} wait in, and went on to {c.op} #{c.seq} on the {g.dim} group: "
                                        f"{t.where}"))
                blamed.add(r)
    findings += _p2p_findings(traces, waits, p2p_waits, dead, blamed)
    for r, t in sorted(traces.items()):
        if t.note.startswith("raised") and r not in blamed:
            g, c = (t.pending() or [(None, None)])[0]
            inside = f" in {c.op} #{c.seq} on the {g.dim} group {g.ranks}" if c else ""
            findings.append(Finding("failed", [r], g.dim if g else "", g.ranks if g else [], c.op if c else "",
                                    c.seq if c else 0, f"rank {r} {t.note}{inside} ({t.where})"))
    # A mismatch is a definite bug and can kill a peer (gloo aborts on a size mismatch): first.
    order = {"mismatch": 0, "dead": 1, "not_arrived": 2, "skipped": 3, "order": 4, "failed": 5}
    findings.sort(key=lambda f: order[f.kind])
    return Verdict(findings, waits, traces, dead, p2p_waits=p2p_waits)


def _dead_finding(d: int, waits: list[Wait], p2p_waits: list[P2PWait]) -> Finding:
    blocked = [w for w in waits if d in w.missing]
    sending = [w for w in p2p_waits if w.op.peer == d]
    if not blocked and not sending:
        return Finding("dead", [d], "", [], "", 0, f"rank {d} is gone (no heartbeat or no trace)")
    if not blocked:
        op = sending[0].op
        return Finding("dead", [d], op.dim, op.ranks, op.op, op.n, f"{op.who(d)} is gone: {sending[0].text}")
    w = blocked[0]
    also = f"; {sending[0].text}" if sending else ""
    return Finding("dead", [d], w.dim, w.group, w.op, w.seq,
                   f"rank {d} is gone: ranks {w.waiting} wait for it in {w.op} #{w.seq} on the {w.dim} group {w.group}{also}")


def _p2p_waits(traces: dict[int, RankTrace]) -> list[P2PWait]:
    """Every send and receive some rank waits in, with how many matching ops its peer has issued."""
    out = []
    for r, t in sorted(traces.items()):
        for op in t.p2p:
            peer = traces.get(op.peer)
            issued = peer.p2p_issued.get(op.counterpart(r), 0) if peer is not None else None
            out.append(P2PWait(r, op, issued, f"{op.who(r)} waits in {op.describe(r)}"))
    return out


def _p2p_findings(traces, waits, p2p_waits, dead, blamed) -> list[Finding]:
    """The peers that never issued the send or receive a rank waits in: not_arrived when the peer
    waits in nothing, order when the waits go round a circle back to the rank."""
    findings = []
    for w in p2p_waits:
        op, peer = w.op, w.op.peer
        if not w.peer_missing or peer in blamed or peer in dead or peer not in traces:
            continue
        t = traces[peer]
        if t.note.startswith("raised"):
            continue  # reported as 'failed'
        if not t.pending() and not t.p2p:
            other = "sent to" if op.op == "recv" else "received from"
            findings.append(Finding("not_arrived", [peer], op.dim, op.ranks, op.op, op.n,
                                    f"{op.who(peer)} has not {other} {op.who(w.rank)}, which waits in "
                                    f"{op.describe(w.rank)}; {op.who(peer)} is in no collective and no send or "
                                    f"receive: {t.where}"))
            blamed.add(peer)
    findings += _circles(traces, waits, p2p_waits, blamed)
    return findings


def _circles(traces, waits, p2p_waits, blamed) -> list[Finding]:
    """Ranks waiting for each other round a circle with a send or receive in it (a deadlock)."""
    edges: dict[int, list[tuple[int, str, object]]] = {}  # rank -> [(the rank it waits for, why, its op)]
    for w in p2p_waits:
        if w.peer_missing:
            edges.setdefault(w.rank, []).append((w.op.peer, w.text, w))
    if not edges:
        return []
    for w in waits:
        for r in w.waiting:
            for m in w.missing:
                edges.setdefault(r, []).append((m, f"rank {r} waits in {w.op} #{w.seq} on the {w.dim} group {w.group}", w))
    findings, seen = [], set()
    for start in sorted(r for r, out in edges.items() if any(isinstance(x, P2PWait) for _, _, x in out)):
        path, why, r = [start], [], start
        while r in edges and edges[r][0][0] in traces:
            nxt, text, _ = edges[r][0]
            why.append(text)
            if nxt in path:
                circle = path[path.index(nxt):]
                key = frozenset(circle)
                if key not in seen and not key & blamed:
                    seen.add(key)
                    texts = why[path.index(nxt):]
                    first = next(x for _, _, x in edges[start] if isinstance(x, P2PWait)).op
                    findings.append(Finding("order", sorted(circle), first.dim, first.ranks, first.op, first.n,
                                            "; ".join(texts) + ": each waits for the next (sends, receives or "
                                            "collectives issued in an order that cannot complete)"))
                    blamed |= key
                break
            path.append(nxt)
            r = nxt
    return findings


def _waiting_in(t: RankTrace) -> list[str]:
    """What a rank waits in, shortly: 'mp all_reduce #7', 'pp recv<-1 #3'."""
    return ([f"{g.dim} {c.op} #{c.seq}" for g, c in t.pending()]
            + [f"{op.dim} {op.op}{'->' if op.op == 'send' else '<-'}{op.peer} #{op.n}" for op in t.p2p])


def _all_groups(traces: dict[int, RankTrace]) -> dict[str, tuple[str, list[int]]]:
    """Group name -> (dim, ranks); members not named by any trace are inferred from who has entries."""
    groups: dict[str, tuple[str, list[int]]] = {}
    members: dict[str, set[int]] = {}
    for r, t in traces.items():
        for name, g in t.groups.items():
            members.setdefault(name, set()).add(r)
            if g.ranks:
                groups[name] = (g.dim, g.ranks)
            else:
                groups.setdefault(name, (g.dim, []))
    return {name: (dim, ranks or sorted(members[name])) for name, (dim, ranks) in groups.items()}


def _waits(traces, groups, dead, last_issued) -> list[Wait]:
    """Per group: the oldest collective some member waits in, who waits, who has not issued it."""
    waits = []
    for name, (dim, ranks) in groups.items():
        pend = [(r, traces[r].groups[name].pending) for r in ranks if r in traces and name in traces[r].groups]
        pend = [(r, c) for r, c in pend if c is not None]
        if not pend:
            continue
        seq = min(c.seq for _, c in pend)
        op = next(c.op for _, c in pend if c.seq == seq)
        waiting = sorted(r for r, c in pend if c.seq == seq)
        missing = []
        for r in ranks:
            if r in waiting:
                continue
            if r in traces:
                g = traces[r].groups.get(name)
                issued = g.issued if g else 0
            else:
                issued = last_issued.get(r, {}).get(name, -1)
            if issued < seq:
                missing.append(r)
        waits.append(Wait(dim, ranks, op, seq, waiting, missing))
    waits.sort(key=lambda w: (_dim_rank(w.dim), w.group))
    return waits


def _dim_rank(dim: str) -> int:
    return {"mp": 0, "dp_shard": 1, "dp_replicate": 2, "dp": 3, "world": 4}.get(dim, 5)


def _mismatches(traces: dict[int, RankTrace]) -> list[Finding]:
    """At each (dim, seq), the op and shapes most ranks issued; ranks that issued something else."""
    seen: dict[tuple[str, int], dict[int, tuple[Collective, GroupTrace]]] = {}
    for r, t in traces.items():
        for g in t.groups.values():
            for c in g.recent:
                seen.setdefault((g.dim, c.seq), {})[r] = (c, g)
    findings, reported_dims = [], set()
    for (dim, seq) in sorted(seen, key=lambda k: (k[1], _dim_rank(k[0]))):
        calls = seen[(dim, seq)]
        if dim in reported_dims or len(calls) < 2:
            continue
        counts = Counter(c.signature() for c, _ in calls.values())
        if len(counts) == 1:
            continue
        (common, n), = counts.most_common(1)
        odd = sorted(r for r, (c, _) in calls.items() if c.signature() != common)
        if n * 2 <= len(calls):  # no majority: name every rank's call
            odd = sorted(calls)
        example = next(c for c, _ in calls.values() if c.signature() == common)
        group = calls[odd[0]][1].ranks
        shown = "; ".join(f"rank {r}: {calls[r][0].describe()}" for r in odd[:4])
        findings.append(Finding("mismatch", odd, dim, group, example.op, seq,
                                f"collective #{seq} on the {dim} group {group} does not match: most ranks issued "
                                f"{example.describe()}, but {shown} (a skipped, extra or differently shaped call)"))
        reported_dims.add(dim)
    return findings


def _issued_later(traces, rank, missed: tuple[str, int], pending: tuple[str, int]) -> Optional[bool]:
    """Does the healthy order put `pending` after `missed`? Asked of ranks that issued both."""
    votes = Counter()
    for r, t in traces.items():
        if r == rank:
            continue
        a = _find(t, *missed)
        b = _find(t, *pending)
        if a is not None and b is not None:
            votes[b.order > a.order] += 1
    if not votes:
        return None
    return votes.most_common(1)[0][0]


def _find(trace: RankTrace, dim: str, seq: int) -> Optional[Collective]:
    for g in trace.groups.values():
        if g.dim == dim:
            c = g.at(seq)
            if c is not None:
                return c
    return None


# ---------------------------------------------------------------------------------------------
# The report


def format_report(verdict: Verdict, headline: str, world_size: int = -1) -> str:
    lines = [headline]
    causes = [f for f in verdict.findings if f.kind != "failed"]
    for f in causes[:4]:
        lines.append("CAUSE  " + f.text)
        for r in f.ranks[:2]:
            t = verdict.traces.get(r)
            if t is not None:
                lines.append(f"       rank {r}: {t.coords} on {t.host} (pid {t.pid}), step {t.step} {t.phase}")
            elif r in verdict.gone:
                g = verdict.gone[r]
                lines.append(f"       rank {r}: {g.get('coords', '?')} on {g.get('host', '?')} (pid {g.get('pid', '?')}), "
                             f"last seen in step {g.get('step', '?')}, {g.get('phase', '?')}")
    # A rank's own error comes before the errors of the ranks whose collectives lost it.
    failed = [f for f in verdict.findings if f.kind == "failed"]
    own = [f for f in failed if not says_peer_loss(f.text)]
    for f in (own + [f for f in failed if f not in own])[:4]:
        lines.append(("CAUSE  " if not causes and (f in own or not own) else "THEN   ") + f.text)
    if not verdict.findings:
        lines.append("CAUSE  not found: every rank waits in matching collectives, sends and receives (a network or "
                     "driver problem? run `hybridpar doctor` on these nodes)")
    if verdict.waits or verdict.p2p_waits:
        lines.append("WAITING")
        for w in verdict.waits[:8]:
            missing = f", missing {w.missing}" if w.missing else ""
            lines.append(f"  {w.op} #{w.seq} on the {w.dim} group {w.group}: waiting {w.waiting}{missing}")
        if len(verdict.waits) > 8:
            lines.append(f"  ... and {len(verdict.waits) - 8} more groups")
        for w in verdict.p2p_waits[:8]:
            matching = "sends" if w.op.op == "recv" else "receives"
            issued = f" (rank {w.op.peer} has issued {w.peer_issued} matching {matching})" if w.peer_issued is not None else ""
            lines.append(f"  {w.text}{issued}")
        if len(verdict.p2p_waits) > 8:
            lines.append(f"  ... and {len(verdict.p2p_waits) - 8} more sends and receives")
    lines.append("WHERE EACH RANK IS")
    ranks = sorted(set(verdict.traces) | set(verdict.dead))
    shown = ranks if len(ranks) <= 16 else sorted(set(verdict.culprits) | set(ranks[:8]))[:16]

    def coords(r):  # the rank's place in the mesh (its stage under pp), from its trace or its last heartbeat
        t = verdict.traces.get(r)
        return t.coords if t is not None else verdict.gone.get(r, {}).get("coords", "")
    width = max((len(coords(r)) for r in shown), default=0)
    for r in shown:
        t = verdict.traces.get(r)
        where = f"{coords(r):<{width}}  " if width else ""
        if t is None:
            g = verdict.gone.get(r)
            last = f"{g.get('host', '?'):<12} step {g.get('step', '?'):<5} {g.get('phase', '?'):<10} " if g else ""
            lines.append(f"  rank {r:>4}  {where}{last}gone")
            continue
        waiting = ", ".join(_waiting_in(t)) or "not in a collective"
        lines.append(f"  rank {r:>4}  {where}{t.host:<12} step {t.step:<5} {t.phase:<10} {waiting:<28} {t.where}")
    if len(shown) < len(ranks):
        lines.append(f"  ... {len(ranks) - len(shown)} more ranks in the JSON report")
    if world_size > 0:
        missing = sorted(set(range(world_size)) - set(ranks))
        if missing:
            lines.append(f"  no trace from ranks {missing}")
    return "\n".join(lines)
