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


def due(step: int, every: int, steps: int) -> bool:
    """An evaluation every `every` steps (0: none but the last) and after the last step."""
    return bool(every and step % every == 0) or step == steps


def after_step(trainer, row: dict) -> None:
    """The evaluations due after trainer.step, their numbers into `row` (every rank)."""
    c = trainer.config
    if trainer.stop_signal:
        return
    if trainer.validator is not None and due(trainer.step, c.train.eval_every, c.train.steps):
        try:
            row.update(trainer.validate())
        except data_stop.StoreDamagedError as err:  # the held-out data's, every rank alike: save, stop
            trainer.data_stopped, trainer.stop_signal = err, "the data"
            return
    if trainer.downstream.names and due(trainer.step, c.eval.every, c.train.steps):
        row.update(trainer.downstream(trainer.model, trainer.tokenizer, trainer.args, trainer.step))
        trainer.eval_seconds += row["eval_s"]


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

    def __call__(self, model, tokenizer, args, step: int) -> dict:
        from ..evaluate.backend import HybridparLM
        from ..evaluate.loading import Loaded
        from ..evaluate.run import run_harness

        began = time.perf_counter()
        what = f"downstream eval: {','.join(self.names)}"
        was_training = model.training
        model.eval()
        try:
            # Not a hang, however long; the harness seeds the random states.
            with self.supervisor.checkpointing(what, "downstream evaluated"), random_states_kept():
                lm = HybridparLM(loaded=Loaded(model, self.parallel, tokenizer, args, step),
                                 batch_tokens=self.settings.batch_tokens,
                                 on_command=lambda text: self.supervisor.phase(f"{what}: {text}"))
                output = run_harness(lm, self.names, self.manager, limit=self.settings.harness_limit(),
                                     num_fewshot=self.settings.harness_fewshot(), log_samples=False)
        finally:
            model.train(was_training)
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
