"""Each rank's trace, the input of the hang analysis (hybridpar.diagnostics.flight): the flight
recorder's recent collectives (torch records them for gloo and nccl alike), each group's issued
and completed counts, and where the rank's Python main thread is. The live watchdog sends traces
through the job's store; `hybridpar hang-report DIR` reads them from dump files."""

from __future__ import annotations

import dataclasses
import os
import json
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

RECENT = 16  # collectives kept per group in a trace: enough to compare orders around a hang
_ROOTED = ("scatter", "gather")


@dataclasses.dataclass
class Collective:
    seq: int  # the group's sequence number of this collective (1 = its first)
    op: str  # backend prefix dropped: 'all_reduce', '_allgather_base', ...
    sizes: list  # input tensor sizes
    order: int  # the rank's record id: the order in which this rank issued its collectives

    def signature(self) -> tuple:
        # Rooted calls differ by design: only the root passes the list it scatters or gathers into.
        if self.op in _ROOTED:
            return (self.op,)
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
class P2P:
    """A send or receive of this rank's that has not completed (diagnostics.p2p records them: gloo's
    flight recorder has no P2P entries). `n` counts this rank's ops of this kind with this peer on
    this group, from 1: the peer's matching op is its n-th of the other kind with this rank."""

    op: str  # 'send' or 'recv'
    peer: int  # the peer's global rank; -1: a receive from any rank
    group: str  # the process group's name
    dim: str  # its mesh dimension ('pp': the position in `ranks` is the pipeline stage)
    ranks: list[int]  # the group's global ranks
    n: int
    sizes: list

    @staticmethod
    def key(group: str, op: str, peer: int) -> str:
        """A rank's count of issued ops is keyed so (the `issued` of its trace)."""
        return f"{group} {op} {peer}"

    def counterpart(self, rank: int) -> str:
        """The key under which the peer counts the op that matches this one of `rank`'s."""
        return P2P.key(self.group, "send" if self.op == "recv" else "recv", rank)

    def who(self, rank: int) -> str:
        """'rank 3 (stage 1)' on a pipeline group, else 'rank 3'. The stage is the rank's position in
        the group: under an interleaved schedule its first stage (it also holds stage + pp, ...)."""
        stage = f" (stage {self.ranks.index(rank)})" if self.dim == "pp" and rank in self.ranks else ""
        return f"rank {rank}{stage}"

    def describe(self, rank: int) -> str:
        """'recv #3 from rank 1 (stage 1) on the pp group [0, 1]', as `rank` issued it."""
        peer = "any rank" if self.peer < 0 else self.who(self.peer)
        return f"{self.op} #{self.n} {'to' if self.op == 'send' else 'from'} {peer} on the {self.dim} group {self.ranks}"


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
    p2p: list[P2P] = dataclasses.field(default_factory=list)  # its sends and receives not complete
    p2p_issued: dict[str, int] = dataclasses.field(default_factory=dict)  # P2P.key -> ops issued

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
        return RankTrace(**{**data, "groups": groups, "p2p": [P2P(**p) for p in data.get("p2p", [])]})


def where(stack: list[str]) -> str:
    if not stack:
        return "(no Python stack)"
    own = [i for i, frame in enumerate(stack) if not _is_library(frame)]
    if not own:
        return stack[-1]
    i = own[-1]
    below = [frame for frame in stack[i + 1:] if not _is_pass_through(frame)]
    return stack[i] + (f"  ->  {below[-1].rsplit(' in ', 1)[-1]}()" if below else "")


# hybridpar's own pass-throughs to torch.distributed (file, its functions; None: all of them): a rank
# waiting in a collective is at their caller's line, not in them.
_PASS_THROUGH = {
    os.path.join("hybridpar", "compat", "torch.py"): None,
    os.path.join("hybridpar", "diagnostics", "wrap.py"): None,  # the one layer over torch.distributed
    os.path.join("hybridpar", "diagnostics", "stragglers.py"): ("_timing",),  # its timer's sync around a call
}


def _is_library(frame: str) -> bool:
    """Frames of torch itself, the threading and context machinery and pass-throughs: not where a
    user's code waits."""
    path = frame.split(":", 1)[0]
    torch_or_threads = path.startswith("torch" + os.sep) or (os.sep + "torch" + os.sep) in path
    machinery = path.endswith("threading.py") or path.endswith("contextlib.py")
    return torch_or_threads or machinery or _is_pass_through(frame)


def _is_pass_through(frame: str) -> bool:
    path, function = frame.split(":", 1)[0], frame.rsplit(" in ", 1)[-1]
    return any(path.endswith(file) and (functions is None or function in functions)
               for file, functions in _PASS_THROUGH.items())


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
    """This process's flight recorder: recent collectives of every group (no C++ stacks: slow to
    collect); NCCL's recorder and the other backends' in one dump."""
    from ..compat.torch import flight_recorder_dumps  # torch only when a dump is asked for
    from ..safe_pickle import loads, no_globals

    dump, *others = [loads(d, no_globals, "this process's flight recorder", "a flight-recorder dump")
                     for d in flight_recorder_dumps()]
    for other in others:
        dump["entries"] = list(dump.get("entries") or []) + list(other.get("entries") or [])
        for key in ("pg_config", "pg_status"):
            dump[key] = {**(dump.get(key) or {}), **(other.get(key) or {})}
    return dump


# hybridpar's own dump files: JSON (a format that cannot carry code), naming themselves as dumps.
DUMP_FORMAT = "hybridpar flight-recorder dump"


def dump_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"flight_recorder_rank_{rank}.json"


def write_dump(folder: Path, rank: int, dump: dict) -> None:
    from ..files import write_text_atomic

    write_text_atomic(dump_path(folder, rank), json.dumps({"format": DUMP_FORMAT, **dump}, default=str))


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
        known.setdefault(name, {"dim": dim_from_desc(desc), "ranks": _ranks_from_config(dump, name)})
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
    p2p = info.get("p2p") or {}
    pending = [P2P(**{**op, "dim": known.get(op["group"], {}).get("dim", op["dim"])}) for op in p2p.get("pending", [])]
    return RankTrace(rank=int(rank), groups=groups, p2p=pending, p2p_issued=dict(p2p.get("issued", {})), **fields)


def _group_of(entry: dict) -> tuple[str, str]:
    pg = entry.get("process_group") or ("", "")
    return str(pg[0]), str(pg[1] if len(pg) > 1 else "")


def _op(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1]


def _plain(sizes: Any) -> list:
    return [list(s) for s in sizes or []]


def dim_from_desc(desc: str) -> str:
    if desc in ("default_pg", ""):
        return "world" if desc else "?"
    return desc[len("mesh_"):] if desc.startswith("mesh_") else desc


def _ranks_from_config(dump: dict, name: str) -> list[int]:
    entry = (dump.get("pg_config") or {}).get(name) or {}
    return [int(r) for r in re.findall(r"\d+", str(entry.get("ranks", "")))]


def _completed(entries: list[dict], status: dict, pg_names: dict, name: str) -> Optional[int]:
    """Completed count: the recorder's per-group status (gloo and nccl), else entry states (nccl).
    gloo's status counts every op of the group, sends and receives included (an entry's op_id),
    while entries are numbered among collectives only (collective_seq_id): on a group that carries
    P2P ops as well (a pipeline's), the last collective at or before the completed op. (Seen on
    gloo with torch 2.13; other backends' numbers are taken as they are.)"""
    for pg_id, s in status.items():
        if pg_names.get(str(pg_id)) == name and isinstance(s, dict) and "last_completed_collective" in s:
            last = int(s["last_completed_collective"])
            if not all("op_id" in e and str(e.get("profiling_name", "")).startswith("gloo:") for e in entries):
                return last
            done = [int(e["collective_seq_id"]) for e in entries if int(e["op_id"]) <= last]
            return max(done) if done else min(int(e["collective_seq_id"]) for e in entries) - 1
    done = [int(e["collective_seq_id"]) for e in entries if e.get("state") == "completed"]
    return max(done) if done else None


def _read_dump(path: Path) -> Optional[dict]:
    """The dump in file `path`, None when it is not one. hybridpar's own are JSON; torch's
    (TORCH_FR_DUMP_TEMP_FILE, named by the rank) are pickles of plain containers, read without
    importing any global: a pickle that names one raises UnsafePickleError."""
    from ..safe_pickle import UnsafePickleError, loads, no_globals

    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            dump = json.loads(data)
        except ValueError:
            return None
        return dump if isinstance(dump, dict) and dump.get("format") == DUMP_FORMAT else None
    if not _RANK_NAME.search(path.name) or not data.startswith(b"\x80"):  # a pickle starts with PROTO
        return None
    try:
        dump = loads(data, no_globals, str(path), "a flight-recorder dump")
    except UnsafePickleError:  # said, never skipped
        raise
    except Exception:  # noqa: BLE001 - bytes that are no pickle of plain data: not a dump
        return None
    return dump if isinstance(dump, dict) and "version" in dump and isinstance(dump.get("entries"), list) else None


_RANK_NAME = re.compile(r"(\d+)(\.pkl|\.pickle|\.json)?$")


def load_dumps(folder: Path) -> tuple[dict[int, RankTrace], int, list[Path]]:
    """Every flight-recorder dump in a folder: hybridpar's (`flight_recorder_rank_R.json`) and
    torch's own (any name ending in the rank number) -> ({rank: trace}, the world size if known,
    else -1, the files that are not dumps). A rank's hybridpar dump wins over torch's: it knows the
    mesh. A pickle naming a global raises UnsafePickleError (nothing of it is run)."""
    traces, world, skipped, informed = {}, -1, [], set()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        dump = _read_dump(path)
        if dump is None:
            skipped.append(path)
            continue
        info = dict(dump.get("hybridpar") or {})
        if "rank" not in info:
            named = _RANK_NAME.search(path.name)
            if named is None:
                skipped.append(path)
                continue
            info["rank"] = int(named.group(1))
        world = max(world, int(info.get("world_size", -1)))
        trace = trace_from_dump(dump, info)
        if trace.rank in informed and not dump.get("hybridpar"):
            continue
        if dump.get("hybridpar"):
            informed.add(trace.rank)
        traces[trace.rank] = trace
    return traces, world, skipped
