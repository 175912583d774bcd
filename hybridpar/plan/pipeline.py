"""Pipeline parallelism (parallel.pp) priced: the stage split, the bubble, the micro-batches in flight
per schedule, and the P2P bytes between stages (torch.distributed.pipelining's schedules).

Stages are cut by layers with the embedding and the output head counted as a layer each
(torchtitan's rule): pp x v stages of (n_layers + 2) units, v virtual stages per rank.
"""

from __future__ import annotations

import math

# Virtual stages per rank each schedule runs (0: two or more, the layout's v).
SCHEDULE_STAGES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 0, "ZBVZeroBubble": 2}


def stage_units(n_layers: int, pp: int, v: int = 1) -> int:
    """Units (blocks, the embedding, the head) on the rank that holds most: v stages of
    ceil((n_layers + 2) / (pp x v)) each."""
    return v * math.ceil((n_layers + 2) / (pp * v))


def bubble_fraction(pp: int, v: int, m: int) -> float:
    """The share of a step a rank idles: (p - 1) / (v m + p - 1) (Narayanan et al. 2021, eq. 1 and
    its interleaved form)."""
    return (pp - 1) / (v * m + pp - 1)


def in_flight(schedule: str, pp: int, v: int, m: int) -> float:
    """Micro-batches whose activations the first rank holds at its peak, in units of one micro-batch
    through all of that rank's layers. GPipe runs every forward first: m. 1F1B (and ZBV's V, whose
    two stages per rank each hold half the layers) warms up with p: min(p, m). Interleaved 1F1B
    warms up with (v - 1) p + 2 (p - 1) stage-micro-batches of 1/v of the layers each (Megatron-LM's
    schedules.py); with the one running that is p (1 + (p - 1) / (p v)), Korthikanti et al. 2022,
    'Reducing Activation Recomputation in Large Transformer Models', section 4.2.3."""
    if schedule == "GPipe":
        return float(m)
    if schedule == "Interleaved1F1B":
        return min(float(m), pp * (1 + (pp - 1) / (pp * v)))
    return float(min(pp, m))


def schedule_stages(schedule: str, v: int) -> int:
    """The v a schedule runs; ValueError for an unknown one or an interleaved one at v < 2."""
    if schedule not in SCHEDULE_STAGES:
        raise ValueError(f"pp schedule must be one of {', '.join(SCHEDULE_STAGES)}, got {schedule!r}")
    fixed = SCHEDULE_STAGES[schedule]
    if not fixed and v < 2:
        raise ValueError(f"{schedule} runs two or more stages per rank: set v >= 2, got {v}")
    return fixed or v
