"""torch.distributed.pipelining's schedule over this rank's stage modules (hybridpar.pipeline.cutting
builds them): one optimizer step's forwards and backwards of a batch, or its forwards alone.

    engine = PipelineEngine(stages, layout.ids, pp_group, schedule, layout.microbatches, device, mp_group)
    loss_sum = engine.step(tokens, targets, scale)          # on the last stage; None elsewhere
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.loss import vocab_parallel_cross_entropy
from .schedules import SCHEDULES, check_schedule


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
        cls = getattr(pipelining, check_schedule(schedule))
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
