"""A rank's pipeline stages, built: the one way a model is cut into stages. Each stage is the whole
model's build (hybridpar.build.build_model) asked for its pieces only (stage_part: its layers
under their own names, the embedding on the first stage, the final norm and head on the last), from
the same random state, so a stage's weights are the whole model's for the same seed.

    layout = StageLayout.of_config(config.parallel, args, parallel)
    stages = build_stages(args, parallel, layout, device=..., fsdp=...)   # in layout.ids' order
    stage = build_stage(args, parallel, 3, layout.counts)                 # one stage, any rank's
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer

from ..build import build_model
from ..mesh.device import ParallelDims
from .schedules import StageLayout, check_untied


def build_stage(args: ModelArgs, parallel: ParallelDims, stage: int, counts: Sequence[int], **options
                ) -> Transformer:
    """Stage `stage` of a pipeline of len(counts) stages (layers per stage, stage_layer_counts'), built
    by build_model with `options` (its keywords); the whole model when there is one stage. A model
    whose head is its embedding is refused (one line)."""
    check_untied(parallel.pp if parallel.pp > 1 else len(counts), args.tie_embeddings)
    return _built(args, parallel, stage, counts, **options)


def build_stages(args: ModelArgs, parallel: ParallelDims, layout: StageLayout, **options) -> list[Transformer]:
    """This rank's stages of `layout` (layout.ids, in the order the schedule runs them; its model
    checked as it was made), each built by build_model with `options`; [the whole model] at pp 1."""
    seeded = torch.random.get_rng_state()  # each stage draws from the same start as the whole model
    stages = []
    for stage in layout.ids:
        torch.random.set_rng_state(seeded)
        stages.append(_built(args, parallel, stage, layout.counts, **options))
    return stages


def _built(args: ModelArgs, parallel: ParallelDims, stage: int, counts: Sequence[int], **options) -> Transformer:
    return build_model(args, parallel, part=stage_part(stage, counts) if len(counts) > 1 else None, **options)


def stage_layers(stage: int, counts: Sequence[int]) -> list[int]:
    """The layer indices stage `stage` holds (counts: layers per stage, stage_layer_counts')."""
    start = sum(counts[:stage])
    return list(range(start, start + counts[stage]))


def stage_part(stage: int, counts: Sequence[int]) -> dict:
    """What stage `stage` of len(counts) stages holds, as hybridpar.models.llama.Transformer's keywords:
    its layers (names kept), the embedding on the first stage, the final norm and head on the last."""
    return dict(layers=stage_layers(stage, counts), embedding=stage == 0, head=stage == len(counts) - 1)
