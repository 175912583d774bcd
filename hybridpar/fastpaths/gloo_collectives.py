"""All-gather and reduce-scatter on gloo as all_to_all_single (a fast path): FSDP's, with pooled
buffers, and sequence parallelism's (parallel.mappings).

gloo's own all_gather and reduce_scatter cost more CPU time than an all-to-all moving the same bytes
(bench/README.md has the figures). Every rank sends its shard, or each peer's part of the gradient,
as one all-to-all chunk; the reduce-scatter then sums the chunks locally, in rank order, so the
result is deterministic. Between two ranks the chunk to oneself is left out (split size 0), which
removes the staging copies. The buffers FSDP asks these collectives for come from a pool.

Installed through FSDP2's custom-collective hooks (torch >= 2.7), on the CPU only: the collectives
share buffers, which holds for synchronous CPU collectives, not for CUDA streams.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..compat.torch import AllGather, ReduceScatter, all_gather_single, reduce_scatter_single, storage_use_count
from ..mesh.device import ParallelDims

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
    comes from the kernel and faults its pages in at first touch, a large share of the CPU time of
    a step. A buffer is reused only when nothing but the pool holds its storage (FSDP dropped every
    view of it), so a buffer still in use is never shared.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, list[torch.Tensor]] = {}

    def get(self, size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        kept = self.buffers.setdefault((numel, dtype, torch.device(device)), [])
        for buffer in kept:
            # 2: the pool's tensor and the storage object this call creates; any view adds one.
            if storage_use_count(buffer) == 2:
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


def all_gather_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group,
                             scratch: Optional[_Scratch] = None) -> None:
    """All-gather of `input` into the contiguous `output` (n equal slots, in rank order) as one
    all_to_all_single. Between two ranks the peer's part lands in its slot directly; with more, each
    rank sends its part to every peer from n staged copies (in `scratch`, or a new buffer)."""
    n, rank = group.size(), group.rank()
    if output.is_floating_point() and output.element_size() == 1:  # float8, which gloo refuses: as its bytes
        output, input = output.view(torch.uint8), input.view(torch.uint8)
    slots = output.view(n, -1)
    if slots[rank].data_ptr() != input.data_ptr():  # not already in place (FSDP passes its slot)
        slots[rank].copy_(input.reshape(-1))
    if n == 2:
        _swap_with_peer(input.reshape(-1), slots[1 - rank], group)
        return
    staged = _working(scratch, output.numel(), output).view(n, -1)
    staged.copy_(input.reshape(1, -1).expand(n, -1))
    dist.all_to_all_single(output.view(-1), staged.reshape(-1), group=group)


def reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group,
                                 scratch: Optional[_Scratch] = None) -> None:
    """Sum-reduce-scatter of the contiguous `input` (n equal slots) into `output` as one
    all_to_all_single and a local sum in rank order (deterministic). Between two ranks each sends
    only the peer's half. The parts received go to `scratch`, or a new buffer."""
    n, rank, out = group.size(), group.rank(), output.view(-1)
    slots = input.view(n, -1)
    if n == 2:  # a sum of two is the same in either order: both ranks get identical results
        received = _working(scratch, slots.shape[1], input)
        _swap_with_peer(slots[1 - rank], received, group)
        torch.add(slots[rank], received, out=out)
    else:
        received = _working(scratch, input.numel(), input)
        dist.all_to_all_single(received, input.reshape(-1), group=group)
        torch.sum(received.view(n, -1), dim=0, out=out)


def _working(scratch: Optional[_Scratch], numel: int, like: torch.Tensor) -> torch.Tensor:
    return scratch.get(numel, like) if scratch is not None else like.new_empty(numel)


if AllGather is not None:

    class AllToAllGather(_PooledCollective, AllGather):
        """FSDP's parameter all-gather as one all_to_all_single (gloo only).

        Every rank sends its shard to each peer as one all-to-all chunk. Between two ranks the chunk
        to itself is left out (split size 0), which removes both copies.
        """

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            # input_tensor is a view of this rank's slot of output_tensor: nothing to copy into it.
            all_gather_by_all_to_all(output_tensor, input_tensor, group, self.scratch)
            return None  # done: FSDP waits only on a returned Work

    class AllToAllReduceScatter(_PooledCollective, ReduceScatter):
        """FSDP's gradient reduce-scatter as an all_to_all_single and a local sum (gloo only).

        The sum runs in rank order, so the result is deterministic. Between two ranks each sends
        only the peer's half.
        """

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            reduce_scatter_by_all_to_all(output_tensor, input_tensor, group, self.scratch)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(group.size())
            return None


    class BytesAllGather(AllGather):
        """FSDP's own all-gather (the stock path), moving float8 as its bytes: gloo refuses float8, which
        FSDP hands it for a unit whose weights are all gathered in float8 (a mixed unit comes as bytes)."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return all_gather_single(output_tensor.view(torch.uint8), input_tensor.view(torch.uint8), group=group,
                                     async_op=async_op)


def gather_float8_as_bytes(units: list[nn.Module], parallel: ParallelDims) -> None:
    """On the CPU (gloo) with these fast paths off: FSDP's own all-gather of `units` (those holding
    weights gathered in float8) moves their bytes, which gloo takes."""
    if AllGather is None or parallel.device.type != "cpu":
        return
    for unit in units:
        unit.set_custom_all_gather(BytesAllGather())


def use_gloo_collectives(units: list[nn.Module], parallel: ParallelDims) -> None:
    """On the CPU (gloo), FSDP's all-gather and reduce-scatter of `units` go through all_to_all_single.
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
