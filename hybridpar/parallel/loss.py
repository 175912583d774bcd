"""Cross-entropy over logits split along the vocabulary, without ever gathering the full logits.

Each rank holds logits for vocab ids [mp_rank * V/mp, (mp_rank + 1) * V/mp). Two all-reduces of
[tokens]-sized tensors (the max; then target logit and sum of exponentials, stacked) replace a
gather of [tokens, V]. The arithmetic is fp32 whatever the logits' dtype; the gradient comes back
in the logits' dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..mesh.device import ParallelDims


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, target, ignore_index, group):
        logits = local_logits.float()
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local

        # Subtracting the global max keeps exp() finite; it does not change the result.
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        valid = target != ignore_index
        local_target = target - start
        mine = valid & (local_target >= 0) & (local_target < vocab_local)
        local_target = torch.where(mine, local_target, 0)
        # where, not a 0/1 product: a -inf logit (a banned token) times 0 would be NaN.
        target_logit = torch.where(mine, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        # One all-reduce for both [tokens] sums.
        both = torch.stack([target_logit, sum_exp])
        dist.all_reduce(both, group=group)
        target_logit, sum_exp = both

        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, mine, valid)
        ctx.input_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # The saved softmax becomes the gradient in place (no second [tokens, V/mp] buffer), so
        # this graph can be backpropagated once only.
        softmax, local_target, mine, valid = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), zero where the target is ignored.
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


IGNORE_INDEX = -100  # targets that take no part in the loss (torch's cross_entropy default)


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    parallel: Optional[ParallelDims] = None,
    group: Optional[ProcessGroup] = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits [..., V/mp] against global target ids [...].

    Same result as `F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ignore_index=...)`.
    The model-parallel group comes from `parallel` (or `group`); without either the logits must be
    the full vocabulary (a single process, or mp = 1). reduction: "mean" over non-ignored targets
    (0 when every target is ignored), "sum", or "none" (per position, 0 where ignored).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if local_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(local_logits.shape)} and target {tuple(target.shape)} disagree: "
            "logits must be target's shape plus a vocabulary dimension"
        )
    if group is None and parallel is not None:
        group = parallel.mp_group
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "vocab_parallel_cross_entropy needs the model-parallel group in a multi-process job: "
            "pass parallel=<ParallelDims> (or group=)"
        )
    if group is None or dist.get_world_size(group) == 1:
        losses = F.cross_entropy(
            local_logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction="none"
        ).view(target.shape)
    else:
        losses = _VocabParallelCrossEntropy.apply(local_logits, target, ignore_index, group)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum().clamp(min=1)
