"""Bytes moved by collectives: a counter that wraps torch.distributed, and the analytic minimum.

    with CollectiveCounter() as counter:
        train_step()
    counter.wire_bytes()      # per rank, ring-algorithm bytes sent (the nccl-tests bus formulas)
    counter.summary()         # per (op, group size): calls, payload bytes, wire bytes

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

import dataclasses
import threading
import time
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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


@dataclasses.dataclass
class Record:
    kind: str
    group_size: int
    payload: int
    seconds: float = 0.0  # inside the call: the transfer, plus waiting for peers (async ops: the launch)
    cpu_seconds: float = 0.0  # this process's CPU time inside the call (gloo does not spin while waiting)

    sent: Optional[float] = None  # bytes sent when known from the call (all-to-all with split sizes)

    @property
    def wire(self) -> float:
        return self.sent if self.sent is not None else self.payload * wire_factor(self.kind, self.group_size)


class CollectiveCounter:
    """Counts collectives issued through torch.distributed while active (a context manager).

    Only one counter may be active at a time. `enabled` can be toggled to count selected steps.
    """

    _active: Optional["CollectiveCounter"] = None

    def __init__(self, enabled: bool = True) -> None:
        self.records: list[Record] = []
        self.enabled = enabled
        self._originals: dict[tuple[object, str], object] = {}
        self._depth = threading.local()

    def _wrap(self, name: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._depth, "n", 0)
            record = None
            if depth == 0 and counter.enabled:
                group = _group_of(args, kwargs, name)
                n = dist.get_world_size(group) if group is not None else dist.get_world_size()
                record = Record(_WRAPPED[name][0], n, _payload(name, args, kwargs), sent=_sent(name, args, kwargs, group))
                counter.records.append(record)
            counter._depth.n = depth + 1
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth.n = depth
                if record is not None:
                    record.seconds = time.perf_counter() - start
                    record.cpu_seconds = time.process_time() - cpu_start

        wrapper.__wrapped__ = fn
        wrapper.__name__ = name
        return wrapper

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

    def summary(self) -> dict[str, dict]:
        """{"<kind>/n<group size>": {"calls", "payload", "wire"}} in a stable order."""
        rows: dict[str, dict] = defaultdict(lambda: {"calls": 0, "payload": 0, "wire": 0.0, "seconds": 0.0,
                                                     "cpu_seconds": 0.0})
        for r in self.records:
            row = rows[f"{r.kind}/n{r.group_size}"]
            row["calls"] += 1
            row["payload"] += r.payload
            row["wire"] += r.wire
            row["seconds"] += r.seconds
            row["cpu_seconds"] += r.cpu_seconds
        return dict(sorted(rows.items()))


# --- the analytic minimum ------------------------------------------------------------------------


def mp_local_units(args, mp: int) -> dict[str, int]:
    """Elements per model-parallel rank of each FSDP unit of models.llama.Transformer.

    Split weights count 1/mp; norms (and k/v weights replicated when mp > n_kv_heads) count whole.
    """
    d, hd, hidden = args.dim, args.head_dim, args.ffn_hidden_dim
    kv = args.kv_heads * hd
    kv_local = kv // mp if args.kv_heads % mp == 0 else kv
    block = (d * d) // mp * 2 + 2 * d * kv_local + 3 * d * hidden // mp + 2 * d
    embedding = args.vocab_size * d // mp  # vocab- or dim-split: the same count
    return {"tok_embeddings": embedding, "block": block, "output": args.vocab_size * d // mp, "norm": d}


def analytic_bytes(args, *, mp: int, dp_shard: int, dp_replicate: int, micro_batch: int, seq_len: int,
                   param_bytes: int = 4, reduce_bytes: int = 4, act_bytes: int = 4) -> dict[str, float]:
    """Per-rank wire bytes one optimizer step (one micro-batch) needs at least, by part.

    fsdp: every unit's parameters all-gathered once in forward; blocks again in backward (ZeRO-3:
      one block unsharded at a time; the embedding's backward needs no weights, and the head and
      final norm are used again at once, so they need not be re-gathered); gradients reduce-
      scattered over dp_shard, then the 1/dp_shard shard all-reduced over dp_replicate.
    tp: Megatron's minimum for a Llama block, per micro-batch: the attention and feed-forward
      outputs all-reduced in forward and their inputs' gradients in backward (4 x [b, s, dim] per
      block); the vocab-parallel embedding's output (all-reduce; an all-gather for the dim split);
      the head input's gradient; the vocab-parallel loss's 3 floats per token (max, target logit,
      sum of exponentials).
    scalars: target count, loss and gradient norm, one float each.
    """
    units = mp_local_units(args, mp)
    s, r, m = dp_shard, dp_replicate, mp
    per_unit = [("tok_embeddings", units["tok_embeddings"], 1), ("output", units["output"], 1),
                ("norm", units["norm"], 1)] + [("block", units["block"], 2)] * args.n_layers
    fsdp = 0.0
    for _, numel, gathers in per_unit:  # no padding: the minimum, not what FSDP's layout adds
        fsdp += gathers * wire_factor("all_gather", s) * numel * param_bytes
        fsdp += wire_factor("reduce_scatter", s) * numel * reduce_bytes
        fsdp += wire_factor("all_reduce", r) * numel / s * reduce_bytes
    activation = micro_batch * seq_len * args.dim * act_bytes
    tokens = micro_batch * seq_len
    tp = wire_factor("all_reduce", m) * activation * (4 * args.n_layers + 1)  # blocks + head input grad
    if args.resolved_embedding_split == "vocab":
        tp += wire_factor("all_reduce", m) * activation
    else:
        tp += wire_factor("all_gather", m) * activation
    tp += wire_factor("all_reduce", m) * 3 * tokens * 4
    dp = s * r
    scalars = 2 * wire_factor("all_reduce", dp) * 4 + wire_factor("all_reduce", dp * m) * 4
    return {"fsdp": fsdp, "tp": tp, "scalars": scalars, "total": fsdp + tp + scalars}
