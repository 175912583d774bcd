"""The hang watchdog: when a job stops making progress, say who is to blame, then exit non-zero.

Every rank runs a small thread that publishes its heartbeat through the job's store (heartbeat.py)
and answers the monitor (while it watches, the rank's sends and receives are logged: diagnostics.p2p); rank 0's thread also runs the monitor (monitor.py; rank 1's takes over if
rank 0's heartbeat stops), which reports a hang, a dead rank or a failed rank (a rank stopping on
request is none of these: hybridpar.train.stop), writes `hang_report.json` in the run folder and
makes every rank exit with HANG_EXIT_CODE.

The collectives themselves keep a (longer) c10d timeout as a backstop in case the watchdog cannot
report, e.g. when the store itself is gone (timeouts.BACKSTOP_GRACE).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..mesh.device import ParallelDims
from .heartbeat import HANG_EXIT_CODE, Heartbeat, default_interval
from .liveness import lost_in_collective
from .monitor import Monitor
from .timeouts import BACKSTOP_GRACE
from .wrap import listeners

log = logging.getLogger(__name__)

__all__ = ["Watchdog", "HANG_EXIT_CODE", "BACKSTOP_GRACE", "default_interval"]


class Watchdog:
    """Start after init_parallel; tell it `.step` and `.phase` as the rank goes, then close().
    This rank's heartbeat (`beat`) and the monitor that reads everyone's (`monitor`), one thread for both."""

    def __init__(self, parallel: ParallelDims, *, timeout: float, run_dir: Path, trace_dir: Path,
                 interval: float = 0.0, exit_fn: Callable[[int], None] = os._exit, group: Optional[int] = None) -> None:
        # This module's `time` is the clock of both, so a test that replaces it moves them all.
        # group: the replica group of a fault-tolerant job, named with every rank in the verdicts.
        self.beat = Heartbeat(parallel, timeout=timeout, trace_dir=trace_dir, interval=interval, clock=time, group=group)
        self.monitor = Monitor(self.beat, run_dir=run_dir, exit_fn=exit_fn)
        self.rank, self.world_size = parallel.rank, parallel.world_size
        self._exit = exit_fn
        self._monitoring = self.rank == 0  # rank 1 joins in when rank 0's heartbeat stops
        self._thread: Optional[threading.Thread] = None
        self._guarding: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._busy_since: Optional[float] = None  # when the store calls under way began
        self.paused = False

    @property
    def step(self) -> int:
        """The step this rank is in, as its heartbeat says."""
        return self.beat.step

    @step.setter
    def step(self, step: int) -> None:
        self.beat.step = step

    @property
    def phase(self) -> str:
        """Where in the step (or in set-up) this rank is, as its heartbeat says."""
        return self.beat.phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self.beat.phase = phase

    def start(self) -> "Watchdog":
        """Start watching; after pause(), watch on with the same keys (a verdict given meanwhile is obeyed)."""
        if self.beat.store is None:
            self.beat.connect()
            self.beat.register()
        self.beat.state, self.paused = "running", False
        if self.beat.p2p not in listeners():  # sends and receives: in the traces (diagnostics.p2p)
            self.beat.p2p.__enter__()
        self._stop.clear()
        self.beat.publish()
        self._thread = threading.Thread(target=self._run, name="hybridpar-watchdog", daemon=True)
        self._thread.start()
        if self.world_size > 1 and (self._guarding is None or not self._guarding.is_alive()):
            self._guarding = threading.Thread(target=self._guard, name="hybridpar-watchdog-guard", daemon=True)
            self._guarding.start()
        return self

    def arm(self, timeout: float) -> None:
        """Change the no-progress timeout (the trainer shortens it once the first step is done)."""
        self.beat.timeout = timeout

    def stop_requested(self, signal_name: str) -> None:
        """A stop signal arrived: said at once (Heartbeat.stop_requested)."""
        self.beat.stop_requested(signal_name)

    @contextmanager
    def waiting(self, what: str) -> Iterator[Callable[[str], None]]:
        """Around a wait for something outside this job's ranks (`what`: the replica groups' quorum):
        not a hang however long (its heartbeat says "waiting"; the monitor judges the ranks that are
        not), said once when every rank has waited longer than the no-progress limit. Yields a
        function that says what the wait is for now (the heartbeat's note)."""
        beat = self.beat
        if beat.state != "running":  # stopping, or failed: a wait now does not change what the monitor must know
            yield lambda note: None
            return
        beat.state, beat.note = "waiting", what
        beat.waits += 1

        def say(note: str) -> None:
            if beat.state == "waiting":
                beat.note = note
        try:
            yield say
        finally:
            if beat.state == "waiting":
                beat.state, beat.note = "running", ""

    def stopped(self, wait: float = 2.0) -> None:
        """The rank is about to exit on purpose (its stop ran out of time): not a death. Waits until
        the beat saying so is out, at most `wait` seconds."""
        self.beat.state = "stopped"
        self.beat.published.clear()
        self.beat.wake()
        if self._thread is not None and self._thread.is_alive():
            self.beat.published.wait(wait)

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
        beat = self.beat
        # (an error every rank raised alike is no peer's loss, whatever its text: a lighthouse's "Connection refused")
        if error is not None and self.world_size > 1 and lost_in_collective(error) and self._thread.is_alive():
            beat.state = "lost_peer"
            beat.record_failure(error)
            beat.wake()
            self._thread.join(timeout=beat.dead_after() + max(5.0, 4 * beat.interval) + 10.0)
            if self._thread is None:
                return
        if error is not None:
            beat.state = "failed"
            self._busy_since = beat.clock.monotonic()
            beat.record_failure(error)
            self._busy_since = None
            if self.rank == 0 and self.world_size > 1 and isinstance(error, Exception) and not lost_in_collective(error):
                self.monitor.own_failure(error)
        self._end("failed" if error is not None else "done")

    def _end(self, state: str) -> None:
        if self._thread is None:
            return
        self.beat.state = state
        self._stop.set()
        self.beat.wake()
        self._thread.join(timeout=10)
        if self._guarding is not None:
            self._guarding.join(timeout=2)
        self.beat.p2p.__exit__(None, None, None)
        try:
            self.beat.publish()
        except Exception:  # the store may already be gone at the very end of a job
            pass
        self._thread = None

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        failures_since: Optional[float] = None
        while not self._stop.is_set():
            self.beat.sleep()
            if self._stop.is_set():
                return
            try:
                self._busy_since = self.beat.clock.monotonic()
                try:
                    if self._round():
                        return
                finally:
                    self._busy_since = None
                failures_since = None
            except Exception as err:  # the store is unreachable: its host (rank 0's) is probably gone
                now = self.beat.clock.monotonic()
                failures_since = failures_since or now
                if now - failures_since > self.beat.dead_after():
                    self._store_gone(now - failures_since, err)
                    return

    def _guard(self) -> None:
        """A store whose host (rank 0) is frozen, stopped but not dead, keeps its connections open, and
        a call on it returns only at the process group's timeout: a call still under way after a silent
        heartbeat's limit (plus a verdict's trace collection) means the store is gone."""
        beat = self.beat
        limit = beat.dead_after() + max(5.0, 4 * beat.interval) + 5.0
        while not self._stop.wait(1.0):
            began = self._busy_since
            stuck = beat.clock.monotonic() - began if began is not None else 0.0
            if stuck > limit:
                self._store_gone(stuck, TimeoutError(f"a call has not returned for {stuck:.0f} s"))
                return

    def _store_gone(self, seconds: float, error: BaseException) -> None:
        """The job's store has not answered for `seconds` (`error`): its host, rank 0, is frozen or gone.
        Name its node if this rank is the one to (Monitor.store_lost), say so and exit."""
        said = self.monitor.store_lost(seconds, error)
        group = f" of replica group {self.beat.group}" if self.beat.group is not None else ""
        log.error(f"hybridpar watchdog (rank {self.rank}{group}): the job's store has not answered for {seconds:.0f} s ({error}); "
                  f"the rank hosting it (rank 0) is frozen or gone ({said}). Exiting.")
        self._exit(HANG_EXIT_CODE)

    def _round(self) -> bool:
        """One beat: publish, obey an abort, answer a dump request, then monitor (rank 0, or rank 1
        once rank 0 is gone). True when the thread is done."""
        beat = self.beat
        beat.look_at_neighbours()
        beat.publish()
        if beat.has("abort"):
            beat.answer_dump_request()
            self._exit(HANG_EXIT_CODE)
            return True
        beat.answer_dump_request()
        if not self._monitoring and self.rank == 1:
            self._monitoring = self.monitor.rank0_gone()
        if self._monitoring:
            reason = self.monitor.check()
            if reason:
                self.monitor.report(reason)
                return True
        return False
