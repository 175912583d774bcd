"""The validation loss: the same sequences, in the same order, at every layout.

The windows evaluated are the first `n` of the validation split (`eval_steps` global batches, or
all of them), read in order, never shuffled. Each forward pass takes `micro_batch_size` windows per
data-parallel rank, rank r the r-th share of the next micro_batch_size x dp_size windows. The loss
is the sum of token losses over every window divided by the count of targets, both summed over the
dp group: the same number whatever the mesh. Every rank runs the same number of forward passes
(FSDP gathers parameters collectively); a rank whose share runs out past the end reads window 0
with every target ignored.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from ..data.loader import PackedDataset
from ..data.store import StoreDamagedError
from ..mesh.device import ParallelDims
from ..parallel import vocab_parallel_cross_entropy
from ..parallel.loss import IGNORE_INDEX
from .data_stop import agreed_error


def windows_evaluated(n_windows: int, eval_steps: int, global_batch: int) -> int:
    """How many windows an evaluation reads: eval_steps global batches (0: the whole split)."""
    return n_windows if eval_steps == 0 else min(n_windows, eval_steps * global_batch)


class Validator:
    """`validator(model)` -> {"val_loss", "val_ppl", "val_tokens"} on every rank of the mesh."""

    def __init__(self, dataset: PackedDataset, parallel: ParallelDims, *, micro_batch_size: int, eval_steps: int,
                 global_batch: int, at: Callable[[str], None] = lambda phase: None) -> None:
        self.dataset, self.parallel, self.micro_batch_size = dataset, parallel, micro_batch_size
        self.n = windows_evaluated(len(dataset), eval_steps, global_batch)
        self.at = at  # told where the evaluation is (the watchdog's phase)
        self._checked = False  # this rank's windows read once before any forward (_check_windows)

    def _micro_batch(self, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's windows from `first` on: (inputs, targets), past the end padded and ignored."""
        windows, real = [], []
        for i in range(first, first + self.micro_batch_size):
            windows.append(self.dataset[i if i < self.n else 0])
            real.append(i < self.n)
        batch = torch.stack(windows)
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].clone()
        targets[~torch.tensor(real)] = IGNORE_INDEX
        return inputs, targets

    def _check_windows(self) -> None:
        """The first time: read this rank's windows before any forward, so that a damaged store
        stops every rank alike (data_stop.py) rather than the ranks that read the damage alone,
        whose peers would wait in the forward's collectives. Later evaluations read the same
        windows, their chunks checked already."""
        if self._checked:
            return
        p, error = self.parallel, None
        try:
            for start in range(0, self.n, self.micro_batch_size * p.dp_size):
                self._micro_batch(start + p.dp_rank * self.micro_batch_size)
        except StoreDamagedError as err:
            error = err
        flag = torch.tensor([float(error is not None)], device=p.device)
        dist.all_reduce(flag, group=p.dp_group)  # every dp group holds each dp coordinate: all sum alike
        if flag.item():
            raise agreed_error(error)
        self._checked = True

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict:
        p, device = self.parallel, self.parallel.device
        per_pass = self.micro_batch_size * p.dp_size
        self._check_windows()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, target count
        was_training = model.training
        model.eval()
        try:
            for start in range(0, self.n, per_pass):
                self.at(f"validation: windows {start}-{min(start + per_pass, self.n) - 1} of {self.n}")
                inputs, targets = self._micro_batch(start + p.dp_rank * self.micro_batch_size)
                inputs, targets = inputs.to(device), targets.to(device)
                loss = vocab_parallel_cross_entropy(model(inputs), targets, parallel=p, reduction="sum")
                totals[0] += loss.double()
                totals[1] += (targets != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
        dist.all_reduce(totals, group=p.dp_group)
        loss = (totals[0] / totals[1]).item()
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(totals[1].item())}


class BlendValidator:
    """A blend's validation: each source's held-out windows on their own ("val_loss/<name>"), and
    "val_loss" over all of their tokens together."""

    def __init__(self, datasets: dict, parallel: ParallelDims, **kwargs) -> None:
        self.validators = {name: Validator(d, parallel, **kwargs) for name, d in datasets.items()}

    def __call__(self, model: torch.nn.Module) -> dict:
        out, loss_sum, tokens = {}, 0.0, 0
        for name, validator in self.validators.items():
            result = validator(model)
            out[f"val_loss/{name}"] = result["val_loss"]
            loss_sum += result["val_loss"] * result["val_tokens"]
            tokens += result["val_tokens"]
        loss = loss_sum / tokens
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": tokens, **out}

