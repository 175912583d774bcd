"""The collectives and math of one optimizer step, in pieces that never read a value back to the
host: the trainer converts what it logs, and the dry run (hybridpar.cli.dryrun) runs the same pieces on
fake tensors, where there is no value to read.

    local = context_parts(batches, parallel)   # this cp rank's chunks of each sequence (all of it at cp 1)
    counts = count_targets(local, parallel, device, also_sum=[data_stop])   # all-reduce over dp x cp
    loss_sum = forward_backward(model, local, parallel, scale=gradient_scale(parallel, global_targets), ...)
    #   (parallel.pp > 1: pipeline_forward_backward(engine, local, scale=..., ...))
    sum_loss(loss_sum, parallel)   # all-reduce over dp x cp (and pp: every stage logs the loss)
    norm_and_votes = clip_gradients(params, max_norm, device, also_sum=votes)   # all-reduce over the world
    optimizer.step()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..mesh.device import ParallelDims
from ..parallel import vocab_parallel_cross_entropy
from ..parallel.context import shard_sequence
from ..parallel.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from ..parallel.pipeline import PipelineEngine

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


def forward_backward(model: torch.nn.Module, batches: Batches, parallel: ParallelDims, *, scale: float,
                     grad_sync: str, device: torch.device, at: Callable[[str], None] = lambda phase: None
                     ) -> torch.Tensor:
    """Forward and backward of each micro-batch, loss = sum of token losses x scale; gradients are
    synchronised after the last micro-batch ("last") or after each ("every"). This rank's summed
    token loss (not yet summed over dp x cp)."""
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


def pipeline_engine(stages: Sequence[torch.nn.Module], ids: Sequence[int], parallel: ParallelDims,
                    settings) -> Optional["PipelineEngine"]:
    """The schedule running this rank's stages (build.build_stages'), `settings` config.parallel's
    pp_schedule and pp_microbatches (0: one per stage); None at parallel.pp = 1."""
    if parallel.pp == 1:
        return None
    from ..config.pipeline import microbatches
    from ..parallel.pipeline import PipelineEngine

    n_micro = microbatches(settings.pp_microbatches, len(ids) * parallel.pp)
    return PipelineEngine(stages, ids, parallel.pp_group, settings.pp_schedule, n_micro, parallel.device,
                          parallel.mp_group)


def pipeline_forward_backward(engine: "PipelineEngine", batches: Batches, *, scale: float, device: torch.device,
                              at: Callable[[str], None] = lambda phase: None) -> torch.Tensor:
    """forward_backward under pipeline parallelism: each micro-batch of the loader through the
    schedule (parallel.pp_microbatches pipeline micro-batches each), the tokens into the first stage,
    the targets into the last. This rank's summed token loss: 0 on a rank without the last stage
    (sum_loss brings it to every rank). FSDP's gradients are synchronised in each schedule's last
    backward (torch.distributed.pipelining decides: train.grad_sync does not apply)."""
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in batches:
        at("pipeline")
        scaled = engine.step(inputs.to(device) if engine.has_first else None,
                             targets.to(device) if engine.has_last else None, scale)
        if scaled is not None:
            loss_sum += scaled / scale
    return loss_sum


def sum_loss(loss_sum: torch.Tensor, parallel: ParallelDims) -> torch.Tensor:
    """The summed token loss of the global batch on every rank, in place: over dp x cp, then over
    the pipeline's stages (only the last computed a loss; the others hold 0)."""
    dist.all_reduce(loss_sum, group=parallel.dp_cp_group)
    if parallel.pp > 1:
        dist.all_reduce(loss_sum, group=parallel.pp_group)
    return loss_sum
