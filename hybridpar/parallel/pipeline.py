"""Pipeline parallelism's model side: which layers each stage holds (torchtitan's rule), cutting a
built model down to its stages, and the schedule from torch.distributed.pipelining that runs them.
The split rule and the rank -> stages map are torch-free, in hybridpar.config.pipeline:

    counts = stage_layer_counts(n_layers, pp * v)           # layers per stage, pp x v stages
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

from ..config.pipeline import SCHEDULES
from .loss import vocab_parallel_cross_entropy


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
        if schedule not in SCHEDULES or not hasattr(pipelining, SCHEDULES[schedule].torch_class):
            raise ValueError(f"parallel.pp_schedule = {schedule!r}: use one of "
                             f"{[s for s in SCHEDULES if hasattr(pipelining, SCHEDULES[s].torch_class)]}")
        cls = getattr(pipelining, SCHEDULES[schedule].torch_class)
        single = SCHEDULES[schedule].stages_per_rank == 1
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
        # return_outputs=False: the last stage keeps no micro-batch's logits until the step ends (at a
        # 128k vocabulary, GiBs; bench/README's pipeline section measured 40% of the saved peak).
        self.schedule.step(*args, target=targets if self.has_last else None, losses=losses, return_outputs=False)
        return torch.stack([l.detach() for l in losses]).sum() if self.has_last else None

    def forward_only(self, tokens: Optional[torch.Tensor], targets: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The batch's summed token loss, forward only (validation): on the last stage, else None."""
        self._scale = 1.0
        losses: list = []
        args = (tokens,) if self.has_first else ()
        self.schedule.eval(*args, target=targets if self.has_last else None, losses=losses)
        return torch.stack([l.detach() for l in losses]).sum() if self.has_last else None
