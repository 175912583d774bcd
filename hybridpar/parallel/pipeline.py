"""Pipeline parallelism's model side: which layers each stage holds (torchtitan's rule), cutting a
built model down to its stages, and the schedule from torch.distributed.pipelining that runs them.

    counts = stage_layer_counts(n_layers, pp, v)            # layers per stage, pp x v stages
    ids = stage_ids(rank, pp, v, schedule)                  # the stages this pp rank holds
    model = keep_stage(build_model(...), stage, pp * v, counts)   # one per stage id, names kept
    engine = PipelineEngine(models, ids, pp_group, schedule, n_microbatches, device, parallel.mp_group)
    loss_sum = engine.step(tokens, targets, scale)          # on the last stage; None elsewhere

A layer keeps its name (`layers.37` stays `layers.37`): Transformer.layers is keyed by the layer's
index, so a stage's state dict is a subset of the whole model's and checkpoints do not depend on pp.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config.pipeline import SCHEDULES, V_SHAPED
from .loss import vocab_parallel_cross_entropy



def stage_layer_counts(n_layers: int, n_stages: int, override: Optional[Sequence[int]] = None) -> list[int]:
    """Transformer layers per stage. The embedding and the output head each count as a layer:
    n_layers + 2 units split as evenly as possible, the first stage giving one to the embedding and
    the last one to the head. `override`: the counts themselves (parallel.pp_layers)."""
    if override is not None:
        counts = list(override)
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 0:
            raise ValueError(f"parallel.pp_layers = {counts} must give {n_stages} stages non-negative layer "
                             f"counts summing to n_layers = {n_layers}")
        return counts
    units = n_layers + 2
    if n_stages > units:
        raise ValueError(f"{n_stages} pipeline stages for {n_layers} layers (+ embedding and head): "
                         f"use at most {units} stages (parallel.pp x virtual stages)")
    base, extra = divmod(units, n_stages)
    # torchtitan gives the remainder's extra units to the first stages.
    counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    counts[0] -= 1
    counts[-1] -= 1
    if min(counts) < 0:
        raise ValueError(f"{n_stages} stages over {n_layers} layers leave a stage with no room: "
                         "set parallel.pp_layers explicitly")
    return counts


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stage indices rank pp_rank holds: looped (r, r+p, r+2p, ...) or, for the V schedules, r and 2p-1-r."""
    if schedule in V_SHAPED:  # rank r holds stages r and 2p-1-r
        if virtual != 2:
            raise ValueError(f"{schedule} runs 2 stages per rank, not {virtual}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_layers(stage: int, counts: Sequence[int]) -> list[int]:
    """The layer indices stage `stage` holds."""
    start = sum(counts[:stage])
    return list(range(start, start + counts[stage]))


def keep_stage(model: nn.Module, stage: int, counts: Sequence[int]) -> nn.Module:
    """Cut a built Transformer down to stage `stage` in place: its layers (names kept), the embedding
    on the first stage, the final norm and head on the last. Build on meta to skip the memory."""
    if model.args.tie_embeddings and len(counts) > 1:
        raise ValueError("tie_embeddings puts the embedding at both ends of the pipeline: "
                         "use parallel.pp = 1 or a model with untied embeddings")
    keep = {str(i) for i in stage_layers(stage, counts)}
    for name in [n for n in model.layers.keys() if n not in keep]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < len(counts) - 1:
        model.norm = None
        model.output = None
    return model


class PipelineEngine:
    """torch.distributed.pipelining's schedule over this rank's stage modules.

    The loss of a micro-batch is its summed token cross-entropy times `scale` (from the whole
    batch's token count, as without pp: train.step.gradient_scale), and scale_grads=False, so the
    gradients are exactly those of the unsplit model's loss."""

    def __init__(self, stages: Sequence[nn.Module], ids: Sequence[int], group: dist.ProcessGroup, schedule: str,
                 n_microbatches: int, device: torch.device, mp_group: dist.ProcessGroup) -> None:
        from torch.distributed import pipelining

        n_stages = len(ids) * dist.get_world_size(group)
        self.has_last = n_stages - 1 in ids
        self.has_first = 0 in ids
        self._mp_group, self._scale = mp_group, 1.0
        self.stages = [pipelining.PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(stages, ids)]
        if schedule not in SCHEDULES or not hasattr(pipelining, SCHEDULES[schedule]):
            raise ValueError(f"parallel.pp_schedule = {schedule!r}: use one of "
                             f"{[s for s in SCHEDULES if hasattr(pipelining, SCHEDULES[s])]}")
        cls = getattr(pipelining, SCHEDULES[schedule])
        single = schedule in ("GPipe", "1F1B")
        if single and len(self.stages) != 1:
            raise ValueError(f"{schedule} runs one stage per rank, this rank holds {len(self.stages)}")
        self.schedule = cls(self.stages[0] if single else self.stages, n_microbatches=n_microbatches,
                            loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, group=self._mp_group, reduction="sum") * self._scale

    def step(self, tokens: Optional[torch.Tensor], targets: Optional[torch.Tensor], scale: float
             ) -> Optional[torch.Tensor]:
        """One forward/backward of the batch: the summed scaled loss on the rank holding the last stage, else None."""
        self._scale = scale
        losses: list = []
        args = (tokens,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None, losses=losses)
        return torch.stack([l.detach() for l in losses]).sum() if self.has_last else None

    def forward_only(self, tokens: Optional[torch.Tensor], targets: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The batch's summed token loss, forward only (validation): on the last stage, else None."""
        self._scale = 1.0
        losses: list = []
        args = (tokens,) if self.has_first else ()
        self.schedule.eval(*args, target=targets if self.has_last else None, losses=losses)
        return torch.stack([l.detach() for l in losses]).sum() if self.has_last else None
