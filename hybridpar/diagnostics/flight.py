"""What every rank was doing when a job stopped making progress, and who is to blame.

The input is one trace per rank: the flight recorder's recent collectives (torch records them for
gloo and nccl alike: `torch._C._distributed_c10d._dump_fr_trace`), each group's issued and
completed counts, and where the rank's Python main thread is. The same analysis serves the live
watchdog (traces sent through the job's store) and `hybridpar hang-report DIR` (dump files).

Collectives are matched per group by sequence number: the n-th collective a group's members issue
is the same call. Groups of one mesh dimension run the same program, so a sequence number also
compares across them (the mp group of ranks 0-1 and that of ranks 2-3 issue the same n-th call).
Culprits, in order of confidence:
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
import os
import pickle
import re
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional

RECENT = 16  # collectives kept per group in a trace: enough to compare orders around a hang


@dataclasses.dataclass
class Collective:
    seq: int  # the group's sequence number of this collective (1 = its first)
    op: str  # backend prefix dropped: 'all_reduce', '_allgather_base', ...
    sizes: list  # input tensor sizes
    order: int  # the rank's record id: the order in which this rank issued its collectives

    def signature(self) -> tuple:
        return self.op, repr(self.sizes)

    def describe(self) -> str:
        sizes = ", ".join("x".join(str(d) for d in s) or "scalar" for s in self.sizes)
        return f"{self.op}[{sizes}]"


@dataclasses.dataclass
class GroupTrace:
    name: str  # the process group's name, the same on every rank
    dim: str  # 'mp', 'dp', 'dp_shard', 'dp_replicate', 'world' or the group's description
    ranks: list[int]  # global ranks; empty when unknown
    issued: int  # collectives this rank has issued on the group
    completed: Optional[int]  # ... and seen complete (None: unknown)
    recent: list[Collective]

    @property
    def pending(self) -> Optional[Collective]:
        """The collective this rank waits in on this group, if any."""
        if self.completed is None or self.completed >= self.issued:
            return None
        return self.at(self.completed + 1)

    def at(self, seq: int) -> Optional[Collective]:
        return next((c for c in self.recent if c.seq == seq), None)


@dataclasses.dataclass
class RankTrace:
    rank: int
    host: str = "?"
    pid: int = 0
    coords: str = ""  # 'mp 1, dp 0 (replicate 0, shard 0)'
    step: int = 0
    phase: str = ""
    stack: list[str] = dataclasses.field(default_factory=list)  # 'file:line in func', outermost first
    groups: dict[str, GroupTrace] = dataclasses.field(default_factory=dict)
    note: str = ""  # e.g. the exception a rank raised

    def pending(self) -> list[tuple[GroupTrace, Collective]]:
        return [(g, g.pending) for g in self.groups.values() if g.pending is not None]

    @property
    def where(self) -> str:
        """The innermost line of the rank's own code (outside torch), and the torch call under it."""
        return where(self.stack)

    @staticmethod
    def from_json(data: dict) -> "RankTrace":
        groups = {
            name: GroupTrace(**{**g, "recent": [Collective(**c) for c in g["recent"]]})
            for name, g in data.get("groups", {}).items()
        }
        return RankTrace(**{**data, "groups": groups})


def where(stack: list[str]) -> str:
    if not stack:
        return "(no Python stack)"
    own = [i for i, frame in enumerate(stack) if not _is_library(frame)]
    if not own:
        return stack[-1]
    i = own[-1]
    below = stack[i + 1:]
    return stack[i] + (f"  ->  {below[-1].rsplit(' in ', 1)[-1]}()" if below else "")


def _is_library(frame: str) -> bool:
    """Frames of torch itself (and the threading machinery): not where a user's code waits."""
    path = frame.split(":", 1)[0]
    return path.startswith("torch" + os.sep) or (os.sep + "torch" + os.sep) in path or path.endswith("threading.py")


def short_message(error: BaseException, limit: int = 120) -> str:
    """The first line of an error, without the C++ source location gloo and nccl put in front."""
    text = (str(error).splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_stack(error: BaseException) -> tuple[list[str], Optional[str]]:
    """Where an exception was raised ('file:line in func', outermost first) and, when it came out of
    a torch.distributed collective, that collective's group name."""
    frames, group_name = [], None
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append(f"{_short(code.co_filename)}:{tb.tb_lineno} in {code.co_name}")
        if code.co_filename.endswith("distributed_c10d.py") and "group" in tb.tb_frame.f_locals:
            group = tb.tb_frame.f_locals["group"]
            group_name = getattr(group, "group_name", None) or "0"  # None: the default (world) group
        tb = tb.tb_next
    return frames[-40:], group_name


def python_stack(thread_id: int) -> list[str]:
    """'file:line in func' frames of a thread, outermost first (cheap: no source lines read)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return []
    frames = [f"{_short(f.f_code.co_filename)}:{line} in {f.f_code.co_name}" for f, line in traceback.walk_stack(frame)]
    return frames[:40][::-1]


def _short(filename: str) -> str:
    """Paths relative to site-packages or the working directory: shorter reports, same meaning."""
    marker = "site-packages" + os.sep
    if marker in filename:
        return filename.split(marker, 1)[1]
    try:
        return os.path.relpath(filename)
    except ValueError:
        return filename


# ---------------------------------------------------------------------------------------------
# Flight-recorder dumps -> traces


def dump_flight_recorder() -> dict:
    """This process's flight recorder: recent collectives of every group (no C++ stacks: they cost seconds)."""
    import torch

    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))


def trace_from_dump(dump: dict, info: Optional[dict] = None) -> RankTrace:
    """One rank's trace from its flight-recorder dump; `info` (rank, host, groups, stack...) adds what
    hybridpar knows about the mesh. Any backend's prefix ('gloo:', 'nccl:') is accepted."""
    info = dict(info or dump.get("hybridpar") or {})
    known: dict[str, dict] = dict(info.get("groups", {}))  # a copy: groups found below are not the caller's
    by_group: dict[str, list[dict]] = {}
    pg_names: dict[str, str] = {}  # the recorder's local pg id -> group name
    for e in dump.get("entries", []):
        if e.get("is_p2p"):
            continue
        name, desc = _group_of(e)
        pg_names[str(e.get("pg_id"))] = name
        by_group.setdefault(name, []).append(e)
        known.setdefault(name, {"dim": _dim_from_desc(desc), "ranks": _ranks_from_config(dump, name)})
    status = dump.get("pg_status", {})
    groups = {}
    for name, entries in by_group.items():
        recent = [Collective(int(e["collective_seq_id"]), _op(e["profiling_name"]), _plain(e.get("input_sizes")),
                             int(e.get("record_id", 0))) for e in entries[-RECENT:]]
        issued, completed = recent[-1].seq, _completed(entries, status, pg_names, name)
        if name == info.get("failed_in") and completed is not None:
            completed = min(completed, issued - 1)  # its last collective raised: it never completed
        groups[name] = GroupTrace(name, known[name]["dim"], list(known[name]["ranks"]), issued, completed, recent)
    rank = info.get("rank", dump.get("rank", -1))
    fields = {k: info[k] for k in ("host", "pid", "coords", "step", "phase", "stack", "note") if k in info}
    return RankTrace(rank=int(rank), groups=groups, **fields)


def _group_of(entry: dict) -> tuple[str, str]:
    pg = entry.get("process_group") or ("", "")
    return str(pg[0]), str(pg[1] if len(pg) > 1 else "")


def _op(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1]


def _plain(sizes: Any) -> list:
    return [list(s) for s in sizes or []]


def _dim_from_desc(desc: str) -> str:
    if desc in ("default_pg", ""):
        return "world" if desc else "?"
    return desc[len("mesh_"):] if desc.startswith("mesh_") else desc


def _ranks_from_config(dump: dict, name: str) -> list[int]:
    entry = (dump.get("pg_config") or {}).get(name) or {}
    return [int(r) for r in re.findall(r"\d+", str(entry.get("ranks", "")))]


def _completed(entries: list[dict], status: dict, pg_names: dict, name: str) -> Optional[int]:
    """Completed count: the recorder's per-group status (gloo and nccl), else entry states (nccl)."""
    for pg_id, s in status.items():
        if pg_names.get(str(pg_id)) == name and isinstance(s, dict) and "last_completed_collective" in s:
            return int(s["last_completed_collective"])
    done = [int(e["collective_seq_id"]) for e in entries if e.get("state") == "completed"]
    return max(done) if done else None


def load_dumps(folder: Path) -> tuple[dict[int, RankTrace], int]:
    """Every flight-recorder dump in a folder (one file per rank, any name ending in the rank number)
    -> ({rank: trace}, the world size if known, else -1)."""
    traces, world = {}, -1
    files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file() and re.search(r"\d+(\.pkl|\.pickle)?$", p.name)]
    for path in files:
        try:
            dump = pickle.loads(path.read_bytes())
        except Exception:  # not a dump: other files may share the folder
            continue
        if not isinstance(dump, dict) or "entries" not in dump:
            continue
        info = dict(dump.get("hybridpar") or {})
        if "rank" not in info:
            info["rank"] = int(re.search(r"(\d+)(\.pkl|\.pickle)?$", path.name).group(1))
        world = max(world, int(info.get("world_size", -1)))
        trace = trace_from_dump(dump, info)
        traces[trace.rank] = trace
    return traces, world


# ---------------------------------------------------------------------------------------------
# The analysis


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

    @property
    def culprits(self) -> list[int]:
        return sorted({r for f in self.findings for r in f.ranks})

    def to_json(self) -> dict:
        return {
            "culprits": self.culprits,
            "dead": self.dead,
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
    findings: list[Finding] = []
    waits = _waits(traces, groups, dead, last_issued)

    for d in dead:
        blocked = [w for w in waits if d in w.missing]
        if blocked:
            w = blocked[0]
            findings.append(Finding("dead", [d], w.dim, w.group, w.op, w.seq,
                                    f"rank {d} is gone: ranks {w.waiting} wait for it in {w.op} #{w.seq} "
                                    f"on the {w.dim} group {w.group}"))
        else:
            findings.append(Finding("dead", [d], "", [], "", 0, f"rank {d} is gone (no heartbeat or no trace)"))

    findings += _mismatches(traces)
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
    for f in [f for f in verdict.findings if f.kind == "failed"][:4]:
        lines.append(("THEN   " if causes else "CAUSE  ") + f.text)
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
            lines.append(f"  rank {r:>4}  gone")
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
