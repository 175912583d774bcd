"""Region functions: the four collectives of tensor parallelism, each paired with its backward.

Names follow Megatron-LM and fairscale (`copy_to_model_parallel_region` and friends), but the
group is an argument instead of a module-level global:

    copy_to_region      forward identity              backward all-reduce
    reduce_from_region  forward all-reduce            backward identity
    scatter_to_region   forward keep my slice of the  backward all-gather
                        last dim
    gather_from_region  forward all-gather along the  backward keep my slice
                        last dim

Sequence parallelism (Megatron's, torchtitan's) splits the activations between regions into mp
contiguous parts along dim 0, the tokens ([batch * seq, ...] as the model lays them out: for one
sequence, its positions), over the same group; its pair replaces copy and reduce:

    gather_from_sequence_region        forward all-gather dim 0    backward reduce-scatter dim 0
    reduce_scatter_to_sequence_region  forward reduce-scatter      backward all-gather dim 0
    scatter_to_sequence_region         forward keep my part        backward all-gather dim 0

Along dim 0 every part is one contiguous block: the collectives copy nothing.
enter_region / leave_region pick the pair for a layer's setting. With a group of one rank every
function is the identity and issues no collective.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .. import fastpaths
from ..compat.torch import all_gather_single, reduce_scatter_single
from ..fastpaths.gloo_collectives import all_gather_by_all_to_all, reduce_scatter_by_all_to_all


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


def _token_part(n: int, group: ProcessGroup) -> int:
    size = dist.get_world_size(group)
    if n % size:
        raise ValueError(f"{n} tokens (batch x sequence length) are not divisible by the model-parallel size mp = "
                         f"{size}: sequence parallelism gives each rank 1/mp of them; use a sequence length that is a "
                         f"multiple of {size} or set parallel.sequence_parallel = false")
    return n // size


def _split_tokens(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    part = _token_part(x.shape[0], group)
    # A copy, not a view: a view would keep the whole input's storage alive.
    return x[dist.get_rank(group) * part:(dist.get_rank(group) + 1) * part].clone(memory_format=torch.contiguous_format)


def _by_all_to_all(x: torch.Tensor) -> bool:
    """gloo's reduce-scatter costs as much as its all-reduce; as an all-to-all it costs half (the CPU
    fast path, fastpaths.gloo_collectives). Not inside torch.compile, which traces the plain ones."""
    return x.device.type == "cpu" and fastpaths.enabled() and not torch.compiler.is_compiling()


def _gather_tokens(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    if _by_all_to_all(x):
        all_gather_by_all_to_all(out, x, group)
    else:
        all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_tokens(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((_token_part(x.shape[0], group),) + tuple(x.shape[1:]))
    if _by_all_to_all(x):
        reduce_scatter_by_all_to_all(out, x, group)
    else:
        reduce_scatter_single(out, x, group=group)
    return out


def _region(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd Function computing forward(x, group), whose gradient is backward(grad, group)."""

    class Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    Region.__name__ = Region.__qualname__ = name
    return Region


def _same(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x.view_as(x)


_Copy = _region("_Copy", _same, _all_reduce)
_Reduce = _region("_Reduce", _all_reduce, _same)
_Scatter = _region("_Scatter", _split_last_dim, _gather_last_dim)
_Gather = _region("_Gather", _gather_last_dim, _split_last_dim)
_GatherSeq = _region("_GatherSeq", _gather_tokens, _reduce_scatter_tokens)
_ReduceScatterSeq = _region("_ReduceScatterSeq", _reduce_scatter_tokens, _gather_tokens)
_ScatterSeq = _region("_ScatterSeq", _split_tokens, _gather_tokens)


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


def gather_from_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's part of the tokens [n, ...] -> all of them [mp * n, ...]; the gradient is
    reduce-scattered."""
    return x if _trivial(group) else _GatherSeq.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Partial sums [N, ...] -> this rank's part of their sum [N / mp, ...]; the gradient is
    all-gathered."""
    return x if _trivial(group) else _ReduceScatterSeq.apply(x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """A tensor alike on every rank [N, ...] -> this rank's part [N / mp, ...]; the gradient is
    all-gathered."""
    return x if _trivial(group) else _ScatterSeq.apply(x, group)


def enter_region(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """Into a model-parallel region: copy, or all-gather the token parts ([n, dim] -> [mp * n, dim])."""
    return gather_from_sequence_region(x, group) if sequence_parallel else copy_to_region(x, group)


def leave_region(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """Out of it, summing the ranks' partial results: all-reduce, or reduce-scatter the tokens (the
    leading dims flattened: [..., dim] -> [tokens / mp, dim])."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_region(x.reshape(-1, x.shape[-1]), group)
    return reduce_from_region(x, group)
