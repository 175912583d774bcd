"""float8.fsdp_all_gather: FSDP2 all-gathers the float8 linears' weights in float8 (1 byte an
element), through torchao's tensor subclass and FSDP2's extension points.

    gather_in_float8(model, shards)     # before fully_shard: the converted linears' weights wrapped
    precompute_at_first_forward(model)  # after fully_shard: their scales, once FSDP has initialised
    precompute_float8_scales(parts)     # after each optimizer step and each load (build_optimizer's
                                        # hook, Checkpointer.load): their scales again

A converted linear's weight (a DTensor on the mp mesh) gets as its local tensor torchao's
WeightWithDynamicFloat8CastTensor around the same storage. FSDP2 calls its fsdp_pre_all_gather
on the shard, which casts it to float8 with the precomputed scale and hands FSDP the float8 bytes
(uint8 on the wire: a block's norms stay in the param dtype, so FSDP gathers a mixed unit as
bytes); fsdp_post_all_gather makes the gathered bytes a Float8TrainingTensor, which the float8
matmul takes as it is (Float8Matmul.cast: no second cast). The master weights stay fp32, and the
optimizer, clipping and checkpoints see their values (plain_state_dict: no subclass in a file).

The scale of a tensorwise weight is that of the whole weight. Each rank holds a piece: FSDP's
shard of its mp slice. precompute_float8_scales takes each piece's amax, reduces them (MAX) over
every mesh dimension that splits the weight (FSDP's dp_shard x cp and mp; a replicated dimension
holds the same values) in one all-reduce per dimension for all weights, and turns them into
scales with torchao's amax_to_scale: the scales the per-matmul cast computes from the gathered
weight, so a run with the option computes what one without it does. torchao's own precompute
looks for its Float8Linear modules only; without a precomputed scale its pre-all-gather would
reduce over FSDP's mesh only (mp left out), so every path that changes the weights recomputes.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .float8 import torchao_float8
from .layers import ColumnParallelLinear, RowParallelLinear


def _wrapper():
    torchao_float8()  # imported quietly
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return WeightWithDynamicFloat8CastTensor


def _gathered(param) -> bool:
    """Whether `param` is a weight FSDP all-gathers in float8 (its local tensor torchao's subclass),
    told by the class's name: every build and optimizer asks, and torchao is imported only for float8."""
    if not isinstance(param, DTensor):
        return False
    return type(param._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"


def gather_in_float8(model: nn.Module, shards: int) -> list[str]:
    """Before fully_shard: each float8 linear of `model` (convert_to_float8's) gets its weight's
    local tensor wrapped in torchao's subclass, so FSDP2 all-gathers it in float8 over `shards`
    ranks. The values and their storage stay; returns the linears' names. ValueError for a weight
    whose rows `shards` does not divide: torchao's pre-all-gather hands FSDP an uneven shard
    unpadded, and the ranks' all-gather inputs would differ in size (hybridpar.preflight refuses it
    for a job first)."""
    wrapper = _wrapper()
    names = []
    for name, layer in model.named_modules():
        plan = getattr(layer, "float8", None)
        if plan is None or not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            continue
        cast = plan.casts["cast_config_weight"]
        weight = layer.weight
        rows = weight.to_local().shape[0]
        if rows % shards:
            raise ValueError(f"float8.fsdp_all_gather: {name}'s weight has {rows} rows on this mp rank, which "
                             f"the {shards} FSDP shards do not split evenly; set float8.fsdp_all_gather = false "
                             "or add the layer to float8.skip")
        local = wrapper(weight.to_local(), plan.mm_config, cast.config.target_dtype)
        layer.weight = nn.Parameter(
            DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                               shape=weight.shape, stride=weight.stride()),
            requires_grad=weight.requires_grad)
        names.append(name)
    return names


def gathered_weights(parts: Iterable[nn.Module]) -> list[tuple[nn.Module, DTensor]]:
    """(linear, weight) of each float8 linear in `parts` whose weight FSDP gathers in float8."""
    return [(m, m.weight) for part in parts for m in part.modules()
            if getattr(m, "float8", None) is not None and _gathered(getattr(m, "weight", None))]


def _split_groups(weight: DTensor) -> list:
    """The process groups of the mesh dimensions that split `weight`: more than one rank, not
    replicated (FSDP's shard of a dimension mp splits too is a _StridedShard, not a Shard)."""
    mesh = weight.device_mesh
    return [mesh.get_group(i) for i, pl in enumerate(weight.placements) if not pl.is_replicate() and mesh.size(i) > 1]


def _ranks(groups: list) -> list:
    return [dist.get_process_group_ranks(g) for g in groups]


@torch.no_grad()
def precompute_float8_scales(parts: Iterable[nn.Module]) -> int:
    """Every gathered weight's float8 scale from the amax of the whole weight (FSDP's shards and
    the mp slices together), stored where its pre-all-gather reads it; the number of weights.
    Collective over the weights' mesh dims: every rank holding a piece of them calls it."""
    found = gathered_weights(parts)
    if not found:
        return 0
    from torchao.float8.float8_utils import amax_to_scale

    # max |w| of each rank's piece (an inf-norm; 0 for an empty shard), then of the whole weight
    pieces = [w._local_tensor._tensor for _, w in found]
    amax = torch.stack(torch._foreach_norm(pieces, ord=math.inf)).float()
    groups = _split_groups(found[0][1])
    if any(_ranks(_split_groups(w)) != _ranks(groups) for _, w in found):  # one all-reduce for all: one mesh
        raise ValueError("the float8 weights FSDP gathers are not all split over the same ranks")
    for group in groups:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for (layer, weight), a in zip(found, amax):
        plan = layer.float8
        cast = plan.casts["cast_config_weight"]
        weight._local_tensor._precomputed_scale = amax_to_scale(a, cast.config.target_dtype,
                                                                plan.config.round_scales_to_power_of_2)
    return len(found)


def precompute_at_first_forward(model: nn.Module) -> None:
    """The scales computed once, at `model`'s first forward (every rank's), after FSDP's lazy
    initialisation: that pads an uneven shard into a new local tensor, which has no scale yet."""

    def once(module: nn.Module, args) -> None:
        handle.remove()
        precompute_float8_scales([module])

    # After FSDP's own pre-forward hook (prepended: its lazy init), before any block's all-gather.
    handle = model.register_forward_pre_hook(once)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A gathered weight as a DTensor of its plain local values (the same storage); anything else as it is."""
    if not _gathered(tensor):
        return tensor
    return DTensor.from_local(tensor._local_tensor._tensor, tensor.device_mesh, tensor.placements,
                              run_check=False, shape=tensor.shape, stride=tensor.stride())


def plain_state_dict(state: dict) -> dict:
    """A model state dict whose gathered weights are plain DTensors: what DCP writes and reads."""
    return {k: plain(v) for k, v in state.items()}
