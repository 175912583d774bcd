"""The collectives and math of one optimizer step, in pieces that never read a value back to the
host: the trainer converts what it logs, and the dry run (hybridpar.cli.dryrun) runs the same pieces on
fake tensors, where there is no value to read.

    local = context_parts(batches, parallel)   # this cp rank's chunks of each sequence (all of it at cp 1)
    counts = count_targets(local, parallel, device, also_sum=[data_stop])   # all-reduce over dp x cp
    loss_sum = runner.forward_backward(local, scale=gradient_scale(parallel, global_targets))   # the model
    runner.total(loss_sum)   # all-reduce over dp x cp (and pp: every stage logs the loss): pipeline.runner
    norm_and_votes = clip_gradients(params, max_norm, device, also_sum=votes)   # all-reduce over the world
    optimizer.step()
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..mesh.device import ParallelDims
from ..parallel.context import shard_sequence
from ..parallel.loss import IGNORE_INDEX

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def context_parts(batches: Batches, parallel: ParallelDims) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This cp rank's part of every (inputs, targets) micro-batch: its two chunks of each sequence
    (parallel.context.shard_sequence); the batches themselves at cp = 1. Every cp rank of a
    data-parallel coordinate reads the same whole sequences (the loader is keyed by the dp rank)."""
    if parallel.cp == 1:
        return list(batches)
    return [(shard_sequence(x, parallel.cp, parallel.cp_rank), shard_sequence(t, parallel.cp, parallel.cp_rank))
            for x, t in batches]


def count_targets(batches: Batches, parallel: ParallelDims, device: torch.device,
                  also_sum: Sequence[float] = ()) -> torch.Tensor:
    """[the targets of the whole global batch, *also_sum], this rank's targets (its context_parts)
    summed over dp x cp: the loss is normalised by the count, so every layout computes the gradient
    of the same mean loss. The data stop's flag rides on it (trainer.train_step): every dp x cp
    group holds one rank of each dp coordinate, and the ranks of one coordinate read the same
    windows, so every rank sums the same."""
    counts = torch.stack([(t != IGNORE_INDEX).sum() for _, t in batches]).sum().reshape(1) if batches \
        else torch.zeros(1)
    counts = torch.cat([counts.to(torch.float32), torch.tensor(also_sum, dtype=torch.float32)]).to(device)
    dist.all_reduce(counts, group=parallel.dp_cp_group)
    return counts


def gradient_scale(parallel: ParallelDims, global_targets: float) -> float:
    """The factor on each rank's summed token loss so that the gradients are those of the global
    mean loss: FSDP averages the gradients over the dp x cp ranks holding a copy of the parameters,
    and undoing that average makes their sum (each rank's share, its tokens') the gradient."""
    return parallel.dp_size * parallel.cp / global_targets
