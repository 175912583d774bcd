"""Replica check: ranks that should hold identical parameter values really do.

Two kinds of copies exist in a hybrid-parallel job: the dp_replicate copies of each FSDP shard
(hybrid sharding, no_shard), and the mp copies of parameters replicated over the model-parallel
group (the norms). A missed gradient all-reduce, a rank-dependent update or silent data
corruption makes them drift apart without any error. Each rank takes two int64 checksums of the
raw bits of every local shard on its own device (no copy to the host); one all-gather compares them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..mesh.layout import MeshCoords
from ..mesh.device import ParallelDims
from ..compat.torch import all_gather_single


# Parameters are read as their raw bits: an integer type of their element size (others byte by byte).
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatchError(RuntimeError):
    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def _checksums(model: torch.nn.Module) -> tuple[list[str], list[bool], torch.Tensor]:
    """Names, whether each is replicated over mp, and [n, 2] checksums of the local shards."""
    names, mp_replicated, sums = [], [], []
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        # Integer sums of the bits: a float sum depends on how intra-op threads split it, so equal
        # copies on ranks with other thread counts would differ. int64 overflow wraps, in any order.
        flat = local.detach().reshape(-1).view(_BITS.get(local.element_size(), torch.uint8)).long()
        # Plain sum misses swapped values; the position-weighted sum catches them.
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
        sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
        names.append(name)
        mp_replicated.append(_replicated_over_mp(param))
    return names, mp_replicated, torch.stack(sums)


def _replicated_over_mp(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names is None:
        return False
    dims = param.device_mesh.mesh_dim_names
    return "mp" in dims and param.placements[dims.index("mp")].is_replicate()


def check_replicas(model: torch.nn.Module, parallel: ParallelDims, step: int) -> None:
    """Collective: raise ReplicaMismatchError on every rank naming the parameters and ranks that differ."""
    names, mp_replicated, local = _checksums(model)
    local = local.to(parallel.device)  # with CPU offload the parameters live on the CPU; nccl needs cuda
    table = torch.empty((parallel.world_size * local.shape[0], 2), dtype=local.dtype, device=local.device)
    all_gather_single(table, local.contiguous())
    table = table.view(parallel.world_size, -1, 2).cpu()
    coords = [MeshCoords.of(r, *parallel.sizes) for r in range(parallel.world_size)]
    problems = []
    # Copies of one FSDP shard: same stage, shard_idx, cp_rank and mp_rank, every replicate_idx.
    copies: dict[tuple, list[int]] = {}
    for c in coords:
        copies.setdefault((c.pp_rank, c.shard_idx, c.cp_rank, c.mp_rank), []).append(c.rank)
    for ranks in copies.values():
        problems += _differences(table, names, ranks, "data-parallel replicas", range(len(names)))
    # Parameters replicated over mp: every rank of a model-parallel group holds the same shard.
    replicated = [i for i, r in enumerate(mp_replicated) if r]
    for start in range(0, parallel.world_size, parallel.mp):
        problems += _differences(table, names, list(range(start, start + parallel.mp)), "model-parallel copies",
                                 replicated)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ReplicaMismatchError(f"replica check, step {step}: copies that must be identical differ: {shown}")


def _differences(table: torch.Tensor, names: list[str], ranks: list[int], what: str, indices) -> list[str]:
    if len(ranks) < 2:
        return []
    found = []
    for i in indices:
        values = table[ranks, i]
        if not torch.equal(values, values[:1].expand_as(values)):
            odd = [r for r, v in zip(ranks, values) if not torch.equal(v, values[0])]
            found.append(f"{names[i]} on {what} {ranks} (ranks {odd} differ from rank {ranks[0]})")
    return found
