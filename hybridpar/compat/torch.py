"""The torch internals and renamed functions hybridpar uses, each behind one name here.

A torch upgrade breaks these first: private names (a leading underscore) change without notice and
renamed functions lose their old name. Each shim says in one line why hybridpar needs it, so an
upgrade is fixed in this file and the callers stay as they are.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
# Activation checkpointing without a wrapper module, so parameter names stay Meta's.
from torch.distributed._composable import checkpoint as checkpoint_module  # noqa: F401
# Where a DTensor's local shard sits in the global tensor: torch has no public function for it.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401

# FSDP2's hooks for custom collectives (torch >= 2.7); None on older torch, where FSDP's own run.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:
    AllGather = ReduceScatter = None

# torch.save's settings; None on a torch without them (CRC-32s are then always written).
try:
    from torch.utils.serialization import config as serialization_config
except ImportError:
    serialization_config = None


# all_gather_into_tensor was renamed all_gather_single (torch 2.13 warns on the old name), and
# reduce_scatter_tensor reduce_scatter_single. Looked up at each call, not bound at import, so a
# wrapper installed on torch.distributed later (diagnostics.wrap, under its listeners) sees them.
def all_gather_single(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


# The fused per-tensor norm and scale that clip_grad_norm_ uses too: one kernel for a list of tensors.
foreach_mul_ = torch._foreach_mul_

# The CPU's _foreach_norm (and vector_norm) sums a float32 tensor's squares in float32, and its
# relative error grows with the length (measured: 2e-6 at 2^18 elements, 1e-5 at 2^20, 9e-5 at
# 2^22): a clipped step scales every update by max_norm / norm, so the shard size changed training
# (tiny preset, seq 512: world 1 and 4 apart by 4e-6 in gradient norm at step 1, 1.6e-4 at step 8).
# Contiguous pieces of at most NORM_PIECE elements (views of a gradient: no copy) keep each sum short
# and their squares add up in float64: 8e-8 at 2^24 elements, in 9 ms where one sum takes 6. (A
# strided tensor's sum is worse still: it is made contiguous.) CUDA's kernel reduces in a tree.
NORM_PIECE = 1 << 15


def tensor_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each of `tensors` (on one device), as one float32 tensor: torch._foreach_norm's,
    stacked, except that on the CPU each is summed in pieces (above). Fake tensors (the dry run) have
    no values to be accurate about: they take the one kernel call."""
    if tensors[0].device.type != "cpu" or is_fake(tensors[0]):
        return torch.stack(torch._foreach_norm(tensors, 2.0)).float()
    pieces, owner = [], []
    for i, t in enumerate(tensors):
        parts = t.contiguous().view(-1).split(NORM_PIECE) if t.numel() > NORM_PIECE else (t,)
        pieces.extend(parts)
        owner.extend([i] * len(parts))
    squares = torch.stack(torch._foreach_norm(pieces, 2.0)).double().square()
    sums = squares.new_zeros(len(tensors)).index_add_(0, torch.tensor(owner), squares)
    return sums.sqrt().float()


# SDPA's CPU flash kernel, called directly: SDPA returns no log-sum-exp, and context parallelism's
# attention (parallel/context.py) merges two calls by theirs and saves only q, k, v, out and it for
# backward. Heads may be a multiple of kv heads (GQA: dK/dV come back summed over each group).
def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """q [b, heads, Lq, d], k and v [b, kv_heads, Lk, d] on the CPU -> (out [b, heads, Lq, d], lse
    [b, heads, Lq] fp32); is_causal is top-left (query i sees keys 0..i); the default scale."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)


def cpu_flash_attention_backward(grad_out, q, k, v, out, lse, is_causal: bool):
    """(dq, dk, dv) of cpu_flash_attention given the attention's output and log-sum-exp: with a merged
    out and lse, each part's gradients of the whole attention."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal)


def storage_use_count(tensor: torch.Tensor) -> int:
    """References to `tensor`'s storage (tensors and views on it, plus the storage object made
    here): a pooled buffer is free when only the pool holds it. No public API counts these."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def zip_reader(file):
    """torch.save's archive reader over a file object: reads one record without loading the rest."""
    return torch._C.PyTorchFileReader(file)


def pickled_storage_dtype(name: str) -> torch.dtype:
    """The dtype a torch.save pickle means by a storage class name ("FloatStorage", "BFloat16Storage")."""
    return torch.storage._get_dtype_from_pickle_storage_type(name)


def stored_data_offset(tensor: torch.Tensor) -> Optional[int]:
    """Where the bytes of a tensor that torch.load put on the "meta" device start in its archive;
    None when this torch does not record it."""
    return getattr(tensor.untyped_storage(), "_checkpoint_offset", None)


def save_without_crc32():
    """A context in which torch.save skips the zip CRC-32 of each record, on this thread only (torch
    patches its settings per thread)."""
    if serialization_config is None:
        return contextlib.nullcontext()
    return serialization_config.patch({"save.compute_crc32": False})


def dtensor_over(local: torch.Tensor, like):
    """A DTensor laid out as DTensor `like` over `local`, wherever `local` lies: DTensor.from_local
    would move a host tensor to the mesh's device (checkpoint staging wants it on the host)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def set_pg_timeout(timeout, group) -> None:
    """Change a live group's collective timeout: torch sets it only when a group is made."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def default_store():
    """The default group's key-value store (the rendezvous), looked up at each call."""
    return dist.distributed_c10d._get_default_store()


def sequence_number(group) -> int:
    """How many collectives `group` has issued: ranks that disagree show where a hang began."""
    return int(group._get_sequence_number_for_group())


def flatten_mesh(mesh, name: str):
    """Mesh dims merged into one named dim (FSDP's 1-D dp mesh): DeviceMesh has no public way."""
    return mesh._flatten(name)


def unflatten_mesh(mesh, sizes: tuple[int, ...], names: tuple[str, ...], dim: int = 0):
    """Mesh dim `dim` split into named dims (FSDP's (dp_replicate, dp_shard_cp) under context parallelism,
    dp_shard's (dp_shard_mod_ep, ep) under expert parallelism), without slicing flattened dims out of
    the root mesh, which torch deprecates."""
    return mesh._unflatten(dim, sizes, names)


def flight_recorder_dumps() -> list[bytes]:
    """This process's flight recorders, pickled: collectives included, C++ stacks left out (slow to
    collect). ProcessGroupNCCL records into a recorder of its own, which CUDA builds dump with
    _dump_nccl_trace; _dump_fr_trace holds the other backends' (gloo's) only."""
    c10d = torch._C._distributed_c10d
    dumps = [c10d._dump_fr_trace(True, False, False)]
    nccl = getattr(c10d, "_dump_nccl_trace", None)
    if nccl is not None:
        dumps.append(nccl(True, False, False))
    return dumps


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A process group in which this one process plays `rank` of `world_size`: collectives return at
    once and move nothing (the dry run). torch ships it for its own tests only."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def is_fake(x: torch.Tensor) -> bool:
    """Whether x is a fake tensor (made under fake_tensors(): the dry run's)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(x)


def fake_tensors():
    """A mode in which tensors have shapes, dtypes and devices but no memory, and ops only compute
    the shapes of their results: a 405B model's training step runs in seconds (the dry run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
