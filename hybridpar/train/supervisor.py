"""One owner of everything that watches a run: the hang watchdog, the timeouts, the straggler
monitor, the data guard, the replica check and the stop signals.

The trainer tells it where it is (`phase`), that a step ran (`step`, around it), that a checkpoint
is written (`checkpointing`) and how the run ended (`close`); the lifecycle in between is
`open()` before the process group is made, `start(parallel)` once the mesh exists,
`set_up(start_step, model)` when set-up is done and `running()` when run() begins; `close()` undoes
what open() and running() did to the process (`with Supervisor(config) as s:` is open() and close()).

One watchdog watches set-up and run alike: its keys in the job's store are the same throughout, so
a verdict given while one rank still sets up and another already trains reaches both. Between
set-up and run it pauses (its last beat says so): a Trainer built and never run leaves no thread.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from .. import incidents
from ..checkpoint.dcp import latest_checkpoint
from ..config import Config
from ..diagnostics.data_guard import check_data, step_fingerprint
from ..diagnostics.monitor import save_report, verdict_time
from ..diagnostics.node_fault import place, then as node_fault_then
from ..diagnostics.replicas import check_replicas
from ..diagnostics.stragglers import StragglerMonitor
from ..diagnostics.timeouts import Deadlines, apply_env_defaults, restore_env
from ..diagnostics.watchdog import Watchdog
from ..mesh.device import ParallelDims
from ..mesh.ranks import gather_objects
from . import stop as stopping

log = logging.getLogger(__name__)


class Supervisor:
    """Made (with no effect on the process) and opened before the process group: open() sets the
    tracing variables torch reads when a group is made (a group made earlier by the caller gets them
    only in part), and a stop signal from then on ends the run at a step boundary with a checkpoint
    (stop.py). close() unsets those variables and gives the signals back to their previous handlers."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.run_dir = Path(config.output.run_dir)
        self.trace_dir = self.run_dir / "flight_recorder"
        self.env_set: Optional[dict[str, str]] = None  # the variables open() set, while open
        self._running = ExitStack()  # what running() entered until close(): the straggler monitor
        self.parallel: Optional[ParallelDims] = None
        self.watchdog: Optional[Watchdog] = None
        self.deadlines: Optional[Deadlines] = None
        self.stragglers: Optional[StragglerMonitor] = None
        # rank -> why it computes more (its experts are hot: hybridpar.train.experts), or None
        self.hot_experts: Optional[Callable[[int], Optional[str]]] = None
        self.model: Union[torch.nn.Module, Sequence[torch.nn.Module], None] = None  # or the stage modules
        self.stages: Optional[Sequence[int]] = None  # their stage ids
        self.places: Optional[list] = None  # every rank's (host, node), once the mesh exists
        self.start_step = 0
        self.stop = stopping.StopRequest(config.checkpoint.exit_save_timeout, on_signal=self._on_stop_signal,
                                         on_expire=self._on_stop_expired)

    # --- the lifecycle --------------------------------------------------------------------------

    def open(self) -> "Supervisor":
        """Before the process group is made: the tracing variables the user has not set, and the stop
        signals caught (again, after set_up gave them back)."""
        if self.env_set is None:
            self.env_set = apply_env_defaults(self.trace_dir)
        self.stop.install()
        return self

    def __enter__(self) -> "Supervisor":
        return self.open()

    def __exit__(self, kind, error, traceback) -> None:
        self.close(error)

    def start(self, parallel: ParallelDims) -> None:
        """The mesh exists: from here on a rank that dies or hangs is reported, set-up included."""
        self.parallel = parallel
        if self.config.diagnostics.watchdog:
            self.watchdog = self._watch(self.config.parallel.init_timeout, 0, "set-up")
        # Every rank's (host, node), once: the straggler report names them, and a rank that finds the
        # store's host frozen names its node (known to every rank before anything can freeze).
        self.places = gather_objects(place())
        if self.watchdog is not None:
            self.watchdog.beat.nodes = {r: node for r, (_, node) in enumerate(self.places)}

    @property
    def group(self) -> Optional[int]:
        """A fault-tolerant job's replica group (fault_tolerance.group): named in every verdict."""
        ft = self.config.fault_tolerance
        return ft.group if ft.enabled else None

    def _watch(self, timeout: float, step: int, phase: str) -> Watchdog:
        watchdog = Watchdog(self.parallel, timeout=timeout, run_dir=self.run_dir, trace_dir=self.trace_dir,
                            interval=self.config.diagnostics.watchdog_interval, group=self.group)
        watchdog.step, watchdog.phase = step, phase
        watchdog.monitor.hot = self._hot
        return watchdog.start()

    def _hot(self, rank: int) -> Optional[str]:
        """Why `rank` computes more, if it holds the last step's hot experts (hot_experts, set by the trainer's
        expert balance once the supervisor is made); for the verdicts."""
        return self.hot_experts(rank) if self.hot_experts is not None else None

    def set_up(self, start_step: int, model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
               stages: Optional[Sequence[int]] = None) -> None:
        """Set-up is done; the run starts (or resumes) at `start_step`. `model`: the model, or this
        rank's stage modules, `stages` their stage ids (the step runner's modules and stage_ids,
        hybridpar.pipeline.runner). Until running(), the watchdog pauses and the signals are left alone."""
        self.start_step, self.model, self.stages = start_step, model, stages
        self.deadlines = Deadlines(self.config.parallel.init_timeout, self.config.diagnostics.train_timeout,
                                   self.parallel, start_step)
        self.stop.uninstall()
        if self.watchdog is not None:
            self.watchdog.pause()

    def running(self, step: int) -> None:
        """run() begins at `step`: the stop signals and the watchdog again (set-up's, resumed; a new
        one for a Trainer run once more), and the straggler monitor."""
        self.open()  # a Trainer run once more: closed after its first run
        d, watchdog, limit = self.config.diagnostics, self.watchdog, self.deadlines.no_progress_limit()
        if not d.watchdog:
            self.watchdog = None
        elif watchdog is not None and watchdog.paused:
            watchdog.step, watchdog.phase = step, "start"
            watchdog.arm(limit)
            watchdog.start()
        else:
            self.watchdog = self._watch(limit, step, "start")
        self.deadlines.watched = self.watchdog is not None
        if self.watchdog is not None and self.stop.requested:  # during set-up
            self.watchdog.stop_requested(self.stop.signal_name)
        self.stragglers = StragglerMonitor(self.parallel, d.straggler_every, d.straggler_threshold, step,
                                           exclude=d.straggler_exclude, exclude_reports=d.straggler_exclude_reports,
                                           places=self.places, group=self.group, hot=self.hot_experts)
        self._running.enter_context(self.stragglers)  # collectives timed on measured steps; torch's own back at close

    def close(self, error: Optional[BaseException] = None) -> None:
        """Set-up failed, or run() ended (`error`: what it raised). The watchdog first: a rank whose
        peer died waits in its close() for the verdict, and the launcher's SIGTERM must not end it
        meanwhile (the stop's handlers are still in place). Then the signals' previous handlers and
        the environment as open() found it."""
        self._running.close()
        self.stragglers = None
        if self.watchdog is not None:
            self.watchdog.close(error)
        self.stop.finish()
        self.stop.uninstall()
        if self.env_set is not None:
            restore_env(self.env_set)
            self.env_set = None

    # --- what the trainer tells it --------------------------------------------------------------

    def phase(self, name: str, *, step: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """Where this rank is (cheap: a few attribute writes); `step`: the step in progress;
        `timeout`: the watchdog's new no-progress limit."""
        if self.watchdog is not None:
            if step is not None:
                self.watchdog.step = step
            self.watchdog.phase = name
            if timeout is not None:
                self.watchdog.arm(timeout)

    def guard(self, step: int, batches) -> float:
        """The data guard on step `step`'s batches when due (this run's first step, resumed or not, and
        every N steps if configured); its seconds."""
        d = self.config.diagnostics
        first = step == self.start_step + 1  # a resume at another layout is when the data can go wrong
        if not d.data_guard or not (first or (d.data_guard_every and step % d.data_guard_every == 0)):
            return 0.0
        began = time.perf_counter()
        check_data(step_fingerprint(batches), self.parallel, step)
        return time.perf_counter() - began

    @contextmanager
    def step(self, step: int) -> Iterator[dict]:
        """Around training step `step` (which ends with the device synchronised): timed for the
        straggler report, then the step's checks. Yields a dict that holds, afterwards, the straggler
        report's metrics when one was due."""
        found: dict = {}
        timing = self.stragglers.timing(step) if self.stragglers is not None else _nothing()
        with timing:
            yield found
        limit = self.deadlines.step_done(step)
        if limit is not None:  # the first step of this run ended start-up: a long wait is now a hang
            self.phase("first step done", timeout=limit)
            self._training_again(step)
        every = self.config.diagnostics.replica_check_every
        if every and step % every == 0:
            check_replicas(self.model, self.parallel, step, stages=self.stages)
        if self.stragglers is not None:
            if self.stragglers.due(step):
                self.phase("straggler report")
            found.update(self.stragglers.report(step) or {})

    @property
    def excluding(self) -> Optional[dict]:
        """A straggler so slow for so long that its node should go (every rank agrees): the run saves
        and stops, and straggler_stop() names the node."""
        return self.stragglers.excluding if self.stragglers is not None else None

    @property
    def exit_code(self) -> int:
        """The exit status of a run that ended: 0, or 1 for a replica group stopped to leave a straggling node
        (its launcher restarts it; a group that ends with 0 has finished, for launch/slurm.sh --ft)."""
        return int(self.config.fault_tolerance.enabled and self.excluding is not None)

    def say_stopped(self, step: int, checkpoint: Optional[Path], signal_name: str, *, waited=None,
                    writes: bool = True) -> None:
        """Rank 0, once a stop has saved: the straggler's verdict, or stopped.json (launch/slurm.sh requeues
        on it) and the stop's line; `waited`: a replica group's QuorumStopped, `writes`: whether it writes."""
        if self.excluding is not None:
            self.straggler_stop(step, checkpoint)
            return
        stopping.write_marker(self.run_dir, signal_name, step, checkpoint)
        log.info(waited.line(checkpoint, writes) if waited is not None else
                 stopping.stopped_line(signal_name, step, checkpoint, self.config.checkpoint.resume))

    def straggler_stop(self, step: int, checkpoint: Optional[Path]) -> None:
        """Rank 0, once the checkpoint is written: the verdict for launch/slurm.sh, and one line."""
        x = self.excluding
        group = f"replica group {x['group']}, " if "group" in x else ""
        # A replica group exits as failed (Trainer.exit_code): one that ends 0 has finished its training.
        node = x["node"]
        then = (f"; {node_fault_then(x['group'])}; to leave node {node} out now, resubmit with --exclude {node}"
                if "group" in x else
                f" so that node {node} can be left out (launch/slurm.sh excludes it and requeues the job)")
        line = (f"hybridpar: rank {x['rank']} ({group}node {x['node']}, host {x['host']}) computed {x['ratio']}x the "
                f"others' median in {x['reports']} straggler reports in a row (diagnostics.straggler_exclude = "
                f"{self.config.diagnostics.straggler_exclude}); saved step {step} ({checkpoint}) and stopped{then}")
        fault = {"kind": "straggler", "nodes": [x["node"]], "ranks": [x["rank"]]}
        save_report(self.run_dir, None, {"reason": line, "step": step, "node_fault": fault, **verdict_time(0.0),
                                         "straggler": x, "checkpoint": str(checkpoint)})
        log.info(line)

    @contextmanager
    def checkpointing(self, name: str = "checkpoint", done: str = "checkpointed") -> Iterator[None]:
        """Around a checkpoint's writes, or other long work that every rank does together (phase `name`,
        then `done`: a downstream evaluation): not a hang however long (Deadlines.checkpointing)."""
        self.phase(name, timeout=self.deadlines.init_timeout)
        with self.deadlines.checkpointing():
            yield
        self.phase(done, timeout=self.deadlines.no_progress_limit())

    @contextmanager
    def waiting(self, what: str) -> Iterator[Callable[[str], None]]:
        """Around a wait for something outside this job's ranks, the replica groups' quorum (`what`):
        not a hang however long, unlike a collective inside the job; said once it has lasted longer
        than diagnostics.train_timeout (Watchdog.waiting). Yields a function that says what it waits
        for now."""
        if self.watchdog is None:
            yield lambda note: None
            return
        with self.watchdog.waiting(what) as say:
            yield say

    def _training_again(self, step: int) -> None:
        """Rank 0, after this run's first step: the run's incidents (launch/slurm.sh's) say when
        training went on after the last fault."""
        path = os.environ.get(incidents.INCIDENTS_ENV)
        if not path or self.parallel is None or self.parallel.rank != 0:
            return
        try:
            incidents.training_again(Path(path), step=step, resumed_from=self.start_step,
                                     job=os.environ.get("SLURM_JOB_ID", ""), nodes=os.environ.get("SLURM_JOB_NODELIST", ""))
        except OSError as err:  # a record, not a reason to stop training
            log.warning(f"hybridpar: could not note in {path}: {err}")

    # --- a stop on request (stop.py) ------------------------------------------------------------

    def _on_stop_signal(self, signal_name: str) -> None:
        """The first stop signal (from the listener thread): the watchdog says so at once."""
        if self.watchdog is not None:
            self.watchdog.stop_requested(signal_name)

    def _on_stop_expired(self, stop: stopping.StopRequest) -> None:
        """The stop did not finish in time (a hung collective, a slow save): leave without a new
        checkpoint; saves are staged, so the previous one is intact."""
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.stopped()  # an exit on purpose, not a death
        main = self.parallel.rank == 0 if self.parallel is not None else os.environ.get("RANK", "0") == "0"
        if main:
            previous = latest_checkpoint(self.config.checkpoint_dir())  # from disk: set-up may not have read it
            where = f"in step {watchdog.step}, {watchdog.phase}" if watchdog is not None else "in set-up"
            log.error(stopping.expired_line(stop, where, previous))
        os._exit(128 + stop.signum)


@contextmanager
def _nothing() -> Iterator[None]:
    yield
