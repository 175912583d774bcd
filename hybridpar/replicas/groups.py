"""The replica groups of a fault-tolerant job (fault_tolerance.enabled), and the lone group of any
other job: the same hooks, so the trainer has no branch for either.

Each group is its own launcher world, its ranks pairing with the same ranks of the other groups in
torchft's managed process group (what parallel.dp_replicate's all-reduce is in a plain job). Every
step: the quorum (torchft's Manager, through the lighthouse: a group that is back is healed here from
a live group's model, optimizer, schedule and step), the groups' mean gradient in one all-reduce,
and the commit: a step some group failed in is not committed by the groups that saw it fail, and they
do it again from the same data. A quorum that does not form (the lighthouse gone) or forms with fewer
than fault_tolerance.min_groups groups is waited out, said, and not taken for a hang by the watchdog.

Each group reads its own share of the data (its dp ranks among groups x dp_size), and its position is
its own: the steps it took part in (`windows`, counted by every group from the all-reduce, so a
group that returns learns its own count from its peers). A group that was away continues where its
last committed step left it: no window of its share is skipped or read twice.

A start of the job (or of every group, resuming) takes its first step with every group: one still
setting up would otherwise find the others a step ahead and be healed to a step it never trained.
The stop ballots of a stop signal travel in the groups' all-reduce, so every group of the quorum stops
after the same step (the quorum's first group writes the checkpoint). A stop signal while the group
waits for a quorum ends the wait (QuorumStopped, quorum.py): the trainer saves the group's last
committed step if the group was the first of its last quorum.

The all-reduce also carries each group's own time from its quorum to its gradients (laggards.py): a
whole group slower than the others, which they all wait for, is named.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..compat.torch import default_store
from ..mesh.ranks import gather_objects, on_rank0
from ..parallel.float8_gather import precompute_float8_scales
from ..parallel.layers import local_tensor
from .check import check_groups
from .heal import group_state, load_group_state
from .laggards import Laggards, line as laggard_line
from .quorum import LighthouseUnreachable, QuorumStopped, join, nowhere, reach, unreachable, unwatched
from .record import Membership, WindowsRecord

log = logging.getLogger(__name__)

STORE_KEY = "hybridpar/replicas/store"  # in this start's store: where the group's torchft store listens


class LoneGroup:
    """A job that is one group: nothing to agree on, every step committed."""

    parts: dict = {}
    stopped = None  # (ReplicaGroups: the QuorumStopped it raised)

    def data_rank(self, parallel) -> tuple[int, int]:
        return parallel.dp_rank, parallel.dp_size

    def connect(self, *args, **kwargs) -> None:
        pass

    def begin_step(self, step: int) -> int:
        return step

    def average(self, params, ballot: Sequence[float] = ()) -> list[float]:
        return list(ballot)

    def commit(self) -> bool:
        return True

    def writes_checkpoints(self) -> bool:
        return True

    def row(self) -> dict:
        return {}

    def report(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


def make_replicas(config, stop=None):
    """ReplicaGroups for fault_tolerance.enabled, else the LoneGroup (`config`: the group's, preflight.group_config;
    `stop`: the supervisor's StopRequest, whose signal ends a wait for the quorum)."""
    ft = config.fault_tolerance
    if not ft.enabled:
        return LoneGroup()
    # The first step's wait for every group stays inside set-up's bound, which the watchdog keeps.
    d = config.diagnostics
    return ReplicaGroups(ft, config.train.grad_accum, check_every=d.replica_check_every,
                         start_wait=config.parallel.init_timeout / 2,
                         laggards=Laggards(ft.group, ft.groups, d.straggler_every, d.straggler_threshold), stop=stop,
                         record_to=Path(config.output.run_dir) / "windows.jsonl" if ft.record_windows else None)


def _reason(error) -> str:
    """A torchft error's first sentence, without gloo's source location."""
    if error is None:
        return "a group of its quorum failed in it"
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(error.original_exception).split()))
    return text.split(". ")[0][:160]


class ReplicaGroups:
    """check_every: diagnostics.replica_check_every (the groups' parameters are also compared after each
    change of the quorum); start_wait: seconds the first step waits for every group; record_to: where
    windows.jsonl goes (fault_tolerance.record_windows), None for no record; laggards: the judge of the
    groups' step times (None: no judging); stop: the supervisor's StopRequest (None: a wait is not stopped)."""

    def __init__(self, ft, grad_accum: int, *, check_every: int = 0, start_wait: float = 300.0,
                 record_to: Optional[Path] = None, laggards: Optional[Laggards] = None, stop=None) -> None:
        self.ft, self.grad_accum, self.check_every, self.start_wait = ft, grad_accum, check_every, start_wait
        self.windows = [0] * ft.groups  # steps each group's data went into, committed
        self.membership = Membership(ft.groups)  # the steps with fewer groups, the heals
        self.record = WindowsRecord(record_to) if record_to is not None else None
        self.step = 0
        self.manager = None
        self.metrics = None
        self.healed: Optional[dict] = None  # this step's heal: from which step, how long it took
        self._heal_row: dict = {}  # the step line's words of a heal, until a step is committed
        self._started = False  # the first quorum of this start is done
        self.at, self.waiting = nowhere, unwatched  # the supervisor's, from connect()
        self._quorum_id: Optional[int] = None  # the last quorum's (torchft's): a new one is a changed quorum
        self.laggards = laggards or Laggards(ft.group, ft.groups, 0, 2.0)
        self.stop, self.stopped = stop, None  # a stop signal ends a wait for the quorum: the QuorumStopped raised
        self.first = False  # the first group of the last quorum that formed: it writes the job's checkpoints
        self._lock = threading.Lock()  # a heal's load against a group leaving its wait (abandon)
        self._leaving = False
        self._began = time.perf_counter()  # when the step's own work began (the quorum done)
        self._waited = 0.0  # seconds the last all-reduce with the other groups took
        self._times: list[float] = []  # the groups' slots of laggards.py, from the last all-reduce

    @property
    def members(self) -> Optional[list[int]]:
        """The groups of the last committed step."""
        return self.membership.members

    @property
    def parts(self) -> dict:
        """What a checkpoint keeps of the groups (train_state.json): every group's position."""
        return {"replicas": self}

    def data_rank(self, parallel) -> tuple[int, int]:
        """This rank among every reader of the data: the group's dp ranks after the lower groups'."""
        return self.ft.group * parallel.dp_size + parallel.dp_rank, self.ft.groups * parallel.dp_size

    # --- a checkpoint's part ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"windows": list(self.windows), "groups": self.ft.groups}

    def load_state_dict(self, state: dict) -> None:
        if state.get("groups", self.ft.groups) != self.ft.groups or len(state["windows"]) != self.ft.groups:
            raise ValueError(f"the checkpoint was written by {len(state['windows'])} replica groups and this job has "
                             f"{self.ft.groups}: resume with fault_tolerance.groups = {len(state['windows'])}")
        self.windows = [int(w) for w in state["windows"]]
        if self.manager is None:  # restore() comes before connect(): the loader is positioned there
            return
        self._seek()

    def _seek(self) -> None:
        self.loader.seek(self.windows[self.ft.group] * self.grad_accum)

    # --- set-up ----------------------------------------------------------------------------------

    def connect(self, parallel, modules, optimizer, scheduler, loader, *, step: int, metrics, at, waiting) -> None:
        """Join the job's groups: torchft's Manager for this rank, at `step` (0, or the checkpoint's).
        at(phase, step=): where the supervisor is told this rank waits for the quorum; waiting(what): the
        supervisor's context around that wait, which is not a hang (Supervisor.waiting). LighthouseUnreachable
        on every rank when the lighthouse does not answer within fault_tolerance.timeout."""
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log: every quorum and commit at its default
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        # torchft's Python log says each step's quorum and commit, and warns that gloo has no NCCL flight
        # recorder to reset; its exceptions are said in one line by commit(), not as torchft's tracebacks.
        for name, level in (("torchft", logging.CRITICAL), ("torchft_quorums", logging.WARNING),
                            ("torchft_commits", logging.WARNING), ("torchft_errors", logging.WARNING)):
            logging.getLogger(name).setLevel(level)

        self.modules, self.optimizer, self.scheduler, self.loader = modules, optimizer, scheduler, loader
        self.metrics, self.step, self.at, self.waiting = metrics, step, at, waiting
        self._seek()  # this group's own place in the data, whatever the checkpoint's loader said
        timeout = timedelta(seconds=self.ft.timeout)
        host, port = self._group_store()
        pg = (ProcessGroupNCCL if parallel.device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
        # torchft connects to the lighthouse first and fails with its traceback on rank 0 alone (the
        # others wait for it): rank 0 tries first, and every rank says the same line if it does not answer.
        at("set-up: the lighthouse")
        on_rank0(lambda: reach(self.ft, self.ft.group, self.ft.timeout), "reach the lighthouse",
                 error_type=LighthouseUnreachable)
        try:
            self.manager = self._manager(Manager, pg, timeout, host, port, step)
        except RuntimeError as err:  # gone since: rank 0 says it (the others are ended by the launcher)
            if f"failed to connect to {self.ft.address()}" not in str(err):
                raise
            why = str(err).rsplit(": ", 1)[-1]
            raise LighthouseUnreachable(unreachable(self.ft, self.ft.group, why, self.ft.timeout)) from None

    def _manager(self, Manager, pg, timeout: timedelta, host: str, port: int, step: int):  # noqa: N803 (torchft's class)
        from .transport import WeightsOnlyTransport

        manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=self.ft.min_groups,
            # A try at the quorum may wait the lighthouse's join timeout for a hung group (keep it below 2 x timeout).
            use_async_quorum=False, timeout=timeout, quorum_timeout=2 * timeout, connect_timeout=timeout,
            rank=dist.get_rank(), world_size=dist.get_world_size(), store_addr=host, store_port=port,
            lighthouse_addr=self.ft.address(), replica_id=f"hybridpar_group_{self.ft.group}",
            checkpoint_transport=WeightsOnlyTransport(timeout=timeout, num_chunks=0),
            init_sync=False)  # every group builds the same weights from the same seed
        manager.load_state_dict({"step": step, "batches_committed": 0})
        return manager

    def _group_store(self) -> tuple[str, int]:
        """A store of this start for torchft's keys (the launcher's keeps a dead attempt's), on rank 0's
        host at a port the kernel chose, told to the group through this start's own store."""
        store = default_store()
        if dist.get_rank() == 0:
            self._server = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            store.set(STORE_KEY, f"{socket.gethostname()}:{self._server.port}")
        host, _, port = store.get(STORE_KEY).decode().rpartition(":")
        return host, int(port)

    # --- what a group that returns receives ------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for m in self.modules for p in m.parameters()]

    def _state(self) -> dict:
        return group_state(self._params(), self.optimizer, self.scheduler, self.step, self.windows)

    def _load(self, state: dict) -> None:
        with self._lock:  # whole or not at all: a group leaving its wait (abandon) saves what it holds
            if self._leaving:
                raise QuorumStopped(self.stop.signal_name, self.step, "a heal that came after the stop signal",
                                    self.ft.group)
            self._load_state(state)

    def _load_state(self, state: dict) -> None:
        was = self.step
        self.step, self.windows = load_group_state(state, self._params(), self.optimizer, self.scheduler)
        self._seek()
        precompute_float8_scales(self.modules)  # new weights: new float8 scales for the all-gathers (if any)
        # seconds: the quorum, the transfer from the live group and this load together
        self.healed = {"from_step": was, "to_step": self.step, "seconds": round(time.perf_counter() - self._asked, 3)}

    # --- every step ------------------------------------------------------------------------------

    def begin_step(self, step: int) -> int:
        """The quorum for the next step; a group behind the others is healed here. The step to train."""
        self.step, self.healed = step, None
        self.at("replica quorum", step=step + 1)
        self._before = self.loader.state_dict()
        self._asked = time.perf_counter()
        with self.waiting(f"the quorum of the replica groups before step {step + 1}") as say:
            join(self, say)
            if not self._started:
                self._wait_for_every_group(say)
        if self.healed is not None and dist.get_rank() == 0:
            log.info(f"hybridpar: replica group {self.ft.group} healed from a live group at step {self.step} "
                     f"(it was at step {self.healed['from_step']}) in {self.healed['seconds']:.1f} s")
        if self.healed is not None:
            self.metrics.continue_from(self.step)  # its log before it was away is kept
            self.metrics.event(self.step, "healed", group=self.ft.group, **self.healed)
            self.membership.heals.append({"step": self.step, "from_step": self.healed["from_step"],
                                          "seconds": self.healed["seconds"]})
            self._heal_row = {"healed_from": self.healed["from_step"], "heal_s": self.healed["seconds"]}
        self._check_groups()
        if self.record is not None:
            self.loader.record = []  # the loader notes each micro-batch's windows from here
        self._began = time.perf_counter()
        return self.step

    def formed(self) -> None:
        """A quorum formed (with enough groups or not): is this group its first, the one that writes?"""
        self.first = self.manager.participating_rank() == 0

    def abandon(self) -> None:
        """A stop signal ended this rank's wait for a try at the quorum that goes on in torchft's thread: a
        heal it brings later is not loaded (one loading now completes first), so what is saved is whole."""
        with self._lock:
            self._leaving = True

    def _wait_for_every_group(self, say) -> None:
        """The first quorum of this start: unless it healed this group, wait (start_wait at most) until
        every group is in it. The group's ranks decide together: all wait, or none; a stop signal ends
        the wait (QuorumStopped)."""
        self._started = True
        waited, said = time.monotonic(), False
        while all(gather_objects(self.healed is None and self.manager.errored() is None
                                          and self.manager.num_participants() < self.ft.groups
                                          and time.monotonic() - waited < self.start_wait
                                          and (self.stop is None or not self.stop.requested))):
            if not said and dist.get_rank() == 0:
                log.info(f"hybridpar: replica group {self.ft.group} waits for every group before its first step "
                         f"({self.manager.num_participants()} of {self.ft.groups} there; {self.start_wait:.0f} s "
                         "at most, then it starts with those there)")
                said = True
            self.at("replica quorum: waiting for every group", step=self.step + 1)
            time.sleep(1.0)
            self._asked = time.perf_counter()
            join(self, say)
        # A stop signal ended the wait (every rank of a quorum of all groups trains the step, then stops).
        signals = gather_objects(self.stop.signal_name if self.stop is not None else "")
        if any(signals) and self.healed is None and self.manager.num_participants() < self.ft.groups:
            self.stopped = QuorumStopped(next(s for s in signals if s), self.step, f"{self.manager.num_participants()} "
                                         f"of {self.ft.groups} groups there before its first step", self.ft.group)
            raise self.stopped

    def _check_groups(self) -> None:
        """The replica check across groups (check.py) after a change of the quorum and every check_every steps."""
        quorum = self.manager._quorum_id  # torchft's: one for every group of a quorum, a new one when it changes
        # Agreed by the group's ranks: each rank's manager may see another quorum id (tries at the quorum
        # differ per rank, and a restarted lighthouse numbers them afresh); a check made by some ranks
        # only would run its collectives against the others' step (a hang, or mixed all-reduces).
        changed, self._quorum_id = any(gather_objects(quorum != self._quorum_id)), quorum
        if not (changed or (self.check_every and (self.step + 1) % self.check_every == 0)):
            return
        self.at("replica check across groups", step=self.step + 1)
        found = check_groups(self.manager, self.modules, group=self.ft.group, groups=self.ft.groups,
                             healed=self.healed is not None, step=self.step + 1)
        if found is None:  # the all-reduce failed: the step is not committed
            return
        if found["differ"] and dist.get_rank() == 0:
            log.warning(f"hybridpar: {found['text']}; the group(s) {sorted(found['differ'])} leave the job to be "
                        "healed again")
        if changed or found["differ"]:
            self.metrics.event(self.step + 1, "replica_check", groups=found["groups"], healed=found["healed"],
                               differ=found["differ"])

    def average(self, params, ballot: Sequence[float] = ()) -> list[float]:
        """The mean of the groups' gradients, which groups took part, and the sum of the stop ballots of
        this rank and the same rank of every other group (stop.py): one all-reduce. Every group of the
        quorum reads the same sum, so all stop after the same step. The groups' step times travel in it
        too (laggards.py). The sums of the ballots, or this rank's own ballot when the all-reduce failed."""
        own = time.perf_counter() - self._began
        if self.record is not None and dist.get_rank() == 0:  # before the all-reduce: a group killed in it
            self.record.write(step=self.step + 1, read=self._share(self.loader.record))  # may count in the others
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        member = [0.0] * self.ft.groups
        member[self.ft.group] = 1.0
        # [which groups took part, the stop ballots, the groups' own seconds of the step, their last waits]
        tail = torch.tensor(member + list(ballot) + self.laggards.tail(own, self._waited), dtype=torch.float32,
                            device=grads[0].device if grads else None)
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads] + [tail])
        # A wait for the other groups, not a collective of this one: ended by fault_tolerance.timeout if one is silent.
        began = time.perf_counter()
        with self.waiting(f"the other replica groups' gradients of step {self.step + 1}"):
            self.manager.allreduce(flat).wait()  # an error is torchft's: the step is then not committed
        self._waited = time.perf_counter() - began
        summed = (flat[flat.numel() - tail.numel():] * self.manager.num_participants()).tolist()
        self._members = [g for g, share in enumerate(summed[:self.ft.groups]) if share > 0.5]
        self._times = summed[self.ft.groups + len(ballot):]
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        if self.manager.errored() is not None:
            return list(ballot)
        return [float(round(v)) for v in summed[self.ft.groups:self.ft.groups + len(ballot)]]

    def _share(self, batches: list) -> list:
        """This group's (source, window) pairs of micro-batches of the whole job (every group's readers)."""
        readers = self.loader.dp_size
        per_group = readers // self.ft.groups
        return [[s, w] for pairs in batches for i, (s, w) in enumerate(pairs)
                if i % readers // per_group == self.ft.group]

    def commit(self) -> bool:
        """Whether every group of this one's quorum finished the step; if not, its data is read again."""
        if not self.manager.should_commit():
            self.loader.load_state_dict(self._before)
            if dist.get_rank() == 0:
                log.warning(f"hybridpar: step {self.step + 1} not committed by replica group {self.ft.group} "
                            f"({_reason(self.manager.errored())}); it is done again from the same data")
            return False
        for g in self._members:
            self.windows[g] += 1
        step, was = self.step + 1, self.members
        event = self.membership.committed(step, self._members)
        if event is not None:
            if dist.get_rank() == 0:
                log.warning(f"hybridpar: step {step} committed by replica group(s) {self._members} of "
                            f"{self.ft.groups}" + (f" (was {was})" if was is not None else ""))
            self.metrics.event(step, "groups", **event)
        if self.record is not None and dist.get_rank() == 0:
            self.record.write(step=step, committed=self._members)
        found = self.laggards.add(step, self._members, self._times)
        if found is not None:
            if dist.get_rank() == 0:
                log.warning(laggard_line(found))
            self.metrics.event(step, "straggler_group", **{k: v for k, v in found.items() if k != "step"})
        return True

    def writes_checkpoints(self) -> bool:
        """The first group of the last quorum that formed writes the job's checkpoints; the others keep
        training (a group stopped while waiting for a quorum: of the last one it was in)."""
        return self.first

    def row(self) -> dict:
        """The step's numbers: the groups that committed it, and a heal before it (the step line says it)."""
        healed, self._heal_row = self._heal_row, {}
        return {"groups": len(self.members or ()), **healed}

    def report(self) -> dict:
        """summary.json's "replica_groups" (the summary's rows: record.summary_lines)."""
        return self.membership.report(self.ft.group, self.windows)

    def close(self) -> None:
        if self.record is not None:
            self.record.close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
