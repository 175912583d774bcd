"""Small object collectives for exporters that also run as a single process without a process group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def from_rank0(value: Any, world: int) -> Any:
    """Rank 0's `value` on every rank (so every rank takes the same decision)."""
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_all(value: Any, world: int) -> list[Any]:
    """Every rank's `value`, in rank order."""
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out
