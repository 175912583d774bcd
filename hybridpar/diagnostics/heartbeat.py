"""Every rank's side of the hang watchdog: its heartbeat, and what it answers the monitor.

A rank publishes a heartbeat through the job's store (the c10d store every launcher already
provides; no shared file system needed): a beat counter, the step and phase the trainer is in, and
the number of collectives issued on each mesh group (cheap counters, read without touching the
flight recorder). A step begun is published at once, between the interval's beats: a rank that dies
in step N is last seen in step N (in N - 1 only if it dies before that beat is out, within a store
write of the step's start), however long the interval. When the monitor asks for it, the rank sends its flight-recorder trace, its
open sends and receives (`p2p`, a diagnostics.p2p log) and its Python stack, and keeps
a copy in its own trace folder for `hybridpar hang-report`. A stop signal (hybridpar.train.stop)
is published at once as the state "stopping": a stop on purpose, which the monitor tells apart
from a hang and from a death.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..compat.torch import default_store, sequence_number
from ..mesh.layout import MeshCoords
from ..mesh.device import ParallelDims, mesh_groups
from ..mesh.ranks import attempt_id
from . import traces
from .liveness import process_alive
from .node_fault import node_name
from .p2p import P2PLog
from .traces import write_dump

HANG_EXIT_CODE = 124  # as timeout(1): the job was stopped because it stopped making progress


def default_interval(timeout: float) -> float:
    """Beat often enough to report within a few percent of the timeout, but not more than needed."""
    return min(5.0, max(0.2, timeout / 20))


class Heartbeat:
    """This rank's beat: the trainer sets `.step`, `.phase` and `.note`; the watchdog's thread
    publishes them. It also holds the rank's connection to the job's store, which the monitor
    reads through. `clock` gives monotonic() and sleep() (the `time` module, or a test's stand-in)."""

    _instances = 0

    def __init__(self, parallel: ParallelDims, *, timeout: float, trace_dir: Path, interval: float = 0.0,
                 clock=time, group: Optional[int] = None) -> None:
        self.parallel = parallel
        self.group = group  # the replica group of a fault-tolerant job (fault_tolerance.group), named in reports
        self.rank, self.world_size = parallel.rank, parallel.world_size
        self.timeout = timeout
        self.interval = interval or default_interval(timeout)
        self.trace_dir = Path(trace_dir)
        self._step, self.phase, self.note = 0, "start", ""
        self._published_step = -1  # the step of the last beat out
        self._round_due = False  # wake() asks for a whole round; a new step only for its beat
        self.clock = clock
        self._groups = mesh_groups(parallel)
        # Keys must not meet those of an earlier watchdog in the same store: torchrun's store outlives
        # restarts, and a process may train several times. Every rank counts alike, so keys agree.
        Heartbeat._instances += 1
        self._attempt = f"hybridpar/watchdog/{attempt_id()}/"
        self._prefix = f"{self._attempt}{Heartbeat._instances}/"
        self.store = None
        self.info: dict = {}
        self._main_thread = threading.main_thread().ident
        self._beat = 0
        self.state = "running"
        self.waits = 0  # waits outside the job begun (Watchdog.waiting): the monitor tells one from the next
        self._dumped = False
        self._woken = threading.Event()
        self.published = threading.Event()
        self.neighbours: Optional[dict[int, int]] = None  # rank -> pid, of the ranks on this host
        self.nodes: dict[int, str] = {}  # rank -> its node, gathered at set-up (train.supervisor)
        self._seen_gone: set[int] = set()
        # This rank's sends and receives, while the watchdog watches; its groups named as the mesh names them.
        self.p2p = P2PLog({g.group_name: dim for dim, g in self._groups})

    def connect(self) -> None:
        """This rank's own store connection, and what its trace says about it."""
        store = default_store()
        try:
            self.store = store.clone()  # its own connection: never queued behind the main thread's calls
            # A wait for a key that never comes ends within a silent heartbeat's limit, not the
            # process group's timeout (a frozen store's host: Watchdog._guard).
            self.store.set_timeout(timedelta(seconds=self.dead_after()))
        except (AttributeError, RuntimeError):
            self.store = store
        c = self.parallel.coords
        self.info = {
            "host": socket.gethostname(), "node": node_name(), "pid": os.getpid(),
            "coords": MeshCoords.describe(c, self.group),  # also for a stand-in with the same fields
            "groups": {g.group_name: {"dim": dim, "ranks": dist.get_process_group_ranks(g)} for dim, g in self._groups},
        }

    # --- store helpers --------------------------------------------------------------------------

    def key(self, name: str) -> str:
        return self._prefix + name

    def put(self, name: str, value: str | bytes) -> None:
        self.store.set(self.key(name), value)

    def has(self, name: str) -> bool:
        return self.store.check([self.key(name)])

    def get_many(self, names: list[str]) -> list[bytes]:
        return self.store.multi_get([self.key(n) for n in names])

    # --- the beat -------------------------------------------------------------------------------

    def _seqs(self) -> dict[str, int]:
        return {g.group_name: sequence_number(g) for _, g in self._groups}

    @property
    def step(self) -> int:
        """The step this rank is in (the trainer sets it as each step begins)."""
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        if step != self._step:
            self._step = step
            self._woken.set()  # its beat goes out now (sleep()), not at the end of the interval

    def publish(self) -> None:
        self._beat += 1
        self._published_step = self._step
        beat = {"beat": self._beat, "step": self._step, "phase": self.phase, "seqs": self._seqs(),
                "state": self.state, "timeout": self.timeout, "note": self.note, "waits": self.waits}
        self.put(f"beat/{self.rank}", json.dumps(beat))
        self.published.set()

    # --- who runs where, and who is gone (liveness.py) ------------------------------------------

    def who_key(self, rank: int) -> str:
        # Per attempt, not per watchdog: a rank that died under the set-up watchdog is still found
        # by the training one.
        return f"{self._attempt}who/{rank}"

    def register(self) -> None:
        self.store.set(self.who_key(self.rank), json.dumps({k: self.info[k] for k in ("host", "node", "pid")}))

    def whos(self, ranks: list[int]) -> list[dict]:
        return [json.loads(v) for v in self.store.multi_get([self.who_key(r) for r in ranks])]

    def look_at_neighbours(self) -> None:
        """Say, through the store, which ranks on this host have died since the last look."""
        if self.neighbours is None:
            if not all(self.store.check([self.who_key(r)]) for r in range(self.world_size)):
                return  # some rank has not registered yet
            whos = self.whos(list(range(self.world_size)))
            self.neighbours = {r: w["pid"] for r, w in enumerate(whos)
                                if r != self.rank and w["host"] == self.info["host"]}
        for r, pid in self.neighbours.items():
            if r not in self._seen_gone and not process_alive(pid):
                self._seen_gone.add(r)
                self.put(f"gone/{r}", json.dumps({"by": self.rank, "host": self.info["host"], "pid": pid}))
                self.store.add(self.key("gone_count"), 1)

    def dead_after(self) -> float:
        """A heartbeat silent this long means the process is gone. The beat thread runs while the
        main thread waits in a collective or computes in kernels that release the GIL; C code that
        holds the GIL this long would be mistaken for a dead process."""
        return min(self.timeout, max(5.0, 10 * self.interval))

    # --- waking, and a stop on request -----------------------------------------------------------

    def wake(self) -> None:
        """Wake the thread from its sleep for a round now."""
        self._round_due = True
        self._woken.set()

    def sleep(self) -> None:
        """Wait one interval, or until woken (wake()). A step begun meanwhile has its beat published at
        once, without the rest of a round (a store write per step, off the main thread), so that the
        last beat of a rank killed in a step names that step, not the one of the interval's last beat."""
        end = time.monotonic() + self.interval  # real time, as the event's wait
        while (left := end - time.monotonic()) > 0:
            self._woken.wait(left)
            self._woken.clear()
            if self._round_due:
                break
            if self._published_step != self._step:
                try:
                    self.publish()
                except Exception:  # the store is unreachable: the round finds out and says so
                    break
        self._round_due = False

    def stop_requested(self, signal_name: str) -> None:
        """A stop signal arrived (hybridpar.train.stop): the rank now finishes its step and saves. Said at
        once, so the monitor never takes what follows for a hang or a teardown."""
        if self.state in ("lost_peer", "failed"):  # a stop cannot complete without the lost rank
            return
        self.state = "stopping"
        self.note = f"stopping on {signal_name}"
        self.wake()

    # --- answering the monitor ------------------------------------------------------------------

    def answer_dump_request(self) -> None:
        if not self._dumped and self.has("dump"):
            self.dump_trace()

    def record_failure(self, error: BaseException) -> None:
        """What this rank saw when it raised, for the monitor and for hang-report: it is about to exit."""
        self.note = f"raised {type(error).__name__}: {traces.short_message(error)}"
        stack, group_name = traces.error_stack(error)
        try:
            self.dump_trace({"stack": stack, "failed_in": group_name})
        except Exception:
            pass

    def dump_trace(self, extra: Optional[dict] = None) -> None:
        """Send this rank's trace to the monitor and keep a flight-recorder dump on this node."""
        self._dumped = True
        info = {**self.info, "rank": self.rank, "world_size": self.world_size, "step": self.step,
                "phase": self.phase, "note": self.note, "stack": traces.python_stack(self._main_thread),
                **(extra or {})}
        try:
            dump = traces.dump_flight_recorder()
        except Exception as err:  # the recorder is off (TORCH_FR_BUFFER_SIZE=0): counts only
            dump = {"entries": [], "pg_status": {}}
            info["note"] = (info["note"] + "; " if info["note"] else "") + f"no flight recorder ({err})"
        info["p2p"] = self.p2p.snapshot()  # its sends and receives: torch's recorder has none on gloo
        dump["hybridpar"] = info
        trace = traces.trace_from_dump(dump, info)
        self.put(f"trace/{self.rank}", json.dumps(dataclasses.asdict(trace)))
        try:  # this node's own copy, for `hybridpar hang-report` later
            write_dump(self.trace_dir, self.rank, dump)
        except OSError:
            pass
