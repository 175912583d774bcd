"""Pipeline parallelism's settings (parallel.pp, pp_layers, pp_schedule, pp_microbatches), checked
against the world, the model's layers and the batch in one line each, before anything starts
(hybridpar.preflight calls check_pipeline). Torch-free, except to ask whether this torch has DualPipeV.

Stages: pp ranks, each holding one stage (1F1B, GPipe) or 2 (Interleaved1F1B by default, ZBVZeroBubble
and DualPipeV always: their V shape). parallel.pp_layers gives every stage's transformer layers
instead, in stage order (its length is the number of stages). Counting the embedding and the output
head as a layer each (torchtitan's rule), a model of n layers fills at most n + 2 stages.
"""

from __future__ import annotations

from typing import Sequence

from .options import ConfigError

# parallel.pp_schedule -> torch.distributed.pipelining.schedules' class name.
SCHEDULES = {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe", "Interleaved1F1B": "ScheduleInterleaved1F1B",
             "ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
MULTI_STAGE = ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")  # >= 2 stages per rank
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # exactly 2 stages per rank


def parse_pp_layers(value) -> list[int]:
    """parallel.pp_layers as a list of ints: a TOML list, or a command line's "4,4,3" (or "[4, 4, 3]")."""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").strip("[]").split(",") if v]
    try:
        layers = [int(v) for v in value]
    except (TypeError, ValueError):
        layers = None
    if layers is None or any(isinstance(v, bool) for v in value) or any(n < 0 for n in layers):
        raise ConfigError(f"parallel.pp_layers must list each stage's transformer layers (integers >= 0, e.g. "
                          f"[4, 4, 3] or \"4,4,3\"), got {value!r}")
    return layers


def stage_count(pp: int, schedule: str, pp_layers: Sequence[int]) -> int:
    """The pipeline's stages (all ranks' together): len(pp_layers), else pp x the schedule's stages per rank."""
    return len(pp_layers) if pp_layers else pp * (2 if schedule in MULTI_STAGE else 1)


def microbatches(pp_microbatches: int, stages: int) -> int:
    """parallel.pp_microbatches, 0 meaning one per stage."""
    return pp_microbatches or stages


def check_pipeline(pp: int, schedule: str, pp_layers: Sequence[int], pp_microbatches: int, n_layers: int,
                   batch: int) -> None:
    """ConfigError in one line naming the key to change; `batch` is data.micro_batch_size (the sequences
    one data-parallel coordinate pushes through the pipeline per forward), n_layers the model's."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches must be >= 0 (0: one per stage), got {pp_microbatches}")
    if pp == 1:
        if pp_layers:
            raise ConfigError(f"parallel.pp_layers is set ({list(pp_layers)}) but parallel.pp = 1: set parallel.pp "
                              "to the number of ranks the stages go on, or drop parallel.pp_layers")
        return
    if schedule == "DualPipeV" and not _torch_has(SCHEDULES[schedule]):
        raise ConfigError("parallel.pp_schedule = DualPipeV: this torch has no ScheduleDualPipeV; choose "
                          "ZBVZeroBubble or Interleaved1F1B, or a newer torch")
    stages = stage_count(pp, schedule, pp_layers)
    if stages % pp:
        raise ConfigError(f"parallel.pp_layers lists {stages} stages, not a multiple of parallel.pp = {pp}: give "
                          f"each rank the same number of stages ({pp} or {2 * pp} entries)")
    per_rank = stages // pp
    if schedule in MULTI_STAGE and per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule = {schedule} needs at least 2 stages per rank (virtual stages), "
                          f"but parallel.pp_layers gives {per_rank}: list {2 * pp} stages' layers, or choose 1F1B")
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(f"parallel.pp_schedule = {schedule} needs exactly 2 stages per rank (its V), but "
                          f"parallel.pp_layers gives {per_rank}: list {2 * pp} stages' layers")
    if schedule not in MULTI_STAGE and per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule = {schedule} runs one stage per rank, but parallel.pp_layers "
                          f"gives {per_rank}: list {pp} stages' layers, or choose Interleaved1F1B")
    if pp_layers:
        if sum(pp_layers) != n_layers:
            raise ConfigError(f"parallel.pp_layers sums to {sum(pp_layers)} layers, but the model has {n_layers}: "
                              f"list layers that add up to {n_layers}")
        if any(n == 0 for n in pp_layers[1:-1]):
            raise ConfigError(f"parallel.pp_layers {list(pp_layers)} leaves a middle stage without a layer: give "
                              "every stage but the first and the last at least one")
    elif stages > n_layers + 2:
        raise ConfigError(f"{stages} pipeline stages (parallel.pp = {pp}{' x 2 per rank' if per_rank > 1 else ''}) "
                          f"but the model has {n_layers} layers, {n_layers + 2} counting the embedding and the "
                          f"output: choose a parallel.pp of at most {(n_layers + 2) // per_rank}")
    m = microbatches(pp_microbatches, stages)
    if batch % m:
        raise ConfigError(f"parallel.pp_microbatches = {m} does not divide data.micro_batch_size = {batch}: each "
                          f"pipeline micro-batch holds micro_batch_size / pp_microbatches sequences; choose a "
                          f"divisor of {batch}, or a data.micro_batch_size that is a multiple of {m}")
    needed = {"1F1B": pp, "DualPipeV": stages}.get(schedule, 0)
    if m < needed:
        raise ConfigError(f"parallel.pp_schedule = {schedule} needs at least {needed} micro-batches "
                          f"(parallel.pp_microbatches = {m}): raise parallel.pp_microbatches (and "
                          f"data.micro_batch_size with it)")
    rounds = max(1, m // pp)
    if schedule == "Interleaved1F1B" and m % rounds:
        raise ConfigError(f"parallel.pp_schedule = Interleaved1F1B runs micro-batches in rounds of pp = {pp}: "
                          f"parallel.pp_microbatches = {m} must be a multiple of {rounds} ({pp * rounds} works)")


def _torch_has(name: str) -> bool:
    from torch.distributed.pipelining import schedules

    return hasattr(schedules, name)
