"""The evaluations after a training step: the validation loss every train.eval_every steps, and
lm-evaluation-harness's tasks ([eval]) every eval.every steps, each also after the last step, neither
after a stop.

A downstream evaluation is `hybridpar eval` on the model in training: every rank takes part (rank 0
runs the harness over hybridpar.evaluate.HybridparLM, the others serve it), the model in eval mode
without gradients and back in training mode after, and the random states of Python, NumPy and torch
(CPU and CUDA) put back as they were (the harness seeds them), so the training after it is the
training without it, bit for bit. Scoring runs the same forwards on every data-parallel rank (FSDP's
all-gathers need them all: hybridpar.evaluate.scoring). The scores come to every rank as
{"eval/<task>/<metric>": value} (lm-eval's ",none" filter suffix dropped; a metric's stderr is
"<metric>_stderr"), with "eval_s", the seconds it took.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Iterator, Optional

import numpy as np
import torch

from ..config import Config, ConfigError
from ..mesh.ranks import broadcast_from_rank0, on_rank0
from . import data_stop
from .validation import Validator


def due(step: int, every: int, steps: int) -> bool:
    """An evaluation every `every` steps (0: none but the last) and after the last step."""
    return bool(every and step % every == 0) or step == steps


class Evaluations:
    """The evaluations after each step (every rank): validation (`validator`, over `val_datasets`; None
    without validation data) and the [eval] tasks (`downstream`), through the step runner. after_step() returns what
    they found; the last validation and the seconds spent evaluating are kept here (the summary's)."""

    def __init__(self, config: Config, parallel, runner, val_datasets: Optional[dict], downstream: "Downstream",
                 supervisor, *, global_batch: int, tokenizer, args) -> None:
        self.validator = None if val_datasets is None else Validator(
            val_datasets, parallel, micro_batch_size=config.data.micro_batch_size, eval_steps=config.train.eval_steps,
            global_batch=global_batch, at=supervisor.phase)
        self.config, self.runner, self.downstream = config, runner, downstream
        self.supervisor, self.tokenizer, self.args = supervisor, tokenizer, args
        self.validation: Optional[dict] = None  # the last validation's result
        self.seconds = 0.0  # spent evaluating, validation and downstream

    def validate(self) -> dict:
        """The validation loss now: {"val_loss", "val_ppl", "val_tokens"}."""
        began = time.perf_counter()
        self.validation = self.validator(self.runner)
        self.seconds += time.perf_counter() - began
        self.supervisor.phase("validated")
        return self.validation

    def after_step(self, step: int) -> tuple[dict, Optional[Exception]]:
        """The evaluations due after `step`: (their numbers for the step's row, what stopped the held-out
        data: a damaged store, met by every rank alike, after which nothing else is evaluated)."""
        c, row = self.config, {}
        if self.validator is not None and due(step, c.train.eval_every, c.train.steps):
            try:
                row.update(self.validate())
            except data_stop.StoreDamagedError as err:  # every rank alike: the trainer saves and stops
                return row, err
        if self.downstream.names and due(step, c.eval.every, c.train.steps):
            row.update(self.downstream(self.runner, self.tokenizer, self.args, step))
            self.seconds += row["eval_s"]
        return row, None


def scores_of(results: dict) -> dict:
    """lm-eval's results ({task: {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}}) as
    {"eval/<task>/<metric>": value}, numbers only; a filter other than "none" stays in the name."""
    scores = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, kept = key.partition(",")
            if kept and isinstance(value, (int, float)) and not isinstance(value, bool):
                scores[f"eval/{task}/{metric if kept == 'none' else f'{metric}_{kept}'}"] = float(value)
    return scores


class Downstream:
    """The [eval] section's tasks: checked when made (rank 0 reads them; every rank raises the same
    one-line ConfigError before training), run when called (every rank)."""

    def __init__(self, config: Config, parallel, supervisor) -> None:
        self.settings, self.parallel, self.supervisor = config.eval, parallel, supervisor
        self.names: list[str] = list(config.eval.tasks)
        self.scores: dict = {}  # the last evaluation's, for summary.json
        self.manager = None
        if self.names:
            on_rank0(self._check, "check the [eval] tasks", error_type=ConfigError)

    def _check(self) -> None:
        from ..config.evaluation import CONFIG_KEYS
        from ..evaluate.tasks import check_tasks, task_manager

        include_path = self.settings.include_path or None
        with random_states_kept():  # building the tasks draws from Python's random state
            self.manager = task_manager(include_path, self.names, CONFIG_KEYS)
            kinds = check_tasks(self.names, self.manager, num_fewshot=self.settings.harness_fewshot(),
                                include_path=include_path, named=CONFIG_KEYS)
        generating = [name for name in self.names if "generate_until" in kinds[name]]
        if generating:
            # Generation stops at its own length on each rank: FSDP's all-gathers need the same forwards.
            raise ConfigError(f"eval.tasks: {', '.join(generating)} generate text (generate_until), which the "
                              "training loop does not run; score it with hybridpar eval on a checkpoint")

    def __call__(self, runner, tokenizer, args, step: int) -> dict:
        """The tasks scored on the step runner's model (hybridpar.pipeline.runner; pp 1, cp 1), in eval mode."""
        from ..evaluate.backend import HybridparLM
        from ..evaluate.loading import Loaded
        from ..evaluate.run import run_harness

        began = time.perf_counter()
        what = f"downstream eval: {','.join(self.names)}"
        # Not a hang, however long; the harness seeds the random states.
        with runner.evaluating(), self.supervisor.checkpointing(what, "downstream evaluated"), random_states_kept():
            lm = HybridparLM(loaded=Loaded(runner.model, self.parallel, tokenizer, args, step),
                             batch_tokens=self.settings.batch_tokens,
                             on_command=lambda text: self.supervisor.phase(f"{what}: {text}"))
            output = run_harness(lm, self.names, self.manager, limit=self.settings.harness_limit(),
                                 num_fewshot=self.settings.harness_fewshot(), log_samples=False)
        self.scores = broadcast_from_rank0(scores_of(output["results"]) if output else None)
        return {**self.scores, "eval_s": round(time.perf_counter() - began, 3)}


@contextlib.contextmanager
def random_states_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and CUDA) random states as they were before, however left."""
    cuda: Optional[list] = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
