"""Expert parallelism's token exchange: the tokens of a mixture-of-experts layer travel to the ep rank
holding their expert and their outputs come back, by all-to-all over the ep group (parallel.ep_group).

    local, counts, plan = dispatch(x, counts, group)   # x: this rank's token slots sorted by expert
    y = combine(experts(local, counts), plan)            # back in x's order, on this rank

Rank r of ep holds experts [r * E / ep, (r + 1) * E / ep). Slots sorted by expert are already
grouped by destination rank, so one all_to_all_single moves them (variable splits: the tokens per
expert are exchanged first, an all-to-all of E numbers); the slots a rank receives come ordered by
source rank, then expert, and are regrouped by expert for the grouped GEMM. Dropless: every slot
reaches its expert whatever the imbalance. Both exchanges are autograd functions whose backward
is the opposite exchange, so the experts' gradients stay on their rank and the tokens' gradients
go back to theirs. Every rank of the ep group must run the same layers' forwards and backwards
(each makes collectives), as every rank of the data-parallel groups already does.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> torch.Tensor:
    """Rows x[in_splits[0]:...] to rank 0 of `group`, the next to rank 1...; out_splits[s] rows from rank s."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> torch.Tensor:
    """all_to_all_single of the rows of x with variable splits, differentiable (backward: the reverse exchange)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class Exchange(NamedTuple):
    """What combine needs of a dispatch: the rows each rank sent and received, and where each row
    received sits in the expert order (index[i]: the received row the i-th row of that order is)."""

    sent: list[int]
    received: list[int]
    index: torch.Tensor
    group: ProcessGroup
    counts: Optional[list[int]] = None  # the rows per local expert on the host, where known (balanced)


def dispatch(x: torch.Tensor, counts: torch.Tensor, group: ProcessGroup,
             balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """x [n, dim]: this rank's token slots sorted by expert, counts [E] of them per expert. Returns the
    slots of this rank's experts from every rank of `group`, sorted by expert [m, dim], how many each
    of its E / ep experts has [E / ep], and the Exchange that combine reverses. `balanced`: every rank's
    counts are models.moe.balanced_counts of its n slots, known without reading them (fake tensors)."""
    ep = dist.get_world_size(group)
    # Each rank's counts for this rank's experts: the one exchange whose sizes are known beforehand.
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts, group=group)
    if balanced:
        return _dispatch_balanced(x, counts.numel(), ep, group)
    theirs = theirs.view(ep, -1)  # [source rank, local expert]
    sent, received = counts.view(ep, -1).sum(1).tolist(), theirs.sum(1).tolist()
    rows = all_to_all(x, received, sent, group)  # by source rank, then expert
    # Regrouped by expert, then source rank: chunk (e, s) starts where it was received.
    sizes = theirs.t().reshape(-1)
    starts = (torch.cumsum(theirs.reshape(-1), 0) - theirs.reshape(-1)).view(ep, -1).t().reshape(-1)
    shift = starts - (torch.cumsum(sizes, 0) - sizes)  # received position minus expert-order position
    index = torch.repeat_interleave(shift, sizes) + torch.arange(int(sizes.sum()), device=sizes.device)
    return rows[index], theirs.sum(0), Exchange(sent, received, index, group)


def combine(y: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """The experts' outputs y (dispatch's row order) back to the ranks and order their slots came from."""
    rows = torch.zeros_like(y).index_copy(0, exchange.index, y)
    return all_to_all(rows, exchange.sent, exchange.received, exchange.group)


def balanced_counts(slots: int, n_experts: int) -> list[int]:
    """`slots` token slots shared by the experts as evenly as they go (the first ones one more): the
    routing a dry run rehearses, whose fake tensors have no values to count (hybridpar.cli.dryrun)."""
    return [slots // n_experts + (e < slots % n_experts) for e in range(n_experts)]


def _dispatch_balanced(x: torch.Tensor, n_experts: int, ep: int, group: ProcessGroup):
    """dispatch's exchange for balanced counts, every size computed on the host: every rank sends each
    expert the same number of slots, so a rank receives from each source its own experts' counts."""
    local = n_experts // ep
    counts = balanced_counts(x.shape[0], n_experts)
    mine = counts[dist.get_rank(group) * local:][:local]  # what each source sends to each of this rank's experts
    sent = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
    received = [sum(mine)] * ep
    rows = all_to_all(x, received, sent, group)  # by source rank, then expert
    # Regrouped by expert, then source rank, as dispatch does.
    index = [s * sum(mine) + sum(mine[:e]) + i for e in range(local) for s in range(ep) for i in range(mine[e])]
    index = torch.tensor(index, dtype=torch.long, device=x.device)
    local_counts = [c * ep for c in mine]
    return rows[index], torch.tensor(local_counts, device=x.device), Exchange(sent, received, index, group, local_counts)
