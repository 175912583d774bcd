"""The collectives a rank issues, counted as they happen: a counter that wraps torch.distributed.

    with CollectiveCounter(label=mesh_dims(parallel)) as counter:
        train_step()
    counter.wire_bytes()      # per rank, ring-algorithm bytes sent (the nccl-tests bus formulas)
    counter.summary()         # per (op, group size): calls, payload bytes, wire bytes
    counter.by_dim()          # per mesh dimension (mp, dp_shard, ...): calls, bytes, seconds

bench/comm.py sets them against the analytic minimum; the trainer's profiler labels each call in the
trace with its mesh dimension.

FSDP2 (`_fsdp_collectives`), FSDP1 (`_flat_param`, `_runtime_utils`), fairscale's mappings and
hybridpar's all call the module functions of torch.distributed at call time (`dist.all_reduce(...)`),
so replacing those attributes sees every collective they issue. Aliases that call another wrapped
function (all_gather_into_tensor -> all_gather_single) are counted once: only the outermost call.

Units. `payload` is the tensor a rank hands to the collective: the buffer for all_reduce and
broadcast, the gathered output for all_gather, the input for reduce_scatter. `wire` is what a
bandwidth-optimal (ring) algorithm sends from each rank, the quantity NCCL's bus bandwidth is
defined by: all_reduce 2(n-1)/n x payload, all_gather / reduce_scatter / broadcast / all_to_all
(n-1)/n x payload. A group of one moves nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.compiler import is_compiling

# name -> (kind, which argument holds the payload). Kinds decide the wire factor.
_WRAPPED = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_single": ("all_gather", "output"),
    "all_gather_into_tensor": ("all_gather", "output"),
    "_all_gather_base": ("all_gather", "output"),
    "all_gather_coalesced": ("all_gather", "tensor_lists"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_list"),
}


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


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    """The payload argument of a call, by position or keyword, per `_WRAPPED`."""
    kind, _ = _WRAPPED[name]
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
    else:  # all_reduce, all_reduce_coalesced, broadcast, reduce: the first argument is the buffer
        obj = kwargs.get("tensor", kwargs.get("tensors", args[0] if args else None))
    return _nbytes(obj)


def _sent(name: str, args: tuple, kwargs: dict, group) -> Optional[float]:
    """Bytes an all_to_all_single with input split sizes sends to other ranks (its own chunk stays)."""
    if name != "all_to_all_single":
        return None
    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
    if not splits:
        return None
    own = splits[dist.get_rank(group) if group is not None else dist.get_rank()]
    return _payload(name, args, kwargs) * (sum(splits) - own) / sum(splits)


def _group_of(args: tuple, kwargs: dict, name: str):
    if "group" in kwargs:
        return kwargs["group"]
    # Positional group: its index per signature (rarely used positionally by the callers we count).
    index = {"all_reduce": 2, "all_reduce_coalesced": 2, "broadcast": 2, "reduce": 3, "all_gather": 2,
             "all_gather_single": 2, "all_gather_into_tensor": 2, "_all_gather_base": 2,
             "all_gather_coalesced": 2, "reduce_scatter": 3, "reduce_scatter_single": 3,
             "reduce_scatter_tensor": 3, "_reduce_scatter_base": 3, "all_to_all_single": 4,
             "all_to_all": 2}[name]
    return args[index] if len(args) > index else None


def mesh_dims(parallel) -> Callable[[object], str]:
    """group -> the mesh dimension it belongs to ("mp", "dp_shard", "dp_replicate", "dp", "world"),
    for labelling a collective; a group of no dimension (made by someone else) is "other"."""
    from ..mesh import mesh_groups

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

    @property
    def wire(self) -> float:
        return self.sent if self.sent is not None else self.payload * wire_factor(self.kind, self.group_size)


class CollectiveCounter:
    """Counts collectives issued through torch.distributed while active (a context manager).

    Only one counter may be active at a time. `enabled` can be toggled to count selected steps.
    `label(group)` names each call's mesh dimension (mesh_dims); with `profile`, each counted call
    is also a torch.profiler range, "collective <kind> [<dim>]", so that a trace shows which
    dimension's traffic a step waits for. With `waits`, an async call's Work.wait counts too (its
    seconds in wait_seconds, its range in the trace): where FSDP's prefetched gathers are waited for.
    """

    _active: Optional["CollectiveCounter"] = None

    def __init__(self, enabled: bool = True, label: Optional[Callable[[object], str]] = None,
                 profile: bool = False, waits: bool = False) -> None:
        self.records: list[Record] = []
        self.enabled = enabled
        self.label = label
        self.profile = profile
        self.waits = waits
        self._originals: dict[tuple[object, str], object] = {}
        self._depth = threading.local()
        self._pending: dict[int, tuple[object, Record]] = {}  # id(work) -> (work, its call's record)

    def _span(self, record: Optional[Record], what: str):
        if record is None or not self.profile:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"{what} {record.kind} [{record.dim or f'n{record.group_size}'}]")

    def _wrap(self, name: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            if is_compiling():  # traced by torch.compile: stay transparent, nothing for dynamo to guard on
                return fn(*args, **kwargs)
            depth = getattr(counter._depth, "n", 0)
            record = None
            if depth == 0 and counter.enabled:
                group = _group_of(args, kwargs, name)
                n = dist.get_world_size(group) if group is not None else dist.get_world_size()
                record = Record(_WRAPPED[name][0], n, _payload(name, args, kwargs),
                                dim=counter.label(group) if counter.label is not None else "",
                                sent=_sent(name, args, kwargs, group))
                counter.records.append(record)
            counter._depth.n = depth + 1
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                with counter._span(record, "collective"):
                    result = fn(*args, **kwargs)
                if record is not None and counter.waits and result is not None and kwargs.get("async_op"):
                    counter._pending[id(result)] = (result, record)
                return result
            finally:
                counter._depth.n = depth
                if record is not None:
                    record.seconds = time.perf_counter() - start
                    record.cpu_seconds = time.process_time() - cpu_start

        wrapper.__wrapped__ = fn
        wrapper.__name__ = name
        return wrapper

    def _wrap_wait(self, original):
        counter = self

        def wait(work, *args, **kwargs):
            entry = counter._pending.pop(id(work), None)
            if entry is None or entry[0] is not work:
                return original(work, *args, **kwargs)
            record, start = entry[1], time.perf_counter()
            try:
                with counter._span(record, "wait"):
                    return original(work, *args, **kwargs)
            finally:
                record.wait_seconds += time.perf_counter() - start

        wait.__wrapped__ = original
        return wait

    def __enter__(self) -> "CollectiveCounter":
        if CollectiveCounter._active is not None:
            raise RuntimeError("another CollectiveCounter is already active")
        CollectiveCounter._active = self
        for module in (dist, c10d):
            for name in _WRAPPED:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                self._originals[(module, name)] = fn
        # One wrapper per original function, installed wherever that function is reachable.
        wrappers: dict[int, object] = {}
        for (module, name), fn in self._originals.items():
            wrapper = wrappers.setdefault(id(fn), self._wrap(name, fn))
            setattr(module, name, wrapper)
        if self.waits:
            self._originals[(dist.Work, "wait")] = dist.Work.wait
            dist.Work.wait = self._wrap_wait(dist.Work.wait)
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), fn in self._originals.items():
            setattr(module, name, fn)
        self._originals.clear()
        CollectiveCounter._active = None

    def reset(self) -> None:
        self.records.clear()

    def wire_bytes(self) -> float:
        return sum(r.wire for r in self.records)

    def payload_bytes(self) -> int:
        return sum(r.payload for r in self.records)

    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def cpu_seconds(self) -> float:
        return sum(r.cpu_seconds for r in self.records)

    def _totals(self, key) -> dict:
        """The records summed by `key(record)`: calls, payload, wire, seconds (with the waits for
        async calls, when followed) and CPU seconds, in the keys' order."""
        rows: dict = defaultdict(lambda: {"calls": 0, "payload": 0, "wire": 0.0, "seconds": 0.0, "cpu_seconds": 0.0})
        for r in self.records:
            row = rows[key(r)]
            row["calls"] += 1
            row["payload"] += r.payload
            row["wire"] += r.wire
            row["seconds"] += r.seconds + r.wait_seconds
            row["cpu_seconds"] += r.cpu_seconds
        return dict(sorted(rows.items()))

    def by_dim(self) -> dict[str, dict]:
        """{"<dim>": {"calls", "payload", "wire", "seconds", ...}}: the traffic of each mesh dimension."""
        return self._totals(lambda r: r.dim or f"n{r.group_size}")

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


