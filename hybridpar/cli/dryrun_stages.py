"""The dry run at parallel.pp > 1: this rank's pipeline stages, each built by `build_model` on the meta
device and cut to its layers before tensor parallelism's and FSDP's wrapping, then one step's
forward and backward of every micro-batch through them on fake tensors.

What is not rehearsed: the pipeline's sends and receives. torch.distributed.pipelining's schedules
agree on shapes by exchanging values, which fake tensors do not have; a stage's input here stands in
for what the previous stage sends (hidden states of the micro-batch) and its output's gradient for
what the next stage sends back, so the order of the micro-batches is not the schedule's. The
stage's sharding, its tensor-parallel and FSDP collectives, clipping across every stage and the
optimizer run as in training; the planner prices the P2P bytes and the bubble.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config
from ..config.pipeline import microbatches, stage_count


def stage_plan(c: Config, n_layers: int, pp_rank: int) -> tuple[list[int], list[int], int]:
    """(layers per stage, the stages this pp rank holds, the pipeline's stage count)."""
    from ..parallel.pipeline import stage_ids, stage_layer_counts

    p = c.parallel
    n_stages = stage_count(p.pp, p.pp_schedule, p.pp_layers)
    counts = stage_layer_counts(n_layers, n_stages, p.pp_layers or None)
    return counts, stage_ids(pp_rank, p.pp, n_stages // p.pp, p.pp_schedule), n_stages


def build_stages(c: Config, args, parallel, counts: list[int], ids: list[int]) -> list[nn.Module]:
    """This rank's stage modules on the meta device, as the trainer builds them."""
    from ..build import build_model
    from ..parallel.pipeline import keep_stage

    return [build_model(args, parallel, device=torch.device("meta"), sequence_parallel=c.parallel.sequence_parallel,
                        load=lambda model, s=s: keep_stage(model, s, counts), fsdp=c.fsdp) for s in ids]


def pipeline_step(c: Config, stages: list[nn.Module], ids: list[int], n_stages: int, parallel
                  ) -> tuple[torch.optim.Optimizer, list]:
    """The trainer's step at pp > 1 on fake tensors; (optimizer, the gradients after backward)."""
    from ..parallel import vocab_parallel_cross_entropy
    from ..train import stop
    from ..train.optim import build_optimizer, clip_gradients
    from ..train.step import context_parts, count_targets, gradient_scale

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
    dim = stages[0].args.dim
    for accum in range(t.grad_accum):
        for i in range(m):
            last = accum == t.grad_accum - 1 and i == m - 1
            for stage, s in zip(stages, ids):
                stage.set_requires_gradient_sync(last)
                x = inputs if s == 0 else torch.zeros(*inputs.shape, dim, requires_grad=True)
                out = stage(x)
                if s == n_stages - 1:
                    loss = vocab_parallel_cross_entropy(out, targets, parallel=parallel, reduction="sum")
                    (loss * scale).backward()
                    loss_sum += loss.detach()
                else:
                    out.backward(torch.zeros_like(out))
    dist.all_reduce(loss_sum, group=parallel.pp_group)  # the last stage's loss, for every rank's log
    dist.all_reduce(loss_sum, group=parallel.dp_cp_group)
    params = list(whole.parameters())
    clip_gradients(params, c.optim.grad_clip, parallel.device, also_sum=[0.0] * len(stop.STOP_SIGNALS))
    grads = [p.grad for p in params if p.grad is not None]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer, grads
