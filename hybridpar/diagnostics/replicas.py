"""Replica check: ranks that should hold identical parameter values really do.

Two kinds of copies exist in a hybrid-parallel job: the dp_replicate copies of each FSDP shard
(hybrid sharding, no_shard), and the mp copies of parameters replicated over the model-parallel
group (the norms). A missed gradient all-reduce, a rank-dependent update or silent data
corruption makes them drift apart without any error. Each rank takes two int64 checksums of the
raw bits of every local shard on its own device (no copy to the host); one all-gather compares them.
Under pipeline parallelism each stage holds other parameters: copies are only looked for among the
ranks of one stage, and a difference is named with its stage.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor

from ..mesh.layout import MeshCoords
from ..mesh.device import ParallelDims
from ..mesh.ranks import gather_objects
from ..compat.torch import all_gather_single


# Parameters are read as their raw bits: an integer type of their element size (others byte by byte).
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatchError(RuntimeError):
    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def checksums(modules: Sequence[torch.nn.Module]) -> tuple[list[str], list[bool], list[int], torch.Tensor]:
    """Names, whether each is replicated over mp, the index of its module, and [n, 2] checksums of the local shards."""
    names, mp_replicated, owner, sums = [], [], [], []
    for k, model in enumerate(modules):
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
            owner.append(k)
    return names, mp_replicated, owner, torch.stack(sums) if sums else torch.zeros((0, 2), dtype=torch.int64)


def _replicated_over_mp(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names is None:
        return False
    dims = param.device_mesh.mesh_dim_names
    return "mp" in dims and param.placements[dims.index("mp")].is_replicate()


def check_replicas(model: Union[torch.nn.Module, Sequence[torch.nn.Module]], parallel: ParallelDims, step: int,
                   stages: Optional[Sequence[int]] = None) -> None:
    """Collective: raise ReplicaMismatchError on every rank naming the parameters and ranks that differ.
    `model`: the model, or this rank's stage modules under pipeline parallelism (one per stage it
    holds, `stages` their stage indices; default: the rank's pp coordinate). Only ranks of one stage
    hold copies of each other's values: each stage's are compared among themselves."""
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    names, mp_replicated, owner, local = checksums(modules)
    if stages is None or len(stages) != len(modules):
        stages = [parallel.pp_rank] * len(modules)
    # The stages hold different parameters, so every rank's (stage, name, mp-replicated) come along
    # (rank r's row i is held[r][i]) and the tables, of different lengths, are padded to the longest.
    held = gather_objects([(stages[k], name, rep) for k, name, rep in zip(owner, names, mp_replicated)])
    rows = max(len(h) for h in held)
    local = torch.cat([local, local.new_zeros((rows - local.shape[0], 2))]).to(parallel.device)  # nccl needs cuda
    table = torch.empty((parallel.world_size * rows, 2), dtype=local.dtype, device=local.device)
    all_gather_single(table, local.contiguous())
    table = table.view(parallel.world_size, rows, 2).cpu()
    coords = [MeshCoords.of(r, *parallel.sizes) for r in range(parallel.world_size)]
    problems = []
    # Copies of one FSDP shard: same stage, shard_idx, cp_rank and mp_rank, every replicate_idx.
    copies: dict[tuple, list[int]] = {}
    for c in coords:
        copies.setdefault((c.pp_rank, c.shard_idx, c.cp_rank, c.mp_rank), []).append(c.rank)
    for ranks in copies.values():
        problems += _differences(table, held, ranks, "data-parallel replicas", parallel.pp > 1, everything=True)
    # Parameters replicated over mp: every rank of a model-parallel group holds the same shard.
    for start in range(0, parallel.world_size, parallel.mp):
        problems += _differences(table, held, list(range(start, start + parallel.mp)), "model-parallel copies",
                                 parallel.pp > 1, everything=False)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ReplicaMismatchError(f"replica check, step {step}: copies that must be identical differ: {shown}")


def _differences(table: torch.Tensor, held: list[list[tuple]], ranks: list[int], what: str, staged: bool,
                 everything: bool) -> list[str]:
    """The parameters that differ among `ranks` (copies of each other): all of them, or (`everything`
    False) those replicated over mp; named with their stage when `staged`."""
    if len(ranks) < 2:
        return []
    first = held[ranks[0]]
    if any(held[r] != first for r in ranks[1:]):  # a copy must hold the same parameters to begin with
        odd = [r for r in ranks if held[r] != first]
        return [f"ranks {odd} hold other parameters than rank {ranks[0]} on {what} {ranks}"]
    found = []
    for i, (stage, name, replicated) in enumerate(first):
        if not (everything or replicated):
            continue
        values = table[ranks, i]
        if not torch.equal(values, values[:1].expand_as(values)):
            odd = [r for r, v in zip(ranks, values) if not torch.equal(v, values[0])]
            where = f"stage {stage}: " if staged else ""
            found.append(f"{where}{name} on {what} {ranks} (ranks {odd} differ from rank {ranks[0]})")
    return found
