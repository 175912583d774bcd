"""Every rank's side of the hang watchdog: its heartbeat, and what it answers the monitor.

A rank publishes a heartbeat through the job's store (the c10d store every launcher already
provides; no shared file system needed): a beat counter, the step and phase the trainer is in, and
the number of collectives issued on each mesh group (cheap counters, read without touching the
flight recorder). When the monitor asks for it, the rank sends its flight-recorder trace and Python
stack, and keeps a copy in its own trace folder for `hybridpar hang-report`. A stop signal
(hybridpar.train.stop) is published at once as the state "stopping": a stop on purpose, which the
monitor tells apart from a hang and from a death.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from ..compat.torch import default_store, sequence_number
from ..mesh import MeshCoords, ParallelDims, mesh_groups
from ..ranks import attempt_id
from . import flight
from .liveness import process_alive
from .traces import write_dump

HANG_EXIT_CODE = 124  # as timeout(1): the job was stopped because it stopped making progress


def default_interval(timeout: float) -> float:
    """Beat often enough to report within a few percent of the timeout, but not more than needed."""
    return min(5.0, max(0.2, timeout / 20))


class Heartbeat:
    """This rank's beat: the trainer sets `.step`, `.phase` and `.note`; a thread publishes them.
    `clock` gives monotonic() and sleep() (the `time` module, or a test's stand-in)."""

    _instances = 0

    def __init__(self, parallel: ParallelDims, *, timeout: float, trace_dir: Path, interval: float = 0.0,
                 exit_fn: Callable[[int], None] = os._exit, clock=time) -> None:
        self.parallel = parallel
        self.rank, self.world_size = parallel.rank, parallel.world_size
        self.timeout = timeout
        self.interval = interval or default_interval(timeout)
        self.trace_dir = Path(trace_dir)
        self.step, self.phase, self.note = 0, "start", ""
        self._exit = exit_fn
        self._clock = clock
        self._groups = mesh_groups(parallel)
        # Keys must not meet those of an earlier watchdog in the same store: torchrun's store outlives
        # restarts, and a process may train several times. Every rank counts alike, so keys agree.
        Heartbeat._instances += 1
        self._attempt = f"hybridpar/watchdog/{attempt_id()}/"
        self._prefix = f"{self._attempt}{Heartbeat._instances}/"
        self._store = None
        self._info: dict = {}
        self._thread: Optional[threading.Thread] = None  # the thread that beats (the watchdog's)
        self._stop = threading.Event()
        self._main_thread = threading.main_thread().ident
        self._beat = 0
        self._state = "running"
        self._dumped = False
        self._woken = threading.Event()
        self._published = threading.Event()
        self._neighbours: Optional[dict[int, int]] = None  # rank -> pid, of the ranks on this host
        self._seen_gone: set[int] = set()

    def _connect(self) -> None:
        """This rank's own store connection, and what its trace says about it."""
        store = default_store()
        try:
            self._store = store.clone()  # its own connection: never queued behind the main thread's calls
        except (AttributeError, RuntimeError):
            self._store = store
        c = self.parallel.coords
        self._info = {
            "host": socket.gethostname(), "pid": os.getpid(),
            "coords": MeshCoords.describe(c),  # also for a stand-in with the same fields
            "groups": {g.group_name: {"dim": dim, "ranks": dist.get_process_group_ranks(g)} for dim, g in self._groups},
        }

    # --- store helpers --------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _set(self, name: str, value: str | bytes) -> None:
        self._store.set(self._key(name), value)

    def _has(self, name: str) -> bool:
        return self._store.check([self._key(name)])

    def _get_many(self, names: list[str]) -> list[bytes]:
        return self._store.multi_get([self._key(n) for n in names])

    # --- the beat -------------------------------------------------------------------------------

    def _seqs(self) -> dict[str, int]:
        return {g.group_name: sequence_number(g) for _, g in self._groups}

    def _publish(self) -> None:
        self._beat += 1
        beat = {"beat": self._beat, "step": self.step, "phase": self.phase, "seqs": self._seqs(),
                "state": self._state, "timeout": self.timeout, "note": self.note}
        self._set(f"beat/{self.rank}", json.dumps(beat))
        self._published.set()

    # --- who runs where, and who is gone (liveness.py) ------------------------------------------

    def _who_key(self, rank: int) -> str:
        # Per attempt, not per watchdog: a rank that died under the set-up watchdog is still found
        # by the training one.
        return f"{self._attempt}who/{rank}"

    def _register(self) -> None:
        self._store.set(self._who_key(self.rank), json.dumps({"host": self._info["host"], "pid": self._info["pid"]}))

    def _whos(self, ranks: list[int]) -> list[dict]:
        return [json.loads(v) for v in self._store.multi_get([self._who_key(r) for r in ranks])]

    def _look_at_neighbours(self) -> None:
        """Say, through the store, which ranks on this host have died since the last look."""
        if self._neighbours is None:
            if not all(self._store.check([self._who_key(r)]) for r in range(self.world_size)):
                return  # some rank has not registered yet
            whos = self._whos(list(range(self.world_size)))
            self._neighbours = {r: w["pid"] for r, w in enumerate(whos)
                                if r != self.rank and w["host"] == self._info["host"]}
        for r, pid in self._neighbours.items():
            if r not in self._seen_gone and not process_alive(pid):
                self._seen_gone.add(r)
                self._set(f"gone/{r}", json.dumps({"by": self.rank, "host": self._info["host"], "pid": pid}))
                self._store.add(self._key("gone_count"), 1)

    def _dead_after(self) -> float:
        """A heartbeat silent this long means the process is gone. The beat thread runs while the
        main thread waits in a collective or computes in kernels that release the GIL; C code that
        holds the GIL this long would be mistaken for a dead process."""
        return min(self.timeout, max(5.0, 10 * self.interval))

    # --- waking, and a stop on request -----------------------------------------------------------

    def _wake(self) -> None:
        """Wake the thread from its sleep."""
        self._woken.set()

    def _sleep(self) -> None:
        """Wait one interval, or until woken."""
        self._woken.wait(self.interval)
        self._woken.clear()

    def stop_requested(self, signal_name: str) -> None:
        """A stop signal arrived (hybridpar.train.stop): the rank now finishes its step and saves. Said at
        once, so the monitor never takes what follows for a hang or a teardown."""
        if self._state in ("lost_peer", "failed"):  # a stop cannot complete without the lost rank
            return
        self._state = "stopping"
        self.note = f"stopping on {signal_name}"
        self._wake()

    def stopped(self, wait: float = 2.0) -> None:
        """The rank is about to exit on purpose (its stop ran out of time): not a death. Waits until
        the beat saying so is out, at most `wait` seconds."""
        self._state = "stopped"
        self._published.clear()
        self._wake()
        if self._thread is not None and self._thread.is_alive():
            self._published.wait(wait)

    # --- answering the monitor ------------------------------------------------------------------

    def _answer_dump_request(self) -> None:
        if not self._dumped and self._has("dump"):
            self._dump_trace()

    def _record_failure(self, error: BaseException) -> None:
        """What this rank saw when it raised, for the monitor and for hang-report: it is about to exit."""
        self.note = f"raised {type(error).__name__}: {flight.short_message(error)}"
        stack, group_name = flight.error_stack(error)
        try:
            self._dump_trace({"stack": stack, "failed_in": group_name})
        except Exception:
            pass

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
            write_dump(self.trace_dir, self.rank, dump)
        except OSError:
            pass
