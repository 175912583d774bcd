"""Pipeline parallelism (parallel.pp) priced: the stage split, the bubble, the micro-batches in flight
per schedule, and the P2P bytes between stages (torch.distributed.pipelining's schedules).

The schedules' facts (stages per rank, the micro-batches each needs and keeps in flight) and the
stage split (torchtitan's rule: the embedding and the output head counted as a layer each) are
hybridpar.pipeline.schedules', the ones the trainer runs: the planner prices the stages it builds.
"""

from __future__ import annotations

from ..pipeline.schedules import SCHEDULES, stage_ids, stage_layer_counts


def stage_units(n_layers: int, pp: int, v: int = 1, schedule: str = "1F1B") -> int:
    """Units (blocks, the embedding, the head) on the rank that holds most of the pp x v stages
    stage_layer_counts cuts (looped ranks, or the V of `schedule`)."""
    counts = stage_layer_counts(n_layers, pp * v)
    units = [n + (s == 0) + (s == len(counts) - 1) for s, n in enumerate(counts)]
    return max(sum(units[s] for s in stage_ids(r, pp, v, schedule)) for r in range(pp))


def rank_layers(n_layers: int, pp: int, v: int = 1, schedule: str = "1F1B") -> list[list[int]]:
    """The transformer layers (their global indices) each of the pp ranks holds, over its stages."""
    counts = stage_layer_counts(n_layers, pp * v)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [sorted(i for s in stage_ids(r, pp, v, schedule) for i in range(starts[s], starts[s] + counts[s]))
            for r in range(pp)]


def bubble_fraction(pp: int, v: int, m: int) -> float:
    """The share of a step a rank idles: (p - 1) / (v m + p - 1) (Narayanan et al. 2021, eq. 1 and
    its interleaved form)."""
    return (pp - 1) / (v * m + pp - 1)


def in_flight(schedule: str, pp: int, v: int, m: int) -> float:
    """Micro-batches whose activations the first rank holds at its peak, in units of one micro-batch
    through all of that rank's layers: the schedule's rule (pipeline.schedules.SCHEDULES)."""
    return SCHEDULES[schedule].in_flight(pp, v, m)


def schedule_stages(schedule: str, v: int) -> int:
    """The v a schedule runs; ValueError for an unknown one or an interleaved one at v < 2."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    fixed = SCHEDULES[schedule].stages_per_rank
    if not fixed and v < 2:
        raise ValueError(f"{schedule} runs two or more stages per rank: set v >= 2, got {v}")
    return fixed or v
