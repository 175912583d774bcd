"""The dry run at parallel.pp > 1: this rank's pipeline stages, built on the meta device as the trainer
builds them (hybridpar.build.build_stages), then one step's forward and backward of every
micro-batch through them on fake tensors.

What is not rehearsed: the pipeline's sends and receives. torch.distributed.pipelining's schedules
agree on shapes by exchanging values, which fake tensors do not have; a stage's input here stands in
for what the previous stage sends (hidden states of the micro-batch) and its output's gradient for
what the next stage sends back, so the order of the micro-batches is not the schedule's. The
stage's sharding, its tensor-parallel and FSDP collectives, clipping across every stage and the
optimizer run as in training; the planner prices the P2P bytes and the bubble.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Config
from ..config.pipeline import microbatches, stage_count


def build_stages(c: Config, args, parallel) -> tuple[list[nn.Module], list[int], int]:
    """This rank's stage modules on the meta device, as the trainer builds them (hybridpar.build.build_stages):
    (the modules, their stage ids, the pipeline's stage count)."""
    from ..build import build_stages as build

    p = c.parallel
    stages, ids = build(args, parallel, p.pp_schedule, p.pp_layers, device=torch.device("meta"),
                        sequence_parallel=p.sequence_parallel, fsdp=c.fsdp)
    return stages, ids, stage_count(p.pp, p.pp_schedule, p.pp_layers)


def pipeline_step(c: Config, stages: list[nn.Module], ids: list[int], n_stages: int, parallel
                  ) -> tuple[torch.optim.Optimizer, list]:
    """The trainer's step at pp > 1 on fake tensors; (optimizer, the gradients after backward)."""
    from ..parallel import vocab_parallel_cross_entropy
    from ..train.optim import build_optimizer
    from ..train.step import context_parts, count_targets, gradient_scale, sum_loss

    d, t = c.data, c.train
    whole = nn.ModuleList(stages)
    optimizer = build_optimizer(whole, c.optim)
    m = microbatches(c.parallel.pp_microbatches, n_stages)
    tokens = torch.zeros(d.micro_batch_size // m, d.seq_len, dtype=torch.long)
    inputs, targets = context_parts([(tokens, tokens)], parallel)[0]
    count_targets([(inputs, targets)] * (m * t.grad_accum), parallel, parallel.device, also_sum=[0.0])
    global_targets = d.micro_batch_size * d.seq_len * t.grad_accum * parallel.dp_size
    scale = gradient_scale(parallel, global_targets)
    loss_sum = torch.zeros((), device=parallel.device)
    # What the previous stage sends: [micro-batch, seq / cp, dim], with sequence parallelism this mp rank's 1/mp.
    sp = c.parallel.sequence_parallel and parallel.mp > 1
    hidden = (*inputs.shape[:1], inputs.shape[1] // (parallel.mp if sp else 1), stages[0].args.dim)
    for accum in range(t.grad_accum):
        for i in range(m):
            last = accum == t.grad_accum - 1 and i == m - 1
            for stage, s in zip(stages, ids):
                # As torch.distributed.pipelining's stage sets FSDP for each backward: the gradients
                # reduced and the parameters resharded after the step's last micro-batch only.
                stage.set_is_last_backward(last)
                stage.set_reshard_after_backward(last)
                stage.set_requires_gradient_sync(last)
                x = inputs if s == 0 else torch.zeros(hidden, requires_grad=True)
                out = stage(x)
                if s == n_stages - 1:
                    loss = vocab_parallel_cross_entropy(out, targets, parallel=parallel, reduction="sum")
                    (loss * scale).backward()
                    loss_sum += loss.detach()
                else:
                    out.backward(torch.zeros_like(out))
    sum_loss(loss_sum, parallel)
    return optimizer, optimizer_step(c, whole, optimizer, parallel)


def optimizer_step(c: Config, model: nn.Module, optimizer: torch.optim.Optimizer, parallel) -> list:
    """The step's end after backward, as the trainer's: clipping over every rank (the stop vote riding
    on it), the optimizer; the gradients as backward left them."""
    from ..train import stop
    from ..train.optim import clip_gradients

    params = list(model.parameters())
    clip_gradients(params, c.optim.grad_clip, parallel.device, also_sum=[0.0] * len(stop.STOP_SIGNALS))
    grads = [p.grad for p in params if p.grad is not None]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grads
