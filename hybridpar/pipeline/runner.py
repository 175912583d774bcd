"""The step runner: the one object everything that pushes a batch through the model asks (a
training step, a validation batch, a downstream evaluation, the dry run's rehearsal), whatever the
pipeline. LocalRunner holds the whole model (pp 1), PipelinedRunner this rank's stages; both:

    runner = make_runner(stages, layout, parallel, grad_sync=config.train.grad_sync)
    loss_sum = runner.forward_backward(batches, scale=scale)   # this rank's summed token loss
    runner.total(loss_sum)                    # the global batch's, on every rank (in place)
    with runner.evaluating():                 # eval mode, gradients off; back as it was
        loss = runner.loss(inputs, targets)   # forward only; None on a stage without the loss
    runner.rehearse(batches, scale=scale)     # forward_backward on fake tensors (the dry run)
    runner.modules, runner.stage_ids          # what the optimizer, checkpoints and diagnostics take
    runner.model                              # the whole model (downstream evaluation); None under pp

`batches` are this rank's (inputs, targets) micro-batches (train.step.context_parts'), `scale` the
factor on each summed token loss (train.step.gradient_scale).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..mesh.device import ParallelDims
from ..parallel.loss import vocab_parallel_cross_entropy
from .schedules import StageLayout

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _quiet(phase: str) -> None:
    """The default `at`: told where the step is (the watchdog's phase); nobody listening."""


class LocalRunner:
    """The whole model on this rank (its tensor-, context- and data-parallel share): parallel.pp = 1."""

    def __init__(self, model: nn.Module, parallel: ParallelDims, grad_sync: str = "last") -> None:
        self.model, self.parallel, self.grad_sync = model, parallel, grad_sync
        self.modules: list[nn.Module] = [model]
        self.stage_ids: list[int] = [0]

    def forward_backward(self, batches: Batches, *, scale: float, at: Callable[[str], None] = _quiet
                         ) -> torch.Tensor:
        """Forward and backward of each micro-batch, loss = sum of token losses x scale; gradients are
        synchronised after the last micro-batch (grad_sync "last") or after each ("every"). This
        rank's summed token loss (not yet summed over dp x cp: total)."""
        device = self.parallel.device
        loss_sum = torch.zeros((), device=device)
        for i, (inputs, targets) in enumerate(batches):
            self.model.set_requires_gradient_sync(self.grad_sync == "every" or i == len(batches) - 1)
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            at("forward")
            loss = vocab_parallel_cross_entropy(self.model(inputs), targets, parallel=self.parallel, reduction="sum")
            at("backward")
            (loss * scale).backward()
            loss_sum += loss.detach()
        return loss_sum

    def rehearse(self, batches: Batches, *, scale: float) -> torch.Tensor:
        """forward_backward on fake tensors (the dry run): the same code."""
        return self.forward_backward(batches, scale=scale)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Eval mode without gradients inside; the model's mode as it was after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> Optional[torch.Tensor]:
        """The summed token loss of one micro-batch, forward only."""
        return vocab_parallel_cross_entropy(self.model(inputs), targets, parallel=self.parallel, reduction="sum")

    def total(self, sums: torch.Tensor) -> torch.Tensor:
        """`sums` (a loss sum, or any per-rank sums) over the global batch, on every rank, in place: over dp x cp."""
        dist.all_reduce(sums, group=self.parallel.dp_cp_group)
        return sums


class PipelinedRunner(LocalRunner):
    """This rank's pipeline stages (hybridpar.pipeline.cutting' build_stages, in layout.ids' order),
    run by torch.distributed.pipelining's schedule (the engine, made at the first batch). Each
    micro-batch of the loader goes through the schedule as layout.microbatches pipeline
    micro-batches, the tokens into the first stage, the targets into the last; the loss is on the
    rank holding the last stage (0 elsewhere until total). FSDP's gradients are synchronised in each
    schedule's last backward (torch decides: train.grad_sync does not apply)."""

    def __init__(self, stages: Sequence[nn.Module], layout: StageLayout, parallel: ParallelDims) -> None:
        self.model, self.parallel, self.layout = None, parallel, layout
        self.modules = list(stages)
        self.stage_ids = list(layout.ids)
        self._engine = None

    @property
    def engine(self):
        """The schedule over this rank's stages (hybridpar.pipeline.engine.PipelineEngine)."""
        if self._engine is None:
            from .engine import PipelineEngine

            p, layout = self.parallel, self.layout
            self._engine = PipelineEngine(self.modules, layout.ids, p.pp_group, layout.schedule, layout.microbatches,
                                          p.device, p.mp_group)
        return self._engine

    def forward_backward(self, batches: Batches, *, scale: float, at: Callable[[str], None] = _quiet
                         ) -> torch.Tensor:
        device, engine = self.parallel.device, self.engine
        loss_sum = torch.zeros((), device=device)
        for inputs, targets in batches:
            at("pipeline")
            scaled = engine.step(inputs.to(device) if self.layout.has_first else None,
                                 targets.to(device) if self.layout.has_last else None, scale)
            if scaled is not None:
                loss_sum += scaled / scale
        return loss_sum

    def rehearse(self, batches: Batches, *, scale: float) -> torch.Tensor:
        """forward_backward on fake tensors, which the schedule's sends and receives cannot carry (they
        agree on shapes by exchanging values): each stage of this rank runs every pipeline micro-batch
        in turn, a stage's input standing in for what the previous stage sends (hidden states) and its
        output's gradient for what the next sends back. The stage's sharding, its tensor-parallel and
        FSDP collectives run as in training; the order of the micro-batches is not the schedule's."""
        device, layout = self.parallel.device, self.layout
        loss_sum = torch.zeros((), device=device)
        pieces = [piece for inputs, targets in batches
                  for piece in zip(inputs.chunk(layout.microbatches), targets.chunk(layout.microbatches))]
        # What the previous stage sends: [micro-batch, seq / cp, dim], under sequence parallelism this mp rank's 1/mp.
        first = self.modules[0]
        split = self.parallel.mp if getattr(first, "sequence_parallel", False) else 1
        for i, (inputs, targets) in enumerate(pieces):
            last = i == len(pieces) - 1
            hidden = (inputs.shape[0], inputs.shape[1] // split, first.args.dim)
            for stage, s in zip(self.modules, self.stage_ids):
                # As torch's pipeline stage sets FSDP for each backward: gradients reduced and parameters
                # resharded after the step's last micro-batch only.
                stage.set_is_last_backward(last)
                stage.set_reshard_after_backward(last)
                stage.set_requires_gradient_sync(last)
                out = stage(inputs if s == 0 else torch.zeros(hidden, requires_grad=True))
                if s == layout.n_stages - 1:
                    loss = vocab_parallel_cross_entropy(out, targets, parallel=self.parallel, reduction="sum")
                    (loss * scale).backward()
                    loss_sum += loss.detach()
                else:
                    out.backward(torch.zeros_like(out))
        return loss_sum

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Gradients off inside (the schedule's eval runs the stages as they are)."""
        with torch.no_grad():
            yield

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> Optional[torch.Tensor]:
        """The micro-batch's summed token loss, forward only, on the rank holding the last stage; None elsewhere."""
        return self.engine.forward_only(inputs if self.layout.has_first else None, targets)

    def total(self, sums: torch.Tensor) -> torch.Tensor:
        """Over dp x cp, then over the pipeline's stages (only the last one's are not 0)."""
        super().total(sums)
        dist.all_reduce(sums, group=self.parallel.pp_group)
        return sums


def as_runner(model: Union[LocalRunner, nn.Module], parallel: ParallelDims) -> LocalRunner:
    """A runner as it is; a model (the whole of it, on this rank) in a LocalRunner."""
    return LocalRunner(model, parallel) if isinstance(model, nn.Module) else model


def make_runner(stages: Sequence[nn.Module], layout: StageLayout, parallel: ParallelDims, *,
                grad_sync: str = "last") -> LocalRunner:
    """The runner of this rank's `stages` (build_stages' for `layout`): LocalRunner at one stage,
    else PipelinedRunner."""
    if layout.n_stages == 1:
        (model,) = stages
        return LocalRunner(model, parallel, grad_sync)
    return PipelinedRunner(stages, layout, parallel)
