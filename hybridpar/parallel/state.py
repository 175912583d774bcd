"""Moving full (unsharded) tensors in and out of a model whose parameters are DTensors."""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..compat.torch import compute_local_shape_and_global_offset


Box = tuple[tuple[int, ...], tuple[int, ...]]


def block(tensor: DTensor) -> Box:
    """(offset, shape) of the block of the full tensor this rank holds (local_slice's)."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)


def local_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The part of `full` that this rank holds in a DTensor laid out like `like` (no communication)."""
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"full tensor has shape {tuple(full.shape)}, the parameter {tuple(like.shape)}")
    offset, shape = block(like)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def local_box(param: torch.Tensor, name: str, error_type: type = ValueError) -> Box:
    """(offset, shape): the block of the full tensor this rank holds of a tensor-parallel parameter.

    Only before FSDP: its Shard subclasses interleave, so an FSDP-wrapped parameter is refused
    (error_type, naming the parameter)."""
    if not isinstance(param, DTensor):
        return (0,) * param.dim(), tuple(param.shape)
    for placement in param.placements:
        if not (type(placement) is Shard or isinstance(placement, Replicate)):
            raise error_type(
                f"{name} is placed as {param.placements} on mesh dims {param.device_mesh.mesh_dim_names}: "
                "checkpoints are sliced into a model before FSDP; load before apply_fsdp"
            )
    return block(param)


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors into a module's (possibly sharded) parameters and buffers; names must match exactly."""
    own = dict(module.state_dict())
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}")
    for name, target in own.items():
        full = state_dict[name]
        if isinstance(target, DTensor):
            target.to_local().copy_(local_slice(full, target))
        else:
            if target.shape != full.shape:
                raise ValueError(f"{name}: shape {tuple(full.shape)} does not match the model's {tuple(target.shape)}")
            target.copy_(full)


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor (gathers across ranks: collective, for tests and export)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}


@torch.no_grad()
def gather_to(tensor: DTensor, dst: int, blocks: Sequence[Box]) -> Optional[torch.Tensor]:
    """The full tensor on rank `dst`, None on the others; blocks[r] = rank r's block() (global ranks).

    Collective over the default group, point to point: each block goes once (replicas stay quiet)
    to dst, which places it in the full tensor, allocated once. So dst holds the full tensor and
    one block at its peak, the others nothing more than their block: DTensor.full_tensor gives
    every rank the full tensor and, under FSDP2 + TP, holds ~2.75x it at its peak (two gathers and
    the reordering of FSDP's strided shards; bench/export_hf.py). Every rank must call it for the
    same tensors in the same order (the messages between two ranks keep their order)."""
    rank, local = dist.get_rank(), tensor.to_local()
    senders: dict[Box, int] = {}
    for r, box in enumerate(blocks):
        if math.prod(box[1]):
            senders.setdefault(box, r)
    if rank != dst:
        if senders.get(blocks[rank]) == rank:
            dist.send(local.contiguous(), dst)
        return None
    full = torch.empty(tensor.shape, dtype=local.dtype, device=local.device)
    for (offset, shape), r in senders.items():
        view = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if r == rank:
            view.copy_(local)
        elif view.is_contiguous():  # a block of whole rows: received in place
            dist.recv(view, src=r)
        else:
            received = torch.empty(shape, dtype=local.dtype, device=local.device)
            dist.recv(received, src=r)
            view.copy_(received)
    return full
