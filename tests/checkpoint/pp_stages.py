"""Helpers for the pipeline checkpoint tests (they run inside the workers): this rank's stage modules
of a small Transformer, cut as the trainer cuts them (hybridpar.pipeline.cutting), optionally FSDP'd
as build_model does, and the full values of their parameters and optimizer state by name."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# A layout: (world, pp, mp, dp_shard, schedule, stages per rank, fsdp)
LAYOUTS = {
    "pp1": (1, 1, 1, 1, "1F1B", 1, False),
    "pp1-mp2": (2, 1, 2, 1, "1F1B", 1, False),
    "pp2": (2, 2, 1, 1, "1F1B", 1, False),
    "pp2-interleaved": (2, 2, 1, 1, "Interleaved1F1B", 2, False),
    "pp2-dp2-fsdp": (4, 2, 1, 2, "1F1B", 1, True),
    "pp4": (4, 4, 1, 1, "1F1B", 1, False),
    "pp4-fsdp": (4, 4, 1, 1, "1F1B", 1, True),
    "pp2-embedding-alone": (2, 2, 1, 1, "1F1B", 1, False),
}
PP_LAYERS = {"pp2-embedding-alone": [0, 6]}  # parallel.pp_layers: the first stage the embedding alone, no norm


def small_args(**overrides):
    from hybridpar.models.args import ModelArgs

    fields = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "n_layers": 6, **overrides}
    return ModelArgs.from_preset("tiny", **fields)


def layout_parallel(name: str):
    from tests.distributed import parallel_dims

    _, pp, mp, dp_shard, _, _, _ = LAYOUTS[name]
    return parallel_dims(mp=mp, dp_shard=dp_shard, pp=pp)


def stage_ids_of(name: str, parallel, n_layers: int) -> tuple[list[int], list[int]]:
    """(the stage ids this rank holds, the layer counts of every stage) in layout `name`."""
    from hybridpar.pipeline.schedules import stage_ids, stage_layer_counts

    _, pp, _, _, schedule, virtual, _ = LAYOUTS[name]
    return stage_ids(parallel.pp_rank, pp, virtual, schedule), stage_layer_counts(n_layers, pp * virtual,
                                                                                  PP_LAYERS.get(name))


def stage_modules(name: str, args, seed: int, *, device: Optional[str] = None) -> list[nn.Module]:
    """This rank's stage modules in layout `name`: the unsplit Transformer of `seed` cut by build_stage
    (so every layout holds the same weights), FSDP'd as build_model does when the layout says so.
    device "meta": built without memory and allocated (to be loaded)."""
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.pipeline.cutting import build_stage

    parallel = layout_parallel(name)
    ids, counts = stage_ids_of(name, parallel, args.n_layers)
    out = []
    for stage in ids:
        torch.manual_seed(seed)
        model = build_stage(args, parallel, stage, counts, device=torch.device(device) if device else None)
        if device == "meta":
            model.to_empty(device="cpu")
        if LAYOUTS[name][6]:
            model = apply_fsdp(model, parallel, FSDPConfig(param_dtype="float32"))
        out.append(model)
    return out


def optimizer_of(stages: list[nn.Module], lr: float = 1e-3) -> torch.optim.Optimizer:
    """The trainer's AdamW (two groups: decayed matrices, norms without decay) over every stage."""
    from hybridpar.config import OptimConfig
    from hybridpar.train.optim import build_optimizer

    return build_optimizer(nn.ModuleList(stages), OptimConfig(lr=lr))


def take_steps(stages: list[nn.Module], optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    """Optimizer steps on random gradients (each rank its own: the values only need to be saved and
    read back), so that every exp_avg, exp_avg_sq and step is a value of its own."""
    gen = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    for _ in range(steps):
        for model in stages:
            for p in model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                grad = torch.randn(local.shape, generator=gen, dtype=local.dtype)
                p.grad = (DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                          if isinstance(p, DTensor) else grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def values(stages: list[nn.Module], optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """{name: full tensor} of every parameter of these stages and, with an optimizer, of every state
    ("NAME/exp_avg", ...), and each param group's hyperparameters (collective within a stage)."""
    from hybridpar.checkpoint.stages import one_module

    model = one_module(stages)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"params": {n: full(p) for n, p in model.named_parameters()}, "state": {}, "groups": []}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in optimizer.state.get(p, {}).items():
                    out["state"][f"{names[id(p)]}/{key}"] = full(value)
        out["groups"] = [{k: v for k, v in g.items() if k in ("lr", "weight_decay", "betas", "eps")}
                         for g in optimizer.param_groups]
    return out
