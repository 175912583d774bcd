"""The validation loss: the same sequences, in the same order, at every layout.

The windows evaluated are the first `n` of the validation split (`eval_steps` global batches, or
all of them), read in order, never shuffled. Each forward pass takes `micro_batch_size` windows per
data-parallel rank, rank r the r-th share of the next micro_batch_size x dp_size windows. The loss
is the sum of token losses over every window divided by the count of targets, both summed over the
dp x cp group (a cp rank sums its chunks' tokens): the same number whatever the mesh. Every rank
runs the same number of forward passes (FSDP gathers parameters collectively); a rank whose share
runs out past the end reads window 0 with every target ignored.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Union

import torch
import torch.distributed as dist

from ..data.loader import PackedDataset
from ..data.training_data import source_entries
from ..data.sources import is_store
from ..data.store.token_store import StoreDamagedError, StoreError, read_manifest
from ..mesh.device import ParallelDims
from ..parallel.loss import IGNORE_INDEX
from ..pipeline.runner import LocalRunner, as_runner
from ..pipeline.schedules import cannot_validate
from .data_stop import agreed_error
from .step import context_parts


def windows_evaluated(n_windows: int, eval_steps: int, global_batch: int) -> int:
    """How many windows an evaluation reads: eval_steps global batches (0: the whole split)."""
    return n_windows if eval_steps == 0 else min(n_windows, eval_steps * global_batch)


def missing_validation(config) -> str:
    """Why a run of `config` has no validation data, with what would give it some: advice the job
    takes (under a V schedule none: validation is refused there; with a token store as the
    source, the split it was prepared with, the only data.val_fraction it takes)."""
    p, d = config.parallel, config.data
    reason = cannot_validate(p.pp, p.pp_schedule)
    if reason:
        return reason
    splits = {}  # a token store given as a source -> the validation share it was prepared with
    for entry in source_entries(d):
        if is_store(entry["source"]):
            try:
                splits[entry["source"]] = read_manifest(Path(entry["source"])).get("val_fraction", 0.0)
            except StoreError:
                continue
    unsplit = [s for s, fraction in splits.items() if not fraction]
    if unsplit:
        return f"the token store {unsplit[0]} was prepared without a validation split: set data.val_source"
    if len(set(splits.values())) > 1:
        return "the token stores were prepared with different validation splits: set data.val_source"
    if splits:
        (fraction,) = set(splits.values())
        return f"set data.val_fraction = {fraction:g}, the token store's split, or data.val_source"
    return "set data.val_fraction (e.g. 0.05) or data.val_source"


class Validator:
    """`validator(runner)` -> {"val_loss", "val_ppl", "val_tokens"} on every rank of the mesh, over
    each source's held-out windows ({name: PackedDataset}); with several sources (a blend) also
    "val_loss/<name>" per source, "val_loss" over all of their tokens together."""

    def __init__(self, datasets: dict[str, PackedDataset], parallel: ParallelDims, *, micro_batch_size: int,
                 eval_steps: int, global_batch: int, at: Callable[[str], None] = lambda phase: None) -> None:
        self.datasets, self.parallel, self.micro_batch_size = dict(datasets), parallel, micro_batch_size
        self.n = {name: windows_evaluated(len(d), eval_steps, global_batch) for name, d in self.datasets.items()}
        self.at = at  # told where the evaluation is (the watchdog's phase)
        self._checked = False  # this rank's windows read once before any forward (_check_windows)

    def _micro_batch(self, name: str, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's windows of source `name` from `first` on: (inputs, targets), past the end
        padded and ignored."""
        windows, real, n = [], [], self.n[name]
        for i in range(first, first + self.micro_batch_size):
            windows.append(self.datasets[name][i if i < n else 0])
            real.append(i < n)
        batch = torch.stack(windows)
        inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].clone()
        targets[~torch.tensor(real)] = IGNORE_INDEX
        return inputs, targets

    def _passes(self):
        """(source, first window of the pass) of every forward pass, the same on every rank."""
        per_pass = self.micro_batch_size * self.parallel.dp_size
        return [(name, start) for name, n in self.n.items() for start in range(0, n, per_pass)]

    def _check_windows(self) -> None:
        """The first time: read this rank's windows before any forward, so that a damaged store
        stops every rank alike (data_stop.py) rather than the ranks that read the damage alone,
        whose peers would wait in the forward's collectives. Later evaluations read the same
        windows, their chunks checked already."""
        if self._checked:
            return
        p, error = self.parallel, None
        try:
            for name, start in self._passes():
                self._micro_batch(name, start + p.dp_rank * self.micro_batch_size)
        except StoreDamagedError as err:
            error = err
        flag = torch.tensor([float(error is not None)], device=p.device)
        dist.all_reduce(flag, group=p.dp_group)  # every dp group holds each dp coordinate: all sum alike
        if flag.item():
            raise agreed_error(error)
        self._checked = True

    def __call__(self, runner: Union[LocalRunner, torch.nn.Module]) -> dict:
        """runner: the step runner of this rank's model or stages (hybridpar.pipeline.runner), or the model."""
        runner = as_runner(runner, self.parallel)
        p, device = self.parallel, self.parallel.device
        per_pass = self.micro_batch_size * p.dp_size
        self._check_windows()
        names = list(self.datasets)
        totals = torch.zeros(len(names), 2, dtype=torch.float64, device=device)  # per source: loss sum, targets
        with runner.evaluating():
            for name, start in self._passes():
                n, row = self.n[name], names.index(name)
                self.at(f"validation: windows {start}-{min(start + per_pass, n) - 1} of {n}"
                        + (f" of {name}" if len(names) > 1 else ""))
                # Context parallelism: this cp rank's chunks of the windows its dp coordinate reads.
                windows = self._micro_batch(name, start + p.dp_rank * self.micro_batch_size)
                [(inputs, targets)] = context_parts([windows], p)
                loss = runner.loss(inputs.to(device), targets.to(device))
                if loss is None:  # a pipeline stage without the loss: total brings it (and its count) here
                    continue
                totals[row, 0] += loss.double()
                totals[row, 1] += (targets != IGNORE_INDEX).sum()
        runner.total(totals)
        whole = totals.sum(0)
        loss = (whole[0] / whole[1]).item()
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(whole[1].item())}
        if len(names) > 1:
            out.update({f"val_loss/{name}": (totals[i, 0] / totals[i, 1]).item() for i, name in enumerate(names)})
        return out
