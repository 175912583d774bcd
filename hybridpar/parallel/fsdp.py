"""FSDP2 over the data-parallel mesh dims, with the strategy names FSDP1 users know.

    full_shard          shard over every dp rank (1-D dp mesh); reshard after forward
    shard_grad_op       same mesh, keep parameters gathered between forward and backward (ZeRO-2)
    hybrid_shard        shard inside dp_shard, replicate across dp_replicate (2-D mesh)
    hybrid_shard_zero2  hybrid_shard without resharding after forward
    no_shard            replicate over every dp rank (needs dp_shard = 1)

FSDP2 (`fully_shard`) instead of FSDP1: per-parameter DTensor sharding that composes with the
tensor-parallel DTensors of `hybridpar.parallel`, and no silent NO_SHARD fallback: FSDP1's
HYBRID_SHARD with a shard group of one rank stops all-reducing across replicas, while a 2-D
FSDP2 mesh with dp_shard = 1 still all-reduces over dp_replicate.

Units: one per transformer block, the token embeddings and the output head each their own, then
the root (final norm). On gloo, FSDP's all-gather and reduce-scatter run as all-to-alls, which gloo
does at a half to a third of the CPU cost (FSDPConfig.gloo_all_to_all). Activation checkpointing is
applied before sharding, with the composable API so parameter names stay Meta's; so is torch.compile
of the blocks (train.compile), which keeps FSDP's hooks outside the compiled code.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import warnings
from typing import Optional

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed._composable import checkpoint as checkpoint_module
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

try:  # the custom-collective hooks of FSDP2 (torch >= 2.7)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # older torch: FSDP's own collectives
    AllGather = ReduceScatter = None

from ..dtypes import TORCH_DTYPES as DTYPES
from ..mesh import ParallelDims

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
AC_MODES = ("none", "selective", "full")  # least recomputation first: `hybridpar plan` lists layouts in this order


@dataclasses.dataclass
class FSDPConfig:
    sharding_strategy: str = "hybrid_shard"
    param_dtype: str = "bfloat16"  # compute dtype of gathered parameters
    reduce_dtype: str = "float32"  # gradient reduction dtype
    activation_checkpointing: str = "none"  # none | full | selective
    ac_every: int = 2  # selective: checkpoint every k-th block
    cpu_offload: bool = False
    forward_prefetch: int = 1  # blocks whose all-gather is issued ahead in forward (0: FSDP2's implicit)
    backward_prefetch: int = 1  # same in backward
    # gloo only: FSDP's all-gather and reduce-scatter as all-to-alls (half to a third of gloo's CPU
    # cost for the same bytes). False keeps FSDP2's own collectives, the ones nccl runs.
    gloo_all_to_all: bool = True

    def validate(self) -> None:
        if self.sharding_strategy not in STRATEGIES:
            raise ValueError(f"sharding_strategy must be one of {STRATEGIES}, got {self.sharding_strategy!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, got {self.activation_checkpointing!r}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}")
        if self.ac_every < 1:
            raise ValueError(f"ac_every must be >= 1, got {self.ac_every}")


def dp_mesh_for(strategy: str, parallel: ParallelDims):
    """The data-parallel mesh a strategy shards over; errors name the sizes to change."""
    if strategy in ("full_shard", "shard_grad_op"):
        if parallel.dp_replicate != 1:
            raise ValueError(
                f"{strategy} shards over every data-parallel rank, but dp_replicate = {parallel.dp_replicate}: "
                "use hybrid_shard (or hybrid_shard_zero2), or set dp_replicate = 1"
            )
        return parallel.dp_flat_mesh
    if strategy == "no_shard" and parallel.dp_shard != 1:
        raise ValueError(
            f"no_shard replicates over every data-parallel rank, but dp_shard = {parallel.dp_shard}: "
            f"set dp_shard = 1 and dp_replicate = {parallel.dp_size}"
        )
    return parallel.dp_mesh  # 2-D (dp_replicate, dp_shard); no_shard is the case dp_shard = 1


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str, every: int = 2) -> list[int]:
    """Recompute the activations of the chosen blocks in backward; returns their indices."""
    if mode == "none":
        return []
    chosen = [i for i in range(len(blocks)) if mode == "full" or i % every == 0]
    for i in chosen:
        checkpoint_module(blocks[i])
    return chosen


class _Scratch:
    """One buffer reused by the gloo collectives below: they run synchronously, one at a time."""

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None

    def get(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        b = self.buffer
        if b is None or b.numel() < numel or b.dtype != like.dtype or b.device != like.device:
            self.buffer = b = torch.empty(numel, dtype=like.dtype, device=like.device)
        return b[:numel]


class _BufferPool:
    """The buffers FSDP asks its collectives for (gathered parameters, gradients to reduce, reduced
    shards), kept and handed out again: YaFSDP's preallocated buffers, on the CPU.

    CUDA's caching allocator already reuses freed memory; on the CPU a fresh buffer of this size
    comes from the kernel and faults its pages in at first touch, which was a fifth of hybridpar's
    CPU time per step here (bench/README.md). A buffer is reused only when nothing but the pool
    holds its storage (FSDP dropped every view of it), so a buffer still in use is never shared.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, list[torch.Tensor]] = {}

    def get(self, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        kept = self.buffers.setdefault((numel, dtype, torch.device(device)), [])
        for buffer in kept:
            # 2: the pool's tensor and the storage object this call creates; any view adds one.
            if torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == 2:
                return buffer.view(size)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        kept.append(buffer)
        return buffer.view(size)


class _PooledCollective:
    """The buffers FSDP allocates for a custom collective come from the shared pool; `scratch` is
    the collective's own working space."""

    def __init__(self, scratch: _Scratch, pool: _BufferPool) -> None:
        self.scratch, self.pool = scratch, pool

    def allocate(self, size, *, dtype, device):
        return self.pool.get(size, dtype, device)


def _swap_with_peer(send: torch.Tensor, recv: torch.Tensor, group) -> None:
    """In a group of two, send `send` to the other rank and receive its tensor into `recv`: an
    all_to_all_single whose chunk to oneself is empty, so nothing is staged or copied locally."""
    splits = [0, 0]
    splits[1 - group.rank()] = send.numel()
    dist.all_to_all_single(recv, send, splits, splits, group=group)


if AllGather is not None:

    class AllToAllGather(_PooledCollective, AllGather):
        """FSDP's parameter all-gather as one all_to_all_single (gloo only).

        gloo's all_gather costs about twice the CPU time of an all-to-all that moves the same
        bytes (bench/README.md): every rank sends its shard to each peer as one all-to-all chunk.
        Between two ranks the chunk to itself is left out (split size 0), which removes both copies.
        """

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            n = group.size()
            if n == 2:  # the shard goes out as it is and the peer's lands in its slot: no copies
                _swap_with_peer(input_tensor.reshape(-1), output_tensor.view(2, -1)[1 - group.rank()], group)
                return None
            # input_tensor is a view of this rank's slot of output_tensor: read it before the call.
            staged = self.scratch.get(output_tensor.numel(), output_tensor).view(n, -1)
            staged.copy_(input_tensor.reshape(1, -1).expand(n, -1))
            dist.all_to_all_single(output_tensor, staged.reshape(-1), group=group)
            return None  # done: FSDP waits only on a returned Work

    class AllToAllReduceScatter(_PooledCollective, ReduceScatter):
        """FSDP's gradient reduce-scatter as an all_to_all_single and a local sum (gloo only).

        gloo's reduce_scatter costs two to three times the CPU time of this; the sum runs in rank
        order, so the result is deterministic. Between two ranks each sends only the peer's half.
        """

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            n, out = group.size(), output_tensor.view(-1)
            if n == 2:  # a sum of two is the same in either order: both ranks get identical results
                rank = group.rank()
                halves = input_tensor.view(2, -1)
                received = self.scratch.get(halves.shape[1], input_tensor)
                _swap_with_peer(halves[1 - rank], received, group)
                torch.add(halves[rank], received, out=out)
            else:
                received = self.scratch.get(input_tensor.numel(), input_tensor)
                dist.all_to_all_single(received, input_tensor, group=group)
                torch.sum(received.view(n, -1), dim=0, out=out)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(n)
            return None


def _use_gloo_collectives(units: list[nn.Module], parallel: ParallelDims) -> None:
    """On the CPU (gloo), FSDP's all-gather and reduce-scatter go through all_to_all_single (see above).
    Decided by the device, not the backend string ("cpu:gloo,cuda:nccl" holds both): these run one at
    a time and share buffers, which only holds for synchronous CPU collectives, not CUDA streams."""
    if AllGather is None or parallel.device.type != "cpu":
        return
    scratch = _Scratch()  # shared: the units never communicate at the same time
    pool = _BufferPool()
    gather, scatter = AllToAllGather(scratch, pool), AllToAllReduceScatter(scratch, pool)
    for unit in units:
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(scatter)


def apply_fsdp(model: nn.Module, parallel: ParallelDims, config: Optional[FSDPConfig] = None, *,
               compile_blocks: bool = False) -> nn.Module:
    """Shard `model` (a models.llama.Transformer) in place over the data-parallel dims and return it.

    compile_blocks: torch.compile each transformer block, after activation checkpointing and before
    sharding, so FSDP's hooks stay outside the compiled code.
    """
    config = config or FSDPConfig()
    config.validate()
    if compile_blocks and parallel.device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++")):
        raise ValueError("train.compile on the CPU needs a C++ compiler (inductor builds its kernels with it): "
                         "install g++ or set train.compile = false")
    mesh = dp_mesh_for(config.sharding_strategy, parallel)
    apply_activation_checkpointing(model.layers, config.activation_checkpointing, config.ac_every)
    if compile_blocks:
        for block in model.layers:
            block.compile()

    offload: OffloadPolicy = OffloadPolicy()
    if config.cpu_offload:
        if parallel.device.type == "cpu":
            warnings.warn("cpu_offload has no effect: the parameters already live on the CPU", stacklevel=2)
        else:
            offload = CPUOffloadPolicy(pin_memory=True)
    common = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[config.param_dtype], reduce_dtype=DTYPES[config.reduce_dtype]),
        offload_policy=offload,
    )
    reshard = config.sharding_strategy in ("full_shard", "hybrid_shard")
    # The embedding's backward reads no weights, yet FSDP needs its unsharded parameter to take the
    # gradient: kept gathered from its forward to its backward (the memory of one unit), it saves an
    # all-gather per step.
    fully_shard(model.tok_embeddings, reshard_after_forward=False, **common)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard, **common)
    # The head runs last in forward and first in backward: resharding it in between only costs a gather.
    fully_shard(model.output, reshard_after_forward=False, **common)
    fully_shard(model, reshard_after_forward=False, **common)
    _set_prefetch(model, config.forward_prefetch, config.backward_prefetch)
    if config.gloo_all_to_all:
        _use_gloo_collectives([model.tok_embeddings, *model.layers, model.output, model], parallel)
    return model


def _set_prefetch(model: nn.Module, forward: int, backward: int) -> None:
    """Issue the next units' all-gathers early so communication overlaps compute."""
    units = [model.tok_embeddings, *model.layers, model.output]
    for i, unit in enumerate(units):
        if forward > 0 and i + 1 < len(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + forward])
        if backward > 0 and i > 0:
            unit.set_modules_to_backward_prefetch(units[max(0, i - backward) : i][::-1])
