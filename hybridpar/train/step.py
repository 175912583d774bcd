"""The collectives and math of one optimizer step, in pieces that never read a value back to the
host: the trainer converts what it logs, and the dry run (hybridpar.cli.dryrun) runs the same pieces on
fake tensors, where there is no value to read.

    counts = count_targets(batches, parallel, device, also_sum=[data_stop])   # all-reduce over dp
    loss_sum = forward_backward(model, batches, parallel, scale=dp_size / global_targets, grad_sync=...)
    dist.all_reduce(loss_sum, group=parallel.dp_group)
    norm_and_votes = clip_gradients(params, max_norm, device, also_sum=votes)   # all-reduce over the world
    optimizer.step()
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..mesh.device import ParallelDims
from ..parallel import vocab_parallel_cross_entropy
from ..parallel.loss import IGNORE_INDEX

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def count_targets(batches: Batches, parallel: ParallelDims, device: torch.device,
                  also_sum: Sequence[float] = ()) -> torch.Tensor:
    """[the targets of the whole global batch, *also_sum], summed over the dp group: the loss is
    normalised by the count, so every layout computes the gradient of the same mean loss. The data
    stop's flag rides on it (trainer.train_step): every dp group holds one rank of each dp
    coordinate, and the ranks of one coordinate read the same windows, so every rank sums the same."""
    counts = torch.stack([(t != IGNORE_INDEX).sum() for _, t in batches]).sum().reshape(1) if batches \
        else torch.zeros(1)
    counts = torch.cat([counts.to(torch.float32), torch.tensor(also_sum, dtype=torch.float32)]).to(device)
    dist.all_reduce(counts, group=parallel.dp_group)
    return counts


def forward_backward(model: torch.nn.Module, batches: Batches, parallel: ParallelDims, *, scale: float,
                     grad_sync: str, device: torch.device, at: Callable[[str], None] = lambda phase: None
                     ) -> torch.Tensor:
    """Forward and backward of each micro-batch, loss = sum of token losses x scale; gradients are
    synchronised after the last micro-batch ("last") or after each ("every"). This rank's summed
    token loss (not yet summed over dp)."""
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, targets) in enumerate(batches):
        model.set_requires_gradient_sync(grad_sync == "every" or i == len(batches) - 1)
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        at("forward")
        loss = vocab_parallel_cross_entropy(model(inputs), targets, parallel=parallel, reduction="sum")
        at("backward")
        (loss * scale).backward()
        loss_sum += loss.detach()
    return loss_sum
