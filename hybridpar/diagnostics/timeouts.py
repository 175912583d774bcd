"""Timeouts and collective tracing on by default, so a stuck collective fails fast and leaves a trace.

Start-up (rendezvous, first compilation, data preparation) legitimately takes long, so the process
group starts with the generous init timeout; once this run's first step has completed (also after
a resume), every group of the mesh gets the shorter train timeout: a collective that waits longer
than that is a hang. While a checkpoint is written, the init timeout applies again. `Deadlines`
says which one applies when; the trainer's supervisor (hybridpar.train.supervisor) tells the watchdog.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterator, MutableMapping, Optional

from ..compat.torch import set_pg_timeout
from ..mesh.device import ParallelDims, mesh_groups

# Read by torch when the process group is created: set them before init_parallel.
ENV_DEFAULTS = {
    "TORCH_FR_BUFFER_SIZE": "2000",  # the flight recorder: the last 2000 collectives of every group
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # write the flight recorder out when a collective times out
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a timed-out NCCL collective tears the process down
    "NCCL_DEBUG": "WARN",
}
BACKSTOP_GRACE = 30.0  # seconds the c10d timeout leaves the watchdog to report first


def apply_env_defaults(trace_dir: Optional[Path] = None,
                       environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the tracing variables the user has not set; returns those it set."""
    wanted = dict(ENV_DEFAULTS)
    if trace_dir is not None:
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(Path(trace_dir) / "flight_recorder_rank_")
    applied = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(applied)
    if trace_dir is not None and "TORCH_FR_DUMP_TEMP_FILE" in applied:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    return applied


def restore_env(applied: dict[str, str], environ: MutableMapping[str, str] = os.environ) -> None:
    """Undo apply_env_defaults: unset the variables it set (one changed since is someone else's: kept)."""
    for key, value in applied.items():
        if environ.get(key) == value:
            del environ[key]


def set_train_timeout(parallel: ParallelDims, seconds: float) -> None:
    """Give every group of the mesh the (shorter) timeout used once training runs."""
    timeout = timedelta(seconds=seconds)
    for _, group in mesh_groups(parallel):
        set_pg_timeout(timeout, group)


class Deadlines:
    """Which timeout applies when, for a run that starts (or resumes) at `start_step`: the trainer's
    supervisor calls `step_done(step)` after each step and writes checkpoints inside
    `checkpointing()`; `watched`: a hang watchdog runs, and reports before the collectives give up."""

    def __init__(self, init_timeout: float, train_timeout: float, parallel: ParallelDims, start_step: int = 0,
                 watched: bool = False) -> None:
        self.init_timeout, self.train_timeout = init_timeout, train_timeout
        self.parallel = parallel
        self.start_step = self.step = start_step
        self.watched = watched

    @property
    def train_timeout_in_force(self) -> bool:
        """This run's first step is done and a train timeout is configured (0: none)."""
        return self.step > self.start_step and self.train_timeout > 0

    def no_progress_limit(self) -> float:
        """The watchdog's limit: the init timeout until this run's first step is done (it pays for
        compiling and the first collectives, also after a resume), then the train timeout."""
        return self.train_timeout if self.train_timeout_in_force else self.init_timeout

    def collective_timeout(self) -> float:
        """The collectives' timeout once training runs: the watchdog reports a hang after
        train_timeout; the collectives' own limit stays a little longer, as a backstop."""
        return self.train_timeout + (BACKSTOP_GRACE if self.watched else 0.0)

    def step_done(self, step: int) -> Optional[float]:
        """After each optimizer step. The first of this run ends start-up: a long wait is now a hang;
        then the watchdog's new no-progress limit is returned (else None)."""
        self.step = step
        if step == self.start_step + 1 and self.train_timeout > 0:
            set_train_timeout(self.parallel, self.collective_timeout())
            return self.train_timeout
        return None

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Around a checkpoint's writes, which can outlast the train timeout (fast writers wait for
        slow ones in DCP's closing collective): not a hang, so the collectives get the init timeout
        (as the watchdog does: its supervisor says so), and the train timeout back afterwards."""
        shortened = self.train_timeout_in_force
        if shortened:
            set_train_timeout(self.parallel, self.init_timeout)
        yield
        if shortened:
            set_train_timeout(self.parallel, self.collective_timeout())
