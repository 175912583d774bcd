"""The collectives a rank issues, counted as they happen: a listener of diagnostics.wrap.

    with CollectiveCounter(label=mesh_dims(parallel)) as counter:
        train_step()
    counter.wire_bytes()      # per rank, ring-algorithm bytes sent (the nccl-tests bus formulas)
    counter.summary()         # per (op, group size): calls, payload bytes, wire bytes
    counter.by_dim()          # per mesh dimension (mp, dp_shard, ...): calls, bytes, seconds
    counter.p2p_totals()      # with p2p=True: a pipeline's sends and receives, their waits included

bench/comm.py sets them against the analytic minimum; the trainer's profiler labels each call in the
trace with its mesh dimension.

The calls are those of diagnostics.wrap.COLLECTIVES, the same the straggler timer sees. Aliases that
call another wrapped function (all_gather_into_tensor -> all_gather_single) are counted once: only
the outermost call; a barrier is a call that moves nothing. Point-to-point ops (wrap.P2P: a
pipeline's sends and receives) are not collectives: counted only when asked (`p2p`), apart from
them (p2p_totals, never in by_dim or summary), a batch_isend_irecv as one call of its ops.

Units. `payload` is the tensor a rank hands to the collective: the buffer for all_reduce and
broadcast, the gathered output for all_gather, the input for reduce_scatter. `wire` is what a
bandwidth-optimal (ring) algorithm sends from each rank, the quantity NCCL's bus bandwidth is
defined by: all_reduce 2(n-1)/n x payload, all_gather / reduce_scatter / broadcast / all_to_all
(n-1)/n x payload. A group of one moves nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from .wrap import P2P_KINDS, WAIT, Call, Listener

def wire_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per payload byte with a ring algorithm over n ranks."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _payload(call: Call) -> int:
    """The bytes of the payload argument of a call, by position or keyword (see Units above)."""
    name, args, kwargs = call.name, call.args, call.kwargs
    if name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        obj = kwargs.get("output_tensor", args[0] if args else None)
    elif name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        obj = kwargs.get("input", args[1] if len(args) > 1 else None)
    elif name == "all_to_all_single":
        obj = kwargs.get("input", args[1] if len(args) > 1 else None)
    elif name in ("all_gather", "all_gather_coalesced"):
        obj = kwargs.get("tensor_list", kwargs.get("output_tensor_lists", args[0] if args else None))
    elif name in ("reduce_scatter", "all_to_all"):
        obj = kwargs.get("input_list", args[1] if len(args) > 1 else None)
    elif name == "barrier":
        obj = None
    elif name == "batch_isend_irecv":
        obj = [op.tensor for op in kwargs.get("p2p_op_list", args[0] if args else [])]
    else:  # all_reduce, all_reduce_coalesced, broadcast, reduce: the first argument is the buffer
        obj = kwargs.get("tensor", kwargs.get("tensors", args[0] if args else None))
    return _nbytes(obj)


def _sent(call: Call, group) -> Optional[float]:
    """Bytes an all_to_all_single with input split sizes sends to other ranks (its own chunk stays)."""
    if call.name != "all_to_all_single":
        return None
    splits = call.kwargs.get("input_split_sizes", call.args[3] if len(call.args) > 3 else None)
    if not splits:
        return None
    own = splits[dist.get_rank(group) if group is not None else dist.get_rank()]
    return _payload(call) * (sum(splits) - own) / sum(splits)


def mesh_dims(parallel) -> Callable[[object], str]:
    """group -> the mesh dimension it belongs to ("mp", "dp_shard", "dp_replicate", "dp", "world"),
    for labelling a collective; a group of no dimension (made by someone else) is "other"."""
    from ..mesh.device import mesh_groups

    names = {group.group_name: dim for dim, group in mesh_groups(parallel)}
    world = dist.group.WORLD.group_name if dist.group.WORLD is not None else None

    def label(group) -> str:
        name = group.group_name if group is not None else world  # None: the default (world) group
        return names.get(name, "other")

    return label


@dataclasses.dataclass
class Record:
    kind: str
    group_size: int
    payload: int
    dim: str = ""  # the mesh dimension, when the counter labels groups
    seconds: float = 0.0  # inside the call: the transfer, plus waiting for peers (async ops: the launch)
    cpu_seconds: float = 0.0  # this process's CPU time inside the call (gloo does not spin while waiting)

    sent: Optional[float] = None  # bytes sent when known from the call (all-to-all with split sizes)
    wait_seconds: float = 0.0  # an async call's Work.wait, when the counter follows waits
    ops: int = 1  # sends and receives of a batch_isend_irecv (1 for any other call)

    @property
    def p2p(self) -> bool:
        """A send, a receive or a batch of them (counted only with CollectiveCounter's `p2p`)."""
        return self.kind in P2P_KINDS

    @property
    def wire(self) -> float:
        return self.sent if self.sent is not None else self.payload * wire_factor(self.kind, self.group_size)


class CollectiveCounter(Listener):
    """Counts collectives issued through torch.distributed while active (`with counter:`, a
    listener of diagnostics.wrap). Each call of a collective that moves tensors is one record; an
    alias calling torch's new name counts once, and the object collectives (all_gather_object,
    broadcast_object_list) count as the tensor collectives they issue, whose bytes are known.

    `enabled` can be toggled to count selected steps. `label(group)` names each call's mesh
    dimension (mesh_dims); with `profile`, each counted call is also a torch.profiler range,
    "collective <kind> [<dim>]", so that a trace shows which dimension's traffic a step waits for.
    With `waits`, an async call's Work.wait counts too (its seconds in wait_seconds, its range in
    the trace): where FSDP's prefetched gathers are waited for. With `p2p`, a pipeline's sends and
    receives are records too (kinds "send", "recv", "p2p_batch"; ranges "p2p <kind> [<dim>]"), kept
    out of the collectives' sums (by_dim, summary) and summed by p2p_totals: with `waits`, the
    waits for their Works, where a stage idles for its neighbour (the pipeline's bubble), included.
    """

    def __init__(self, enabled: bool = True, label: Optional[Callable[[object], str]] = None,
                 profile: bool = False, waits: bool = False, p2p: bool = False) -> None:
        self.records: list[Record] = []
        self.enabled = enabled
        self.label = label
        self.profile = profile
        self.waits = waits
        self.p2p = p2p
        self._pending: dict[int, tuple[object, Record]] = {}  # id(work) -> (work, its call's record)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._pending.clear()

    def around(self, call: Call):
        if call.kind == WAIT:
            work, record = self._pending.pop(id(call.work), (None, None))
            return self._waiting(record) if work is not None and work is call.work else None
        if call.is_p2p:  # the outermost: a batch_isend_irecv, not the isend and irecv it issues
            counted = self.p2p and (call.outer is None or not call.outer.is_p2p)
        else:  # the outermost call of those that move tensors: an object collective's tensor calls are its bytes
            counted = call.kind != "object" and (call.outer is None or call.outer.kind == "object")
        return self._counting(call) if counted and self.enabled else None

    def _span(self, record: Record, what: str):
        if not self.profile:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"{what} {record.kind} [{record.dim or f'n{record.group_size}'}]")

    @contextlib.contextmanager
    def _counting(self, call: Call) -> Iterator[None]:
        group = call.group
        n = dist.get_world_size(group) if group is not None else dist.get_world_size()
        record = Record(call.kind, n, _payload(call), dim=self.label(group) if self.label is not None else "",
                        sent=_sent(call, group), ops=len(call.args[0]) if call.kind == "p2p_batch" else 1)
        self.records.append(record)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            with self._span(record, "p2p" if record.p2p else "collective"):
                yield
            if self.waits:
                for work in _works(call):
                    self._pending[id(work)] = (work, record)
        finally:
            record.seconds = time.perf_counter() - start
            record.cpu_seconds = time.process_time() - cpu_start

    @contextlib.contextmanager
    def _waiting(self, record: Record) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with self._span(record, "wait"):
                yield
        finally:
            record.wait_seconds += time.perf_counter() - start

    def reset(self) -> None:
        self.records.clear()

    def _collectives(self) -> list[Record]:
        return [r for r in self.records if not r.p2p]

    def wire_bytes(self) -> float:
        return sum(r.wire for r in self._collectives())

    def payload_bytes(self) -> int:
        return sum(r.payload for r in self._collectives())

    def seconds(self) -> float:
        return sum(r.seconds for r in self._collectives())

    def cpu_seconds(self) -> float:
        return sum(r.cpu_seconds for r in self._collectives())

    def _totals(self, key, p2p: bool = False) -> dict:
        """The collectives' records (`p2p`: the sends' and receives' instead) summed by `key(record)`:
        calls (a batch's sends and receives each), payload, wire, seconds (with the waits for async
        calls, when followed) and CPU seconds, in the keys' order."""
        rows: dict = defaultdict(lambda: {"calls": 0, "payload": 0, "wire": 0.0, "seconds": 0.0, "cpu_seconds": 0.0})
        for r in self.records:
            if r.p2p != p2p:
                continue
            row = rows[key(r)]
            row["calls"] += r.ops
            row["payload"] += r.payload
            row["wire"] += r.wire
            row["seconds"] += r.seconds + r.wait_seconds
            row["cpu_seconds"] += r.cpu_seconds
        return dict(sorted(rows.items()))

    def by_dim(self) -> dict[str, dict]:
        """{"<dim>": {"calls", "payload", "wire", "seconds", ...}}: the collectives of each mesh dimension."""
        return self._totals(lambda r: r.dim or f"n{r.group_size}")

    def p2p_totals(self) -> dict:
        """{"calls", "payload", "seconds", ...} of the sends and receives (`p2p`): calls are the
        sends and receives, seconds the time in them and, with `waits`, in the waits for them."""
        empty = {"calls": 0, "payload": 0, "wire": 0.0, "seconds": 0.0, "cpu_seconds": 0.0}
        return self._totals(lambda r: "p2p", p2p=True).get("p2p", empty)

    def by_dim_and_op(self) -> list[dict]:
        """One row per (mesh dimension, collective): dim, op, group_size, calls, payload and wire
        bytes (no times: the same for a real step and a dry-run one), mesh dimensions in mesh order."""
        order = {"mp": 0, "dp_shard": 1, "dp_replicate": 2, "dp": 3, "world": 4}
        totals = self._totals(lambda r: (order.get(r.dim, 9), r.dim, r.kind, r.group_size))
        return [{"dim": dim, "op": op, "group_size": n, "calls": t["calls"], "payload": t["payload"],
                 "wire": t["wire"]} for (_, dim, op, n), t in totals.items()]

    def summary(self) -> dict[str, dict]:
        """{"<kind>/n<group size>": {"calls", "payload", "wire", "seconds", "cpu_seconds"}} in a stable order."""
        return self._totals(lambda r: f"{r.kind}/n{r.group_size}")


def _works(call: Call) -> list:
    """The Works a call returned to be waited for: an async collective's, a send's or receive's, a
    batch_isend_irecv's list (a blocking call returns none)."""
    if call.result is None or not (call.async_op or call.is_p2p):
        return []
    return list(call.result) if isinstance(call.result, (list, tuple)) else [call.result]


