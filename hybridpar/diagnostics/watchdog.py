"""The hang watchdog: when a job stops making progress, say who is to blame, then exit non-zero.

Every rank runs a small thread that publishes its heartbeat through the job's store (heartbeat.py)
and answers the monitor; rank 0's thread is also the monitor (monitor.py; rank 1's takes over if
rank 0's heartbeat stops), which reports a hang, a dead rank or a failed rank (a rank stopping on
request is none of these: hybridpar.train.stop), writes `hang_report.json` in the run folder and
makes every rank exit with HANG_EXIT_CODE.

The collectives themselves keep a (longer) c10d timeout as a backstop in case the watchdog cannot
report, e.g. when the store itself is gone (timeouts.BACKSTOP_GRACE).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from ..mesh import ParallelDims
from .heartbeat import HANG_EXIT_CODE, default_interval
from .liveness import is_peer_loss
from .monitor import Monitor
from .timeouts import BACKSTOP_GRACE

__all__ = ["Watchdog", "HANG_EXIT_CODE", "BACKSTOP_GRACE", "default_interval"]


class Watchdog(Monitor):
    """Start after init_parallel; the trainer sets `.step` and `.phase` as it goes and calls close()."""

    def __init__(self, parallel: ParallelDims, *, timeout: float, run_dir: Path, trace_dir: Path,
                 interval: float = 0.0, exit_fn: Callable[[int], None] = os._exit) -> None:
        # This module's `time` is the clock of both halves, so a test that replaces it moves them all.
        super().__init__(parallel, run_dir=run_dir, timeout=timeout, trace_dir=trace_dir, interval=interval,
                         exit_fn=exit_fn, clock=time)
        self._monitoring = self.rank == 0  # rank 1 joins in when rank 0's heartbeat stops
        self.paused = False

    def start(self) -> "Watchdog":
        """Start watching; after pause(), watch on with the same keys (a verdict given meanwhile is obeyed)."""
        if self._store is None:
            self._connect()
            self._register()
        self._state, self.paused = "running", False
        self._stop.clear()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="hybridpar-watchdog", daemon=True)
        self._thread.start()
        return self

    def arm(self, timeout: float) -> None:
        """Change the no-progress timeout (the trainer shortens it once the first step is done)."""
        self.timeout = timeout

    def pause(self) -> None:
        """Stop the thread until start() again; the last beat says 'paused': not watched meanwhile
        (set-up is done and run() has not begun; a Trainer built and never run leaves no thread)."""
        self._end("paused")
        self.paused = True

    def close(self, error: Optional[BaseException] = None) -> None:
        """Stop the thread. The last heartbeat says 'done' (a normal end, not a death), or 'failed'
        with the error, which the other ranks' monitor puts in its report if they then hang.

        An error from a collective whose peer vanished is another rank's failure, not this one's:
        the rank says so ('lost_peer') and waits, its thread still beating (and, on rank 0,
        monitoring), until the verdict names the dead rank and ends the process."""
        if self._thread is None:
            return
        if error is not None and self.world_size > 1 and is_peer_loss(error) and self._thread.is_alive():
            self._state = "lost_peer"
            self._record_failure(error)
            self._wake()
            self._thread.join(timeout=self._dead_after() + max(5.0, 4 * self.interval) + 10.0)
            if self._thread is None:
                return
        if error is not None:
            self._state = "failed"
            self._record_failure(error)
        self._end("failed" if error is not None else "done")

    def _end(self, state: str) -> None:
        if self._thread is None:
            return
        self._state = state
        self._stop.set()
        self._wake()
        self._thread.join(timeout=10)
        try:
            self._publish()
        except Exception:  # the store may already be gone at the very end of a job
            pass
        self._thread = None

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        failures_since: Optional[float] = None
        while not self._stop.is_set():
            self._sleep()
            if self._stop.is_set():
                return
            try:
                if self._round():
                    return
                failures_since = None
            except Exception as err:  # the store is unreachable: its host (rank 0's) is probably gone
                now = self._clock.monotonic()
                failures_since = failures_since or now
                if now - failures_since > self._dead_after():
                    print(f"hybridpar watchdog (rank {self.rank}): the job's store has been unreachable for "
                          f"{now - failures_since:.0f} s ({err}); the rank hosting it is probably gone. Exiting.",
                          file=sys.stderr, flush=True)
                    self._exit(HANG_EXIT_CODE)
                    return

    def _round(self) -> bool:
        """One beat: publish, obey an abort, answer a dump request, then monitor (rank 0, or rank 1
        once rank 0 is gone). True when the thread is done."""
        self._look_at_neighbours()
        self._publish()
        if self._has("abort"):
            self._answer_dump_request()
            self._exit(HANG_EXIT_CODE)
            return True
        self._answer_dump_request()
        if not self._monitoring and self.rank == 1:
            self._monitoring = self._rank0_gone()
        if self._monitoring:
            reason = self._check()
            if reason:
                self._report(reason)
                return True
        return False
