"""Timeouts and collective tracing on by default, so a stuck collective fails fast and leaves a trace.

Start-up (rendezvous, first compilation, data preparation) legitimately takes long, so the process
group starts with the generous init timeout; once this run's first step has completed (also after
a resume), every group of the mesh gets the shorter train timeout: a collective that waits longer
than that is a hang. While a checkpoint is written, the init timeout applies again. `Deadlines`
says which one applies when, to the collectives and to the watchdog.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, MutableMapping, Optional

import torch.distributed as dist

from ..compat.torch import set_pg_timeout
from ..mesh import ParallelDims

if TYPE_CHECKING:
    from .watchdog import Watchdog

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


def mesh_groups(parallel: ParallelDims) -> list[tuple[str, object]]:
    """(dimension name, group) for every process group a training step can use; each group once."""
    named = [("mp", parallel.mp_group), ("dp_shard", parallel.dp_shard_group),
             ("dp_replicate", parallel.dp_replicate_group), ("dp", parallel.dp_group), ("world", dist.group.WORLD)]
    seen, out = set(), []
    for dim, group in named:
        if group is not None and group.group_name not in seen:
            seen.add(group.group_name)
            out.append((dim, group))
    return out


def set_train_timeout(parallel: ParallelDims, seconds: float) -> None:
    """Give every group of the mesh the (shorter) timeout used once training runs."""
    timeout = timedelta(seconds=seconds)
    for _, group in mesh_groups(parallel):
        set_pg_timeout(timeout, group)


class Deadlines:
    """Which timeout applies when, for a run that starts (or resumes) at `start_step`. The trainer
    calls `at(phase)` as it goes, `step_done(step)` after each step and writes checkpoints inside
    `checkpointing()`; `watchdog` (set while one runs) is told the phase and its no-progress limit."""

    def __init__(self, init_timeout: float, train_timeout: float, parallel: ParallelDims, start_step: int = 0,
                 watchdog: Optional[Watchdog] = None) -> None:
        self.init_timeout, self.train_timeout = init_timeout, train_timeout
        self.parallel = parallel
        self.start_step = self.step = start_step
        self.watchdog = watchdog

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
        return self.train_timeout + (BACKSTOP_GRACE if self.watchdog is not None else 0.0)

    def at(self, phase: str, *, step: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """Tell the watchdog where this rank is (cheap: a few attribute writes); `step`: the step in
        progress; `timeout`: its new no-progress limit."""
        if self.watchdog is not None:
            if step is not None:
                self.watchdog.step = step
            self.watchdog.phase = phase
            if timeout is not None:
                self.watchdog.arm(timeout)

    def step_done(self, step: int) -> None:
        """After each optimizer step. The first of this run ends start-up: a long wait is now a hang."""
        self.step = step
        if step == self.start_step + 1 and self.train_timeout > 0:
            set_train_timeout(self.parallel, self.collective_timeout())
            self.at("first step done", timeout=self.train_timeout)

    @contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Around a checkpoint's writes, which can outlast the train timeout (fast writers wait for
        slow ones in DCP's closing collective): not a hang, so the watchdog and the collectives get
        the init timeout, and the train timeout back afterwards."""
        shortened = self.train_timeout_in_force
        self.at("checkpoint", timeout=self.init_timeout)
        if shortened:
            set_train_timeout(self.parallel, self.init_timeout)
        yield
        if shortened:
            set_train_timeout(self.parallel, self.collective_timeout())
        self.at("checkpointed", timeout=self.no_progress_limit())
