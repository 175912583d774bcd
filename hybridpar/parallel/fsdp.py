"""FSDP2 over the data-parallel mesh dims, with the strategy names FSDP1 users know.

    full_shard          shard over every dp rank (1-D dp mesh); reshard after forward
    shard_grad_op       same mesh, keep parameters gathered between forward and backward (ZeRO-2)
    hybrid_shard        shard inside dp_shard, replicate across dp_replicate (2-D mesh)
    hybrid_shard_zero2  hybrid_shard without resharding after forward
    no_shard            replicate over every dp rank (needs dp_shard = 1)

FSDP2 (`fully_shard`), not FSDP1: per-parameter DTensor sharding composes with tensor parallelism,
and no silent NO_SHARD fallback (FSDP1's HYBRID_SHARD with a one-rank shard group stops
all-reducing across replicas; a 2-D FSDP2 mesh with dp_shard = 1 still all-reduces over
dp_replicate). `apply_fsdp` is the sharding, one named step after another; on gloo its last step
hands FSDP's collectives to hybridpar.fastpaths.gloo_collectives. Activation checkpointing and
compile come before it: hybridpar.build.build_model applies all of them, in order.

Expert parallelism (parallel.ep > 1): each MoE layer's experts are an FSDP unit of their own, over
the data-parallel ranks holding the same experts (parallel.expert_fsdp_mesh: dp / ep of them), the
rest of the block over every dp rank as without experts; `expert_mesh_for` picks the mesh.
"""

from __future__ import annotations

import shutil
import warnings
from typing import Optional, Sequence, Union

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .. import fastpaths
from ..config import dtypes
from ..compat.torch import checkpoint_module
from ..fastpaths.gloo_collectives import gather_float8_as_bytes, use_gloo_collectives
from ..config.sharding import FSDPConfig
from ..mesh.device import ParallelDims
from .float8_gather import gathered_weights


def dp_mesh_for(strategy: str, parallel: ParallelDims):
    """The data-parallel mesh a strategy shards over; errors name the sizes to change."""
    if strategy in ("full_shard", "shard_grad_op"):
        if parallel.dp_replicate != 1:
            raise ValueError(
                f"{strategy} shards over every data-parallel rank, but dp_replicate = {parallel.dp_replicate}: "
                "use hybrid_shard (or hybrid_shard_zero2), or set dp_replicate = 1"
            )
        return parallel.dp_cp_mesh
    if strategy == "no_shard" and parallel.cp != 1:
        raise ValueError(
            f"no_shard keeps a whole copy per data-parallel rank, but cp = {parallel.cp} ranks share each copy: "
            "with context parallelism use full_shard, shard_grad_op or a hybrid strategy (they shard over dp_shard x cp)"
        )
    if strategy == "no_shard" and parallel.dp_shard != 1:
        raise ValueError(
            f"no_shard replicates over every data-parallel rank, but dp_shard = {parallel.dp_shard}: "
            f"set dp_shard = 1 and dp_replicate = {parallel.dp_size}"
        )
    return parallel.fsdp_mesh  # 2-D (dp_replicate, dp_shard x cp); no_shard is the case dp_shard x cp = 1


def expert_mesh_for(strategy: str, parallel: ParallelDims):
    """Under expert parallelism, the mesh a strategy shards the experts over (dp_mesh_for's, less the
    ep ranks): the dp_shard / ep ranks holding the same experts, times dp_replicate for the hybrid ones."""
    dp_mesh_for(strategy, parallel)  # the strategy's refusals
    mesh = parallel.expert_fsdp_mesh
    return mesh["dp_shard_mod_ep"] if strategy in ("full_shard", "shard_grad_op") else mesh


def apply_activation_checkpointing(blocks: Union[Sequence[nn.Module], nn.ModuleDict], mode: str,
                                   every: int = 2) -> list[int]:
    """Recompute the activations of the chosen blocks in backward; returns their indices. The
    composable API inserts no wrapper module, so parameter names stay Meta's. `blocks` keyed by
    layer index (a model's `layers`): "selective" picks by that index, so a pipeline stage holding
    layers 5..9 checkpoints the same layers as the whole model."""
    if mode == "none":
        return []
    indexed = [(int(name), block) for name, block in blocks.items()] if isinstance(blocks, nn.ModuleDict) \
        else list(enumerate(blocks))
    chosen = [(i, block) for i, block in indexed if mode == "full" or i % every == 0]
    for _, block in chosen:
        checkpoint_module(block)
    return [i for i, _ in chosen]


def apply_fsdp(model: nn.Module, parallel: ParallelDims, config: Optional[FSDPConfig] = None) -> nn.Module:
    """Shard `model` (a hybridpar.models.llama.Transformer) in place over the data-parallel dims and return it.
    config's activation checkpointing is not applied here: build_model applies it, before this."""
    config = config or FSDPConfig()
    config.validate()
    mesh = dp_mesh_for(config.sharding_strategy, parallel)
    policies = _policies(config, parallel)
    # Under pipeline parallelism a block runs once per micro-batch: kept gathered through the step,
    # its parameters are all-gathered once per step, not per micro-batch (torchtitan does the same).
    reshard = config.sharding_strategy in ("full_shard", "hybrid_shard") and parallel.pp == 1
    experts = _shard_experts(model, parallel, config.sharding_strategy, reshard, policies)  # before their blocks
    _shard_units(model, mesh, reshard, policies)
    _set_prefetch(model, config.forward_prefetch, config.backward_prefetch)
    _gloo_collectives(model, config, parallel, experts)
    return model


def check_compiler(compile: bool, parallel: ParallelDims) -> None:
    """Refuse train.compile on a CPU without a C++ compiler before anything is changed."""
    if compile and parallel.device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++")):
        raise ValueError("train.compile on the CPU needs a C++ compiler (inductor builds its kernels with it): "
                         "install g++ or set train.compile = false")


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each block in place."""
    for block in model.layers.values():
        block.compile()


def _policies(config: FSDPConfig, parallel: ParallelDims) -> dict:
    """fully_shard's precision and offload policies, the same for every unit."""
    offload: OffloadPolicy = OffloadPolicy()
    if config.cpu_offload:
        if parallel.device.type == "cpu":
            # stacklevel 3: the warning points at apply_fsdp's caller, whose setting it is.
            warnings.warn("cpu_offload has no effect: the parameters already live on the CPU", stacklevel=3)
        else:
            offload = CPUOffloadPolicy(pin_memory=True)
    return dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=dtypes.parse(config.param_dtype).torch,
                                       reduce_dtype=dtypes.parse(config.reduce_dtype).torch),
        offload_policy=offload,
    )


def _shard_units(model: nn.Module, mesh, reshard: bool, policies: dict) -> None:
    """One FSDP unit per block (resharded after forward when `reshard`), the token embeddings and the
    output head each their own, then the root (the final norm)."""
    # The embedding's backward reads no weights, yet FSDP needs its unsharded parameter to take the
    # gradient: kept gathered from its forward to its backward (the memory of one unit), it saves an
    # all-gather per step. Tied to the output head, it is used at both ends: the root unit holds it.
    tied = model.args.tie_embeddings
    if not tied and model.tok_embeddings is not None:  # None: a pipeline stage after the first
        fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=False, **policies)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policies)
    # The head runs last in forward and first in backward: resharding it in between only costs a gather.
    if not tied and model.output is not None:
        fully_shard(model.output, mesh=mesh, reshard_after_forward=False, **policies)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **policies)


def _shard_experts(model: nn.Module, parallel: ParallelDims, strategy: str, reshard: bool, policies: dict
                   ) -> list[nn.Module]:
    """Under expert parallelism, each MoE layer's experts (models.moe.GroupedExperts) an FSDP unit over
    expert_mesh_for's ranks; the units made, none at ep 1.

    The gradient: train.step's gradient_scale scales each rank's loss by dp x cp / the global targets,
    for FSDP's average over the dp x cp ranks to leave the global mean loss's gradient. An expert's
    gradient on its rank already holds its whole ep group's tokens (the dispatch's backward brings
    them), and its unit has dp x cp / ep ranks: their sum is every token's, so it is divided by dp x
    cp, not by its ranks, and every layout computes world 1's gradient."""
    if parallel.ep == 1:
        return []
    mesh = expert_mesh_for(strategy, parallel)
    # Sums, then the division: gloo has no pre-multiplied sum. Not with one shard, where FSDP (torch
    # 2.13) divides by the factor before its all-reduce and would divide again after.
    sum_then_divide = mesh.size(mesh.ndim - 1) > 1
    units = []
    for block in model.layers.values():
        experts = getattr(block.feed_forward, "experts", None)
        if experts is None:  # a dense layer
            continue
        fully_shard(experts, mesh=mesh, reshard_after_forward=reshard, **policies)
        experts.set_gradient_divide_factor(parallel.dp_size * parallel.cp)
        experts.set_force_sum_reduction_for_comms(sum_then_divide)
        units.append(experts)
    return units


def _units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units below the root, in forward order."""
    if model.args.tie_embeddings:
        return list(model.layers.values())
    return [u for u in (model.tok_embeddings, *model.layers.values(), model.output) if u is not None]


def _set_prefetch(model: nn.Module, forward: int, backward: int) -> None:
    """Issue the next units' all-gathers early so communication overlaps compute."""
    units = _units(model)
    for i, unit in enumerate(units):
        if forward > 0 and i + 1 < len(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + forward])
        if backward > 0 and i > 0:
            unit.set_modules_to_backward_prefetch(units[max(0, i - backward) : i][::-1])


def _gloo_collectives(model: nn.Module, config: FSDPConfig, parallel: ParallelDims,
                      experts: list[nn.Module]) -> None:
    """On gloo, FSDP's collectives as all-to-alls (a fast path): when the config and the switch allow;
    otherwise FSDP's own, the units' holding float8-gathered weights moving bytes (gloo has no float8)."""
    if config.gloo_all_to_all and fastpaths.enabled():
        use_gloo_collectives([*_units(model), *experts, model], parallel)
    else:
        gather_float8_as_bytes([unit for unit in _units(model) if gathered_weights([unit])], parallel)
