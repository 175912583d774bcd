"""Pipeline parallelism's rules, torch-free: the schedules (SCHEDULES: torch's class, stages per
rank, V shape, the micro-batches each needs, the activations it keeps in flight), the stage split
(stage_layer_counts: torchtitan's rule), which stages a rank holds (stage_ids), and this rank's share
of them all (StageLayout, which hybridpar.pipeline.cutting builds and hybridpar.pipeline.runner runs);
and every refusal of the settings (parallel.pp, pp_layers, pp_schedule, pp_microbatches) against the
world, the model and the batch, one line each, before anything starts (check_pipeline, which
hybridpar.preflight calls for the job and its dry run). The planner (hybridpar.plan) reads the same
facts. Torch-free, except to ask whether this torch has a schedule's class (DualPipeV is new).

Stages: pp ranks, each holding one stage (1F1B, GPipe) or 2 (Interleaved1F1B by default, ZBVZeroBubble
and DualPipeV always: their V shape). parallel.pp_layers gives every stage's transformer layers
instead, in stage order (its length is the number of stages). Counting the embedding and the output
head as a layer each (torchtitan's rule), a model of n layers fills at most n + 2 stages. A layer
keeps its name in its stage (`layers.37` stays `layers.37`), so checkpoints do not depend on pp.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from ..config.options import ConfigError


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What hybridpar knows of one parallel.pp_schedule."""

    torch_class: str  # torch.distributed.pipelining.schedules' class
    stages_per_rank: int  # 1 or 2 exactly; 0: two or more (interleaved: the layout's v, 2 by default)
    v_shape: bool  # rank r holds stages r and 2p-1-r; else looped: r, r + p, r + 2p, ...
    one_per_stage: bool  # torch refuses fewer micro-batches than stages (all ranks' together)
    in_rounds: bool  # micro-batches run in rounds of pp: their number a multiple of max(1, m // pp)
    # The planner's activations: micro-batches whose activations the first rank holds at its peak,
    # in units of one micro-batch through all of that rank's layers, for pp p, v stages per rank, m
    # micro-batches.
    in_flight: Callable[[int, int, int], float]


def _interleaved_in_flight(p: int, v: int, m: int) -> float:
    """Interleaved 1F1B warms up with (v - 1) p + 2 (p - 1) stage-micro-batches of 1/v of the layers
    each (Megatron-LM's schedules.py); with the one running that is p (1 + (p - 1) / (p v)),
    Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models', 4.2.3."""
    return min(float(m), p * (1 + (p - 1) / (p * v)))


# parallel.pp_schedule -> its facts. GPipe runs every forward first: all m in flight. 1F1B (and ZBV's
# V, whose two stages per rank each hold half the layers) warms up with p: min(p, m). DualPipeV keeps
# one more (DeepSeek-V3's DualPipe: PP + 1 micro-batches of activations).
SCHEDULES = {
    "1F1B": Schedule("Schedule1F1B", 1, False, True, False, lambda p, v, m: float(min(p, m))),
    "GPipe": Schedule("ScheduleGPipe", 1, False, False, False, lambda p, v, m: float(m)),
    "Interleaved1F1B": Schedule("ScheduleInterleaved1F1B", 0, False, False, True, _interleaved_in_flight),
    "ZBVZeroBubble": Schedule("ScheduleZBVZeroBubble", 2, True, False, False, lambda p, v, m: float(min(p, m))),
    "DualPipeV": Schedule("ScheduleDualPipeV", 2, True, True, False, lambda p, v, m: float(min(p + 1, m))),
}
MULTI_STAGE = tuple(n for n, s in SCHEDULES.items() if s.stages_per_rank != 1)  # >= 2 stages per rank
V_SHAPED = tuple(n for n, s in SCHEDULES.items() if s.v_shape)  # exactly 2 stages per rank, as a V


def stages_per_rank(schedule: str) -> int:
    """The stages each rank holds unless parallel.pp_layers says otherwise: 2 for the interleaved."""
    return SCHEDULES[schedule].stages_per_rank or 2


def max_stages(n_layers: int) -> int:
    """The most stages a model of n_layers fills: the embedding and the head count as a layer each."""
    return n_layers + 2


def stage_layer_counts(n_layers: int, n_stages: int, override: Optional[Sequence[int]] = None, *,
                       pp: int = 0) -> list[int]:
    """Transformer layers per stage (torchtitan's rule). The embedding and the output head each count
    as a layer: n_layers + 2 units split as evenly as possible, the remainder to the first stages,
    the first stage giving one to the embedding and the last one to the head. `override`: the counts
    themselves (parallel.pp_layers), checked. ConfigError (a ValueError) in one line; `pp`, the
    stages' ranks when known, lets it name the parallel.pp to choose."""
    if override is not None:
        counts = list(override)
        if len(counts) != n_stages or min(counts, default=0) < 0:
            raise ConfigError(f"parallel.pp_layers = {counts} must give {n_stages} stages non-negative layer "
                              f"counts summing to n_layers = {n_layers}")
        if sum(counts) != n_layers:
            raise ConfigError(f"parallel.pp_layers sums to {sum(counts)} layers, but the model has {n_layers}: "
                              f"list layers that add up to {n_layers}")
        if any(n == 0 for n in counts[1:-1]):
            raise ConfigError(f"parallel.pp_layers {counts} leaves a middle stage without a layer: give "
                              "every stage but the first and the last at least one")
        return counts
    units = max_stages(n_layers)
    if n_stages > units:
        ranks, fix = "", f"at most {units} stages (parallel.pp x stages per rank)"
        if pp:  # the stages' ranks known: name the parallel.pp that fits
            per_rank = n_stages // pp
            ranks = f" (parallel.pp = {pp}{f' x {per_rank} per rank' if per_rank > 1 else ''})"
            fix = f"a parallel.pp of at most {units // per_rank}"
        raise ConfigError(f"{n_stages} pipeline stages{ranks} but the model has {n_layers} layers, {units} counting "
                          f"the embedding and the output: choose {fix}")
    base, extra = divmod(units, n_stages)
    counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    counts[0] -= 1
    counts[-1] -= 1
    return counts


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stage indices rank pp_rank holds: looped (r, r+p, r+2p, ...) or, for the V schedules, r and 2p-1-r."""
    if SCHEDULES[schedule].v_shape:
        if virtual != 2:
            raise ValueError(f"{schedule} runs 2 stages per rank, not {virtual}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def least_microbatches(schedule: str, stages: int) -> int:
    """The fewest micro-batches torch's schedule takes over `stages` stages (all ranks' together)."""
    return stages if SCHEDULES[schedule].one_per_stage else 1


def rounds_of(schedule: str, pp: int, m: int) -> int:
    """For a schedule that runs micro-batches in rounds of pp: the rounds, which must divide m; else 1."""
    return max(1, m // pp) if SCHEDULES[schedule].in_rounds else 1


def stage_count(pp: int, schedule: str, pp_layers: Sequence[int]) -> int:
    """The pipeline's stages (all ranks' together): len(pp_layers), else pp x the schedule's stages per rank."""
    return len(pp_layers) if pp_layers else pp * stages_per_rank(schedule)


def microbatches(pp_microbatches: int, stages: int) -> int:
    """parallel.pp_microbatches, 0 meaning one per stage."""
    return pp_microbatches or stages


def check_pipeline(pp: int, schedule: str, pp_layers: Sequence[int], pp_microbatches: int, n_layers: int,
                   batch: int) -> None:
    """ConfigError in one line naming the key to change; `batch` is data.micro_batch_size (the sequences
    one data-parallel coordinate pushes through the pipeline per forward), n_layers the model's."""
    if schedule not in SCHEDULES:
        check_schedule(schedule)
    if pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches must be >= 0 (0: one per stage), got {pp_microbatches}")
    if pp == 1:
        if pp_layers:
            raise ConfigError(f"parallel.pp_layers is set ({list(pp_layers)}) but parallel.pp = 1: set parallel.pp "
                              "to the number of ranks the stages go on, or drop parallel.pp_layers")
        return
    check_schedule(schedule)
    stages = stage_count(pp, schedule, pp_layers)
    if stages % pp:
        raise ConfigError(f"parallel.pp_layers lists {stages} stages, not a multiple of parallel.pp = {pp}: give "
                          f"each rank the same number of stages ({pp} or {2 * pp} entries)")
    per_rank, fixed = stages // pp, SCHEDULES[schedule].stages_per_rank
    if fixed != 1 and per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule = {schedule} needs at least 2 stages per rank (virtual stages), "
                          f"but parallel.pp_layers gives {per_rank}: list {2 * pp} stages' layers, or choose 1F1B")
    if fixed == 2 and per_rank != 2:
        raise ConfigError(f"parallel.pp_schedule = {schedule} needs exactly 2 stages per rank (its V), but "
                          f"parallel.pp_layers gives {per_rank}: list {2 * pp} stages' layers")
    if fixed == 1 and per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule = {schedule} runs one stage per rank, but parallel.pp_layers "
                          f"gives {per_rank}: list {pp} stages' layers, or choose Interleaved1F1B")
    # The split itself: no more stages than units to cut; pp_layers that add up, no middle stage empty.
    stage_layer_counts(n_layers, stages, list(pp_layers) or None, pp=pp)
    m = microbatches(pp_microbatches, stages)
    if batch % m:
        raise ConfigError(f"parallel.pp_microbatches = {m} does not divide data.micro_batch_size = {batch}: each "
                          f"pipeline micro-batch holds micro_batch_size / pp_microbatches sequences; choose a "
                          f"divisor of {batch}, or a data.micro_batch_size that is a multiple of {m}")
    needed = least_microbatches(schedule, stages)
    if m < needed:
        raise ConfigError(f"parallel.pp_schedule = {schedule} needs at least {needed} micro-batches "
                          f"(parallel.pp_microbatches = {m}): raise parallel.pp_microbatches (and "
                          f"data.micro_batch_size with it)")
    rounds = rounds_of(schedule, pp, m)
    if m % rounds:
        raise ConfigError(f"parallel.pp_schedule = {schedule} runs micro-batches in rounds of pp = {pp}: "
                          f"parallel.pp_microbatches = {m} must be a multiple of {rounds} ({pp * rounds} works)")


def check_schedule(schedule: str) -> str:
    """torch.distributed.pipelining's class name for parallel.pp_schedule `schedule`; ConfigError in
    one line when hybridpar does not know it or this torch lacks it."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    name = SCHEDULES[schedule].torch_class
    if not _torch_has(name):
        raise ConfigError(f"parallel.pp_schedule = {schedule}: this torch has no {name}; "
                          "choose ZBVZeroBubble or Interleaved1F1B, or a newer torch")
    return name


def check_untied(pp: int, tie_embeddings: bool) -> None:
    """A model whose output head is its embedding cannot be cut into stages: ConfigError in one line."""
    if pp > 1 and tie_embeddings:
        raise ConfigError(f"parallel.pp = {pp} with a model whose output head is its embedding (tie_embeddings): the "
                          "embedding would be at both ends of the pipeline; set parallel.pp = 1")


def cannot_validate(pp: int, schedule: str) -> str:
    """Why a pipeline of `schedule` has no validation ("" when it can validate): the run's summary
    says it where a run without validation data says what would give it some."""
    if pp > 1 and SCHEDULES[schedule].v_shape:
        return (f"parallel.pp_schedule = {schedule} cannot validate: torch's V schedules run no forward-only "
                "pass (1F1B and Interleaved1F1B can)")
    return ""


def check_validation(pp: int, schedule: str, validating: bool) -> None:
    """A job with validation data under a schedule that cannot run its forward: ConfigError in one line."""
    if validating and cannot_validate(pp, schedule):
        # torch's V schedules run no forward-only pass (a backward is part of every step of theirs).
        raise ConfigError(f"parallel.pp_schedule = {schedule} cannot run the validation forward; choose "
                          "Interleaved1F1B (or 1F1B), or unset data.val_fraction and data.val_source")


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """This pp rank's share of the pipeline: the schedule, the stages of all ranks together, the
    layers of each, the stage ids this rank holds (in the order the schedule runs them) and the
    pipeline micro-batches each loader micro-batch is cut into. At pp 1: one stage, the whole model."""

    schedule: str
    n_stages: int
    counts: tuple[int, ...]
    ids: tuple[int, ...]
    microbatches: int

    @classmethod
    def of(cls, n_layers: int, pp: int, pp_rank: int, schedule: str = "1F1B", pp_layers: Sequence[int] = (),
           pp_microbatches: int = 0, *, tie_embeddings: bool = False) -> "StageLayout":
        """From the settings (parallel.pp_schedule, pp_layers, pp_microbatches; check_pipeline's) and the
        model's n_layers; a model whose head is its embedding cannot be cut (check_untied)."""
        check_untied(pp, tie_embeddings)
        if pp == 1:
            return cls(schedule, 1, (n_layers,), (0,), 1)
        n_stages = stage_count(pp, schedule, pp_layers)
        counts = stage_layer_counts(n_layers, n_stages, list(pp_layers) or None, pp=pp)
        ids = stage_ids(pp_rank, pp, n_stages // pp, schedule)
        return cls(schedule, n_stages, tuple(counts), tuple(ids), microbatches(pp_microbatches, n_stages))

    @classmethod
    def of_config(cls, settings, args, parallel) -> "StageLayout":
        """For config.parallel `settings` and the model's `args` (ModelArgs) on this rank of `parallel`."""
        return cls.of(args.n_layers, parallel.pp, parallel.pp_rank, settings.pp_schedule, settings.pp_layers,
                      settings.pp_microbatches, tie_embeddings=args.tie_embeddings)

    @property
    def has_first(self) -> bool:
        return 0 in self.ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.ids


def _torch_has(name: str) -> bool:
    from torch.distributed.pipelining import schedules

    return hasattr(schedules, name)
