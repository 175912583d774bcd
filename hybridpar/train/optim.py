"""The optimizer step's pieces: AdamW with its parameter groups, the learning-rate schedule, and
the global gradient norm with clipping (whose all-reduce also carries the stop vote: stop.py)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat.torch import foreach_mul_, tensor_norms
from ..parallel.float8_gather import gathered_weights, precompute_float8_scales


def build_optimizer(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], config, fused: bool = True
                    ) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings only (norm weights are scales, not features).
    fused=False takes torch's multi-tensor (foreach) AdamW instead. `model`: a module, or a list of
    them (a rank's pipeline stages): one optimizer over all their parameters. With weights FSDP
    gathers in float8 (float8.fsdp_all_gather), each step is followed by their scales' precompute."""
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    params = [p for m in modules for p in m.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one kernel over all local shards. On the CPU too: foreach walks DTensor parameters one
    # at a time (bench/README.md compares the two).
    fused = fused and params[0].device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
        **({"fused": True} if fused else {"foreach": True}),
    )
    if gathered_weights(modules):
        # A hook of the optimizer: every step that changes the weights (the trainer's, the dry run's, a
        # benchmark's) is followed by the scales the next all-gather casts them with; a skipped one keeps them.
        optimizer.register_step_post_hook(lambda *_: precompute_float8_scales(modules))
    return optimizer


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup to 1, then cosine decay that would reach min_ratio at step `total` (the last
    step, total - 1, is a hair above it)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def grad_norm_and_clip(params: list[torch.nn.Parameter], max_norm: float, device: Optional[torch.device] = None,
                       *, also_sum: Sequence[float] = ()) -> tuple[float, list[float]]:
    """Global L2 norm of every gradient across mp and dp; clip to max_norm when it is > 0. Returns
    (norm, `also_sum` summed over the ranks in the same all-reduce: the stop vote rides on it)."""
    norm, *sums = clip_gradients(params, max_norm, device, also_sum=also_sum).tolist()  # one copy to the host
    return norm, sums


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, device: Optional[torch.device] = None,
                   *, also_sum: Sequence[float] = ()) -> torch.Tensor:
    """grad_norm_and_clip without reading the result back: [norm, *also_sum summed over the ranks].

    Each rank sums the squares of its local shards, dividing by the number of ranks holding the
    same values (the mesh dims where the gradient is replicated), and one all-reduce of that scalar
    over the world gives the squared norm of the whole model: one collective, instead of DTensor's
    sequential all-reduces per mesh dim. `device` is where that all-reduce runs (default: the
    gradients' own): with CPU offload the gradients live on the CPU while the group may be nccl only.
    """
    locals_, copies = [], []
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            copies.append(math.prod(mesh.size(i) for i, pl in enumerate(grad.placements) if pl.is_replicate()))
            grad = grad.to_local()
        else:  # a plain tensor: the same on every rank
            copies.append(dist.get_world_size())
        locals_.append(grad)
    if locals_:
        norms = tensor_norms(locals_)
        weights = torch.tensor(copies, dtype=torch.float32, device=norms.device)
        total_sq = (norms.square() / weights).sum().to(device or norms.device)
    else:
        total_sq = torch.zeros((), device=device)
    summed = torch.cat([total_sq.reshape(1), torch.tensor(also_sum, dtype=torch.float32, device=total_sq.device)])
    dist.all_reduce(summed)
    total = summed[0].sqrt()
    if max_norm > 0 and locals_:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        foreach_mul_(locals_, coef.to(locals_[0].device, locals_[0].dtype))
    return torch.cat([total.reshape(1), summed[1:]])


class NonFiniteLossError(FloatingPointError):
    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def apply_update(optimizer: torch.optim.Optimizer, scheduler, loss: float, grad_norm: float, *, on_nonfinite: str,
                 step: int) -> bool:
    """The end of optimizer step `step`: the update, unless the loss or the gradient norm is not
    finite (train.on_nonfinite "skip": skipped; "stop": NonFiniteLossError on every rank); then the
    learning-rate schedule's step. Whether the update was skipped."""
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if skipped and on_nonfinite == "stop":
        raise NonFiniteLossError(
            f"step {step}: loss {loss}, gradient norm {grad_norm}: training stopped. "
            "Lower optim.lr, check the data, or set train.on_nonfinite = \"skip\" to skip such steps")
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return skipped
