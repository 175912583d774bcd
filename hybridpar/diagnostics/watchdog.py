"""The hang watchdog: when a job stops making progress, say who is to blame, then exit non-zero.

Every rank runs a small thread that publishes a heartbeat through the job's store (the c10d store
every launcher already provides; no shared file system needed): a beat counter, the step and phase
the trainer is in, and the number of collectives issued on each mesh group (cheap counters, read
without touching the flight recorder). Rank 0's thread watches all heartbeats (rank 1's takes over
if rank 0's stops). It acts when
  - no rank has made progress (step, phase or collective count) for the timeout: a hang;
  - a rank's heartbeat stopped: the process is gone (killed, crashed, os._exit), or a rank never
    started beating within the timeout (stuck before training);
  - the launcher is tearing the job down (SIGTERM after another rank failed).
Then it asks every live rank for its flight-recorder trace and Python stack (each rank also writes
them to its own trace folder for `hybridpar hang-report`), runs `flight.analyse`, prints one report,
writes `hang_report.json` in the run folder and makes every rank exit with HANG_EXIT_CODE (ranks the
launcher is already stopping exit with 128 + SIGTERM instead).

The collectives themselves keep a (longer) c10d timeout as a backstop in case the watchdog cannot
report, e.g. when the store itself is gone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from ..files import write_bytes_atomic, write_text_atomic
from ..mesh import ParallelDims
from . import flight
from .timeouts import mesh_groups

HANG_EXIT_CODE = 124  # as timeout(1): the job was stopped because it stopped making progress
BACKSTOP_GRACE = 30.0  # seconds the c10d timeout leaves the watchdog to report first


def default_interval(timeout: float) -> float:
    """Beat often enough to report within a few percent of the timeout, but not more than needed."""
    return min(5.0, max(0.2, timeout / 20))


class Watchdog:
    """Start after init_parallel; the trainer sets `.step` and `.phase` as it goes and calls close()."""

    _instances = 0

    def __init__(self, parallel: ParallelDims, *, timeout: float, run_dir: Path, trace_dir: Path,
                 interval: float = 0.0, exit_fn: Callable[[int], None] = os._exit) -> None:
        self.parallel = parallel
        self.rank, self.world_size = parallel.rank, parallel.world_size
        self.timeout = timeout
        self.interval = interval or default_interval(timeout)
        self.run_dir, self.trace_dir = Path(run_dir), Path(trace_dir)
        self.step, self.phase, self.note = 0, "start", ""
        self._exit = exit_fn
        self._groups = mesh_groups(parallel)
        # Keys must not meet those of an earlier watchdog in the same store: torchrun's store outlives
        # restarts, and a process may train several times. Every rank counts alike, so keys agree.
        Watchdog._instances += 1
        attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._prefix = f"hybridpar/watchdog/{attempt}/{Watchdog._instances}/"
        self._store = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._main_thread = threading.main_thread().ident
        self._beat = 0
        self._state = "running"
        self._dumped = False
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._previous_handler = None
        # The monitor's view: rank -> (last value, monitor time it last changed).
        self._beats: dict[int, tuple[object, float]] = {}
        self._progress: dict[int, tuple[object, float]] = {}
        self._last: dict[int, dict] = {}
        self._all_beating = False
        self._teardown = False  # some rank got SIGTERM: the launcher is stopping the job
        self._dead: list[int] = []

    # --- the trainer's side ----------------------------------------------------------------------

    def start(self) -> "Watchdog":
        store = dist.distributed_c10d._get_default_store()
        try:
            self._store = store.clone()  # its own connection: never queued behind the main thread's calls
        except (AttributeError, RuntimeError):
            self._store = store
        c = self.parallel.coords
        info = {
            "host": socket.gethostname(), "pid": os.getpid(),
            "coords": f"mp {c.mp_rank}, dp {c.dp_rank} (replicate {c.replicate_idx}, shard {c.shard_idx})",
            "groups": {g.group_name: {"dim": dim, "ranks": dist.get_process_group_ranks(g)} for dim, g in self._groups},
        }
        self._info = info
        self._publish()
        self._watch_signals()
        self._thread = threading.Thread(target=self._run, name="hybridpar-watchdog", daemon=True)
        self._thread.start()
        return self

    def arm(self, timeout: float) -> None:
        """Change the no-progress timeout (the trainer shortens it once the first step is done)."""
        self.timeout = timeout

    def close(self, error: Optional[BaseException] = None) -> None:
        """Stop the thread. The last heartbeat says 'done' (a normal end, not a death), or 'failed'
        with the error, which the other ranks' monitor puts in its report if they then hang."""
        if self._thread is None:
            return
        self._state = "failed" if error is not None else "done"
        if error is not None:
            self.note = f"raised {type(error).__name__}: {flight.short_message(error)}"
            stack, group_name = flight.error_stack(error)
            try:  # what this rank saw, for the monitor and for hang-report: it is about to exit
                self._dump_trace({"stack": stack, "failed_in": group_name})
            except Exception:
                pass
        self._stop.set()
        if self._wake_w is not None:  # closing a socket does not wake a select() in another thread; a byte does
            try:
                self._wake_w.send(b"\0")
            except BlockingIOError:  # the buffer is full: the thread is woken already
                pass
        self._thread.join(timeout=10)
        try:
            self._publish()
        except Exception:  # the store may already be gone at the very end of a job
            pass
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            signal.set_wakeup_fd(-1)
        if self._wake_r is not None:
            self._wake_r.close()
            self._wake_w.close()
        self._thread = None

    # --- store helpers --------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _set(self, name: str, value: str | bytes) -> None:
        self._store.set(self._key(name), value)

    def _has(self, name: str) -> bool:
        return self._store.check([self._key(name)])

    def _get_many(self, names: list[str]) -> list[bytes]:
        return self._store.multi_get([self._key(n) for n in names])

    # --- heartbeat ------------------------------------------------------------------------------

    def _seqs(self) -> dict[str, int]:
        return {g.group_name: int(g._get_sequence_number_for_group()) for _, g in self._groups}

    def _publish(self) -> None:
        self._beat += 1
        beat = {"beat": self._beat, "step": self.step, "phase": self.phase, "seqs": self._seqs(),
                "state": self._state, "timeout": self.timeout, "note": self.note}
        self._set(f"beat/{self.rank}", json.dumps(beat))

    def _watch_signals(self) -> None:
        """SIGTERM (the launcher stopping the job after a failure) wakes this thread at once, even
        while the main thread sits in a collective and cannot run Python signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        try:
            signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except ValueError:
            r.close()
            w.close()
            return
        self._wake_r, self._wake_w = r, w

        def on_sigterm(signum, frame):  # runs in the main thread when it next runs Python
            if self._thread is None or not self._thread.is_alive():
                raise SystemExit(128 + signum)

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)

    def _sleep(self) -> bool:
        """Wait one interval; True if SIGTERM arrived (close() wakes it with a zero byte: not SIGTERM)."""
        if self._wake_r is None:
            self._stop.wait(self.interval)
            return False
        try:
            ready, _, _ = select.select([self._wake_r], [], [], self.interval)
            if ready:
                return signal.SIGTERM in self._wake_r.recv(64)
        except (OSError, ValueError):
            self._stop.wait(self.interval)
        return False

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        failures_since: Optional[float] = None
        monitor = self.rank == 0
        while not self._stop.is_set():
            terminating = self._sleep()
            if self._stop.is_set():
                return
            if terminating:
                self._state = "terminating"
            try:
                self._publish()
                if self._has("abort"):
                    self._answer_dump_request()
                    self._exit(HANG_EXIT_CODE)
                    return
                self._answer_dump_request()
                if not monitor and self.rank == 1:
                    monitor = self._rank0_gone()
                if monitor:
                    reason = self._check()
                    if reason:
                        self._report(reason)
                        return
                elif terminating and not self._has("dump"):
                    self._wait_for_verdict()
                    return
                failures_since = None
            except Exception as err:  # the store is unreachable: its host (rank 0's) is probably gone
                now = time.monotonic()
                failures_since = failures_since or now
                if now - failures_since > self._dead_after():
                    print(f"hybridpar watchdog (rank {self.rank}): the job's store has been unreachable for "
                          f"{now - failures_since:.0f} s ({err}); the rank hosting it is probably gone. Exiting.",
                          file=sys.stderr, flush=True)
                    self._exit(HANG_EXIT_CODE)
                    return

    def _answer_dump_request(self) -> None:
        if not self._dumped and self._has("dump"):
            self._dump_trace()

    def _dump_trace(self, extra: Optional[dict] = None) -> None:
        """Send this rank's trace to the monitor and keep a flight-recorder dump on this node."""
        self._dumped = True
        info = {**self._info, "rank": self.rank, "world_size": self.world_size, "step": self.step,
                "phase": self.phase, "note": self.note, "stack": flight.python_stack(self._main_thread),
                **(extra or {})}
        try:
            dump = flight.dump_flight_recorder()
        except Exception as err:  # the recorder is off (TORCH_FR_BUFFER_SIZE=0): counts only
            dump = {"entries": [], "pg_status": {}}
            info["note"] = (info["note"] + "; " if info["note"] else "") + f"no flight recorder ({err})"
        dump["hybridpar"] = info
        trace = flight.trace_from_dump(dump, info)
        self._set(f"trace/{self.rank}", json.dumps(dataclasses.asdict(trace)))
        try:  # this node's own copy, for `hybridpar hang-report` later
            write_bytes_atomic(self.trace_dir / f"flight_recorder_rank_{self.rank}", pickle.dumps(dump))
        except OSError:
            pass

    def _wait_for_verdict(self) -> None:
        """Being torn down: give the monitor a few seconds to collect this rank's trace, then go."""
        deadline = time.monotonic() + max(5.0, 4 * self.interval)
        while time.monotonic() < deadline and not self._has("verdict"):
            self._answer_dump_request()
            time.sleep(min(0.2, self.interval))
        self._answer_dump_request()
        self._exit(128 + signal.SIGTERM)

    # --- the monitor ------------------------------------------------------------------------------

    def _dead_after(self) -> float:
        """A heartbeat silent this long means the process is gone. The beat thread runs while the
        main thread waits in a collective or computes in kernels that release the GIL; C code that
        holds the GIL this long would be mistaken for a dead process."""
        return min(self.timeout, max(5.0, 10 * self.interval))

    def _rank0_gone(self) -> bool:
        if not self._has("beat/0"):  # rank 0 is still setting up: a get would block until it beats
            return False
        beat = json.loads(self._get_many(["beat/0"])[0])
        now = time.monotonic()
        last = self._beats.get(0)
        if last is None or last[0] != beat["beat"]:
            self._beats[0] = (beat["beat"], now)
            return False
        return beat["state"] != "done" and now - last[1] > self._dead_after()

    def _read_beats(self) -> dict[int, dict]:
        names = [f"beat/{r}" for r in range(self.world_size)]
        if not self._all_beating:  # until every rank has beaten once: one check each
            present = [n for n in names if self._store.check([self._key(n)])]
            self._all_beating = len(present) == len(names)
        else:  # then one round trip for all (a beat key is never deleted)
            present = names
        values = self._get_many(present) if present else []
        return {int(n.split("/")[1]): json.loads(v) for n, v in zip(present, values)}

    def _check(self) -> Optional[str]:
        """The reason to report now, or None."""
        now = time.monotonic()
        beats = self._read_beats()
        for r in range(self.world_size):
            b = beats.get(r)
            if b is None:
                self._beats.setdefault(r, (None, now))
                self._progress.setdefault(r, (None, now))
                continue
            self._last[r] = b
            if self._beats.get(r, (None,))[0] != b["beat"]:
                self._beats[r] = (b["beat"], now)
            progress = (b["step"], b["phase"], tuple(sorted(b["seqs"].items())))
            if self._progress.get(r, (None,))[0] != progress:
                self._progress[r] = (progress, now)
        active = [r for r in range(self.world_size) if self._last.get(r, {}).get("state") != "done"]
        if not active:
            return None
        failed = [r for r in active if self._last.get(r, {}).get("state") == "failed"]
        terminating = [r for r in active if self._last.get(r, {}).get("state") == "terminating"]
        timeout = max(self._last.get(r, {}).get("timeout", self.timeout) for r in active)
        idle = now - max(self._progress[r][1] for r in active)
        # A failed rank stops beating once it has published its error and trace: not a death.
        stopped = [r for r in active if r not in failed and self._beats[r][0] is not None
                   and now - self._beats[r][1] > self._dead_after()]
        if self.rank == 1 and 0 not in stopped + failed:  # rank 1 monitors only when rank 0 is gone
            stopped.append(0)
        # A rank that never beat may still be setting up (building the model, loading a checkpoint)
        # without any collective: it gets the whole timeout.
        unstarted = [r for r in active if self._beats[r][0] is None and now - self._beats[r][1] > timeout]
        self._dead = sorted(stopped + unstarted)
        reasons = []
        if stopped:
            reasons.append(f"rank(s) {sorted(stopped)} stopped sending heartbeats (process gone)")
        if unstarted:
            reasons.append(f"rank(s) {unstarted} have not started their watchdog within {timeout:g} s "
                           "(not reached training: stuck in set-up, or never started)")
        if reasons:
            return "; ".join(reasons)
        if failed and idle > self._dead_after():  # failed alone, and the others are stuck without it
            notes = "; ".join(f"rank {r} {self._last[r]['note']}" for r in failed[:3])
            return f"rank(s) {failed} failed: {notes}"
        if terminating:
            self._teardown = True
            return f"the launcher is stopping the job (SIGTERM to ranks {terminating})"
        if idle > timeout:
            return f"no progress on any rank for {idle:.1f} s (timeout {timeout:g} s)"
        return None

    def _report(self, reason: str) -> None:
        self._set("dump", reason)
        self._answer_dump_request()
        dead = list(self._dead)
        if self._teardown or self._state == "terminating":
            # Ranks killed before the launcher's SIGTERM stop beating first: wait until that shows.
            time.sleep(min(self._dead_after(), 3 * self.interval + 1.0))
            self._check()
            dead = list(self._dead)
        traces = self._collect(dead)
        gone = sorted(set(dead) | (set(range(self.world_size)) - set(traces)))
        last_issued = {r: self._last.get(r, {}).get("seqs", {}) for r in gone}
        for r, t in traces.items():
            b = self._last.get(r)
            if b and b.get("note") and not t.note:
                t.note = b["note"]
        step = max((b.get("step", 0) for b in self._last.values()), default=0)
        headline = f"hybridpar watchdog at step {step}: {reason}"
        try:
            verdict = flight.analyse(traces, gone, last_issued)
            text = flight.format_report(verdict, headline, self.world_size)
            report = {"reason": reason, "step": step, **verdict.to_json()}
        except Exception:  # a bug in the analysis must not cost the report, nor the other ranks' exit
            error = traceback.format_exc()
            text = f"{headline}\nthe analysis of the traces failed:\n{error}"
            report = {"reason": reason, "step": step, "analysis_error": error}
        report_path = self.run_dir / "hang_report.json"
        text += (f"\nreport: {report_path}; per-rank traces: {self.trace_dir} on each node "
                 f"(`hybridpar hang-report DIR` after collecting them)\nthe ranks exit with code {HANG_EXIT_CODE} "
                 f"(those the launcher is stopping: {128 + signal.SIGTERM})")
        print("\n" + text + "\n", file=sys.stderr, flush=True)
        try:
            write_text_atomic(report_path, json.dumps(report, indent=1))
        except OSError as err:
            print(f"hybridpar watchdog: could not write {report_path}: {err}", file=sys.stderr, flush=True)
        self._set("verdict", text)
        self._set("abort", "1")
        self._exit(HANG_EXIT_CODE)

    def _collect(self, dead: list[int]) -> dict[int, flight.RankTrace]:
        """Traces of every live rank; those that do not answer within a few seconds are left out."""
        wanted = [r for r in range(self.world_size) if r not in dead]
        deadline = time.monotonic() + max(5.0, 4 * self.interval)
        traces: dict[int, flight.RankTrace] = {}
        while True:
            for r in wanted:
                if r not in traces and self._has(f"trace/{r}"):
                    traces[r] = flight.RankTrace.from_json(json.loads(self._get_many([f"trace/{r}"])[0]))
            if len(traces) == len(wanted) or time.monotonic() > deadline:
                return traces
            time.sleep(0.1)
