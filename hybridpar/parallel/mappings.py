"""Region functions: the four collectives of tensor parallelism, each paired with its backward.

Names follow Megatron-LM and fairscale (`copy_to_model_parallel_region` and friends), but the
group is an argument instead of a module-level global:

    copy_to_region      forward identity              backward all-reduce
    reduce_from_region  forward all-reduce            backward identity
    scatter_to_region   forward keep my slice of the  backward all-gather
                        last dim
    gather_from_region  forward all-gather along the  backward keep my slice
                        last dim

With a group of one rank every function is the identity and issues no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..compat.torch import all_gather_single


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the model-parallel size {size}")
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    # Gather along dim 0 into one contiguous buffer, then move the rank axis next to the last dim.
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x, group=group)
    out = out.view((size,) + tuple(x.shape))
    return out.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def _trivial(group: ProcessGroup) -> bool:
    return dist.get_world_size(group) == 1


def copy_to_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter a model-parallel region: identity forward, all-reduce of the gradient backward."""
    return x if _trivial(group) else _Copy.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leave a model-parallel region by summing partial results across the group."""
    return x if _trivial(group) else _Reduce.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; the gradient is all-gathered."""
    return x if _trivial(group) else _Scatter.apply(x, group)


def gather_from_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's last-dimension slice; the gradient is split again."""
    return x if _trivial(group) else _Gather.apply(x, group)
