"""Elapsed time and the time left to train.steps, for the step line.

The estimate is the mean wall time of the recent steps times the steps left. A step's wall time
runs from the end of the step before to its own end (data, logging and reports included), minus
what the loop spent paused in evaluation and checkpoint saves; the first steps of a process
(compilation, lazy set-up, the first allocations) are left out. The pauses come back as their
share per step so far, so an ETA does not jump at each evaluation and still counts them.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Callable, Iterator, Optional

WARMUP_STEPS = 2  # this process's first steps: compiled, allocated, slow; not in the mean
RECENT_STEPS = 50  # the mean is over these many steps, so a change of speed shows within them


class StepClock:
    def __init__(self, started: float, first_step: int, now: Callable[[], float] = time.perf_counter) -> None:
        """started: when this process began (set-up counts as elapsed time); first_step: the step
        this process trains from (0, or a resumed checkpoint's)."""
        self.now, self.started, self.first_step = now, started, first_step
        self.mark = now()  # the end of the last step (or the start of the loop)
        self.paused = 0.0  # pause seconds since self.mark
        self.pause_total = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Time that is not a training step's (an evaluation, a checkpoint save)."""
        start = self.now()
        try:
            yield
        finally:
            seconds = self.now() - start
            self.paused += seconds
            self.pause_total += seconds

    def step_done(self, step: int) -> None:
        now = self.now()
        if step - self.first_step > WARMUP_STEPS:
            self.recent.append(now - self.mark - self.paused)
        self.mark, self.paused = now, 0.0

    def elapsed(self) -> float:
        return self.now() - self.started

    def eta(self, step: int, steps: int) -> Optional[float]:
        """Seconds to train.steps from `step`; None until a step after the warm-up was timed."""
        left = max(0, steps - step)
        if left == 0:
            return 0.0
        if not self.recent:
            return None
        pause_per_step = self.pause_total / max(1, step - self.first_step)
        return left * (sum(self.recent) / len(self.recent) + pause_per_step)
