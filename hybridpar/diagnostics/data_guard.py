"""Data guard: catch broken data parallelism at step 1 instead of after a week of training.

Every rank hashes the batch it is about to train on (whole sequences, before context parallelism
takes its chunks) and one all-gather of those 8-byte hashes gives every rank the whole table. Two
rules must hold:
  - the ranks of one data-parallel coordinate (its model-parallel and context-parallel peers) see
    the same batch (they compute one model on the same sequences together);
  - different data-parallel ranks see different batches (else data parallelism does nothing).
The classic mistakes break them recognisably: a sampler given the global rank splits the data of
a model-parallel group; no sampler (or one built with the same rank everywhere) gives every
data-parallel rank the same batch ("every GPU produces the same output").
"""

from __future__ import annotations

import hashlib

import torch

from ..mesh.layout import MeshCoords
from ..mesh.device import ParallelDims
from ..compat.torch import all_gather_single


class DataGuardError(RuntimeError):
    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def batch_fingerprint(*tensors: torch.Tensor) -> int:
    """A 63-bit hash of the batch's contents (the token ids: a few KB to copy and hash)."""
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1  # fits a signed int64


def step_fingerprint(batches) -> int:
    """The fingerprint of one optimizer step's micro-batches, a list of (inputs, targets) pairs."""
    return batch_fingerprint(*(t for pair in batches for t in pair))


def gather_fingerprints(fingerprint: int, parallel: ParallelDims) -> list[int]:
    """Every rank's fingerprint, indexed by global rank (one all-gather of int64s over the world)."""
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=parallel.device)
    table = torch.empty(parallel.world_size, dtype=torch.int64, device=parallel.device)
    all_gather_single(table, mine)
    return table.tolist()


def find_problems(fingerprints: list[int], pp: int, dp_replicate: int, dp_shard: int, cp: int,
                  mp: int) -> list[str]:
    """The rule violations in a table of per-rank fingerprints, as sentences naming the ranks."""
    coords = [MeshCoords.of(r, pp, dp_replicate, dp_shard, cp, mp) for r in range(len(fingerprints))]
    problems = []
    # The ranks of one data-parallel coordinate (its mp and cp peers, contiguous, in every pipeline stage).
    coordinate: dict[int, list[int]] = {}
    for c in coords:
        coordinate.setdefault(c.dp_rank, []).append(c.rank)
    peers = cp * mp
    split_groups = [g for g in coordinate.values() if len({fingerprints[r] for r in g}) > 1]
    if split_groups:
        shown = ", ".join(str(g) for g in split_groups[:4]) + (" ..." if len(split_groups) > 4 else "")
        problems.append(
            f"ranks of one {'model-parallel group' if cp == pp == 1 else 'data-parallel coordinate (its mp, cp and pp peers)'} "
            f"got different batches: {shown}. They compute one model together and must read the same "
            "data. Likely cause: the sampler was built with the global rank "
            "and world size; build it with num_replicas=parallel.dp_size, rank=parallel.dp_rank"
        )
    # One representative per data-parallel rank (mp rank 0, cp rank 0 and stage 0 of each).
    by_batch: dict[int, list[int]] = {}
    for c in coords:
        if c.mp_rank == 0 and c.cp_rank == 0 and c.pp_rank == 0:
            by_batch.setdefault(fingerprints[c.rank], []).append(c.dp_rank)
    duplicates = [ranks for ranks in by_batch.values() if len(ranks) > 1]
    if duplicates:
        every = len(duplicates) == 1 and len(duplicates[0]) == dp_replicate * dp_shard
        listed = "; ".join(
            f"dp ranks {ranks} (global ranks {[d * peers for d in ranks]} and their model-parallel peers)"
            for ranks in duplicates[:4]
        )
        cause = (
            "every data-parallel rank reads the same data: no DistributedSampler, a sampler built with the same "
            "rank on every process, or per-rank data shuffled with equal seeds"
            if every else
            "some data-parallel ranks read the same data: check the sampler's num_replicas and rank"
        )
        problems.append(
            f"data-parallel ranks got identical batches: {listed}. Data parallelism is doing no useful work. "
            f"Likely cause: {cause}. Build the sampler with num_replicas=parallel.dp_size, rank=parallel.dp_rank"
        )
    return problems


def check_data(fingerprint: int, parallel: ParallelDims, step: int) -> None:
    """Collective: raise DataGuardError on every rank if the batches break either rule."""
    table = gather_fingerprints(fingerprint, parallel)
    problems = find_problems(table, *parallel.sizes)
    if problems:
        raise DataGuardError(f"data guard, step {step}: " + " | ".join(problems))
