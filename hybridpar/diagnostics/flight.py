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
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterable, Optional

from .liveness import says_peer_loss
from .traces import Collective, GroupTrace, RankTrace

__all__ = ["Finding", "Wait", "Verdict", "analyse", "format_report"]


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
class Verdict:
    findings: list[Finding]
    waits: list[Wait]
    traces: dict[int, RankTrace]
    dead: list[int]
    # What is known of ranks without a trace (dead): host, pid, coords and the last step and phase
    # their heartbeat gave; filled in by the live monitor.
    gone: dict[int, dict] = dataclasses.field(default_factory=dict)

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
            "ranks": {
                str(r): {"host": t.host, "pid": t.pid, "coords": t.coords, "step": t.step, "phase": t.phase,
                         "where": t.where, "note": t.note,
                         "waiting_in": [f"{g.dim} {c.op} #{c.seq}" for g, c in t.pending()]}
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
    findings = [_dead_finding(d, waits) for d in dead] + _mismatches(traces)
    blamed = {r for f in findings for r in f.ranks}
    for w in waits:
        for r in w.missing:
            if r in blamed or r in dead or r not in traces:
                continue
            t = traces[r]
            pending = t.pending()
            raised = t.note.startswith("raised")
            if not pending:
                if raised:
                    continue  # it failed outside any collective: reported below as 'failed'
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
    for r, t in sorted(traces.items()):
        if t.note.startswith("raised") and r not in blamed:
            g, c = (t.pending() or [(None, None)])[0]
            inside = f" in {c.op} #{c.seq} on the {g.dim} group {g.ranks}" if c else ""
            findings.append(Finding("failed", [r], g.dim if g else "", g.ranks if g else [], c.op if c else "",
                                    c.seq if c else 0, f"rank {r} {t.note}{inside} ({t.where})"))
    # A mismatch is a definite bug and can kill a peer (gloo aborts on a size mismatch): first.
    order = {"mismatch": 0, "dead": 1, "not_arrived": 2, "skipped": 3, "order": 4, "failed": 5}
    findings.sort(key=lambda f: order[f.kind])
    return Verdict(findings, waits, traces, dead)


def _dead_finding(d: int, waits: list[Wait]) -> Finding:
    blocked = [w for w in waits if d in w.missing]
    if not blocked:
        return Finding("dead", [d], "", [], "", 0, f"rank {d} is gone (no heartbeat or no trace)")
    w = blocked[0]
    return Finding("dead", [d], w.dim, w.group, w.op, w.seq,
                   f"rank {d} is gone: ranks {w.waiting} wait for it in {w.op} #{w.seq} on the {w.dim} group {w.group}")


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
        lines.append("CAUSE  not found: every rank waits in matching collectives (a network or driver problem? "
                     "run `hybridpar doctor` on these nodes)")
    if verdict.waits:
        lines.append("WAITING")
        for w in verdict.waits[:8]:
            missing = f", missing {w.missing}" if w.missing else ""
            lines.append(f"  {w.op} #{w.seq} on the {w.dim} group {w.group}: waiting {w.waiting}{missing}")
        if len(verdict.waits) > 8:
            lines.append(f"  ... and {len(verdict.waits) - 8} more groups")
    lines.append("WHERE EACH RANK IS")
    ranks = sorted(set(verdict.traces) | set(verdict.dead))
    shown = ranks if len(ranks) <= 16 else sorted(set(verdict.culprits) | set(ranks[:8]))[:16]
    for r in shown:
        t = verdict.traces.get(r)
        if t is None:
            g = verdict.gone.get(r)
            last = f"{g.get('host', '?'):<12} step {g.get('step', '?'):<5} {g.get('phase', '?'):<10} " if g else ""
            lines.append(f"  rank {r:>4}  {last}gone")
            continue
        waiting = ", ".join(f"{g.dim} {c.op} #{c.seq}" for g, c in t.pending()) or "not in a collective"
        lines.append(f"  rank {r:>4}  {t.host:<12} step {t.step:<5} {t.phase:<10} {waiting:<28} {t.where}")
    if len(shown) < len(ranks):
        lines.append(f"  ... {len(ranks) - len(shown)} more ranks in the JSON report")
    if world_size > 0:
        missing = sorted(set(range(world_size)) - set(ranks))
        if missing:
            lines.append(f"  no trace from ranks {missing}")
    return "\n".join(lines)
