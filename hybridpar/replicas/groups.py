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
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import urllib.request
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat.torch import default_store
from ..parallel.float8_gather import precompute_float8_scales

log = logging.getLogger(__name__)

STORE_KEY = "hybridpar/replicas/store"  # in this start's store: where the group's torchft store listens
RETRY_S = 1.0  # seconds between tries at a quorum that did not form, or formed with too few groups


class LoneGroup:
    """A job that is one group: nothing to agree on, every step committed."""

    parts: dict = {}

    def data_rank(self, parallel) -> tuple[int, int]:
        return parallel.dp_rank, parallel.dp_size

    def connect(self, *args, **kwargs) -> None:
        pass

    def begin_step(self, step: int) -> int:
        return step

    def average(self, params) -> None:
        pass

    def commit(self) -> bool:
        return True

    def writes_checkpoints(self) -> bool:
        return True

    def row(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class GroupOutOfStep(RuntimeError):
    """A group's ranks came out of the quorum at different steps: this group's failure."""


def make_replicas(ft, grad_accum: int):
    """ReplicaGroups for fault_tolerance.enabled, else the LoneGroup."""
    return ReplicaGroups(ft, grad_accum) if ft.enabled else LoneGroup()


def _reason(error) -> str:
    """A torchft error's first sentence, without gloo's source location."""
    if error is None:
        return "a group of its quorum failed in it"
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(error.original_exception).split()))
    return text.split(". ")[0][:160]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _plain(tree):
    """A state dict's DTensors as their local shards: what a peer at the same rank holds."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return _local(tree).detach() if isinstance(tree, torch.Tensor) else tree


class ReplicaGroups:
    def __init__(self, ft, grad_accum: int) -> None:
        self.ft, self.grad_accum = ft, grad_accum
        self.windows = [0] * ft.groups  # steps each group's data went into, committed
        self.members: Optional[list[int]] = None  # the groups of the last committed step
        self.step = 0
        self.manager = None
        self.metrics = None
        self.healed: Optional[dict] = None  # this start's heal: from which step, how long it took
        self.fewer_since: Optional[float] = None  # when the groups last became fewer
        self.fewer_steps = 0  # steps committed with fewer groups than the job has
        self.first: Optional[float] = None  # a group starting at step 0: when it first asked for the quorum

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
        supervisor's context around that wait, which is not a hang (Supervisor.waiting)."""
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log: every quorum and commit at its default
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from .transport import WeightsOnlyTransport

        # torchft's Python log says each step's quorum and commit, and warns that gloo has no NCCL flight
        # recorder to reset; its exceptions are said in one line by commit(), not as torchft's tracebacks.
        for name, level in (("torchft", logging.CRITICAL), ("torchft_quorums", logging.WARNING),
                            ("torchft_commits", logging.WARNING), ("torchft_errors", logging.WARNING)):
            logging.getLogger(name).setLevel(level)

        self.modules, self.optimizer, self.scheduler, self.loader = modules, optimizer, scheduler, loader
        self.device = parallel.device
        self.metrics, self.step, self.at, self.waiting = metrics, step, at, waiting
        self.first = 0.0 if step == 0 else None
        self._seek()  # this group's own place in the data, whatever the checkpoint's loader said
        timeout = timedelta(seconds=self.ft.timeout)
        host, port = self._group_store()
        pg = (ProcessGroupNCCL if parallel.device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=self.ft.min_groups,
            # A try at the quorum may wait the lighthouse's join timeout for a hung group (keep it below 2 x timeout).
            use_async_quorum=False, timeout=timeout, quorum_timeout=2 * timeout, connect_timeout=timeout,
            rank=dist.get_rank(), world_size=dist.get_world_size(), store_addr=host, store_port=port,
            lighthouse_addr=self.ft.address(), replica_id=f"hybridpar_group_{self.ft.group}",
            checkpoint_transport=WeightsOnlyTransport(timeout=timeout, num_chunks=0),
            init_sync=False)  # every group builds the same weights from the same seed
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

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
        return {"model": [_local(p).detach() for p in self._params()], "optimizer": _plain(self.optimizer.state_dict()),
                "scheduler": self.scheduler.state_dict(), "step": self.step, "windows": list(self.windows)}

    def _load(self, state: dict) -> None:
        was = self.step
        params = self._params()
        with torch.no_grad():
            for p, value in zip(params, state["model"], strict=True):
                _local(p).copy_(value)
        optimizer = state["optimizer"]
        ordered = [p for group in self.optimizer.param_groups for p in group["params"]]  # the state's numbering
        for index, entry in optimizer["state"].items():  # each state tensor shaped as its parameter: sharded alike
            p = ordered[int(index)]
            if isinstance(p, DTensor):
                optimizer["state"][index] = {
                    k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride()) if v.shape == _local(p).shape and v.dim() else v
                    for k, v in entry.items()}
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.windows, self.step = [int(w) for w in state["windows"]], int(state["step"])
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
            self._join(say)
        if self.healed is not None and dist.get_rank() == 0:
            log.info(f"hybridpar: replica group {self.ft.group} healed from a live group at step {self.step} "
                     f"(it was at step {self.healed['from_step']}) in {self.healed['seconds']:.1f} s")
        if self.healed is not None:
            self.metrics.continue_from(self.step)  # its log before it was away is kept
            self.metrics.event(self.step, "healed", group=self.ft.group, **self.healed)
        return self.step

    def _join(self, say) -> None:
        """Ask for the quorum until one of fault_tolerance.min_groups groups or more forms: one that does
        not form in torchft's quorum timeout (the lighthouse gone, fewer groups than its --min-groups),
        or forms with fewer groups, is waited out, said once per reason (rank 0) and in the heartbeat's
        note (say), for the watchdog's line if the wait outlasts its limit."""
        began, said = time.monotonic(), None
        while (why := self._agreed(self._quorum())) is not None:
            say(f"the quorum of the replica groups before step {self.step + 1} ({why})")
            if why != said and dist.get_rank() == 0:
                log.warning(f"hybridpar: replica group {self.ft.group} waits for the quorum before step "
                            f"{self.step + 1}: {why}; it trains on when the quorum forms")
            said = why
            time.sleep(RETRY_S)
        if said is not None and dist.get_rank() == 0:
            log.warning(f"hybridpar: replica group {self.ft.group} is in a quorum of {self.manager.num_participants()} "
                        f"group(s) after waiting {time.monotonic() - began:.1f} s; it trains step {self.step + 1}")

    def _agreed(self, why: Optional[str]) -> Optional[str]:
        """Whether every rank of this group got the quorum, and at the same step (one all-reduce). If one
        missed it, all ask again together: torchft's manager answers a group's ranks together, and a
        rank that asked again alone would wait there for the others, gone on to train, until its quorum
        timeout. Ranks at different steps were healed in part (the live peer of some failed meanwhile):
        GroupOutOfStep, so that the group's launcher restarts it to be healed whole."""
        votes = torch.tensor([float(why is not None), self.step, -self.step], dtype=torch.float64, device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        missed, highest, lowest = votes[0].item(), int(votes[1].item()), -int(votes[2].item())
        if missed:
            return why or "another rank of this group missed it"
        if highest != lowest:
            raise GroupOutOfStep(f"replica group {self.ft.group}: its ranks left the quorum at steps {lowest} and "
                                 f"{highest}, a heal from a live group reached some of them only (that group failed "
                                 "meanwhile); the group stops so that its launcher restarts it to be healed again")
        return None

    def _quorum(self) -> Optional[str]:
        """One try at the quorum: None when it formed with enough groups, else why not."""
        try:
            self.manager.start_quorum()
        except Exception as err:
            future = self.manager._quorum_future
            if future is None or not future.done() or future.exception() is not err:
                raise  # not the quorum's own failure (a heal's state that does not load is a bug to see)
            # torchft 0.2 keeps a failed quorum's future and raises its error again at every start_quorum.
            self.manager._quorum_future = None
            return self._no_quorum()
        found = self.manager.num_participants()
        if found < self.ft.min_groups:
            return f"{found} group(s) in it, fewer than fault_tolerance.min_groups = {self.ft.min_groups}"
        if self.first is not None and found < self.ft.groups:
            # The job's groups start together: one that began alone would heal the others as they come.
            self.first = self.first or time.monotonic()
            if time.monotonic() - self.first < 2 * self.ft.timeout:
                return (f"{found} group(s) of {self.ft.groups} in it; the first step waits up to "
                        f"{2 * self.ft.timeout:g} s for every group")
        self.first = None
        return None

    def _no_quorum(self) -> str:
        """Why no quorum formed in torchft's quorum timeout: the lighthouse does not answer, or what its
        status says it waits for."""
        address = self.ft.address()
        try:
            with urllib.request.urlopen(f"{address}/status", timeout=self.ft.timeout) as f:
                status = f.read().decode(errors="replace")
        except OSError as err:
            reason = re.sub(r"^\[Errno \d+\]\s*", "", str(getattr(err, "reason", err)))
            return f"the lighthouse at {address} does not answer: {reason}"
        found = re.search(r"Next quorum status:\s*([^<\[]+)", status)
        said = f"; the lighthouse: {found.group(1).strip()}" if found else ""
        return f"no quorum in {2 * self.ft.timeout:g} s{said}"

    def average(self, params) -> None:
        """The mean of the groups' gradients, and which groups took part: one all-reduce."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        mine = torch.zeros(self.ft.groups, dtype=torch.float32, device=grads[0].device if grads else None)
        mine[self.ft.group] = 1.0
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads] + [mine])
        # A wait for the other groups, not a collective of this one: ended by fault_tolerance.timeout if one is silent.
        with self.waiting(f"the other replica groups' gradients of step {self.step + 1}"):
            self.manager.allreduce(flat).wait()  # an error is torchft's: the step is then not committed
        took_part = (flat[-self.ft.groups:] * self.manager.num_participants()).tolist()
        self._members = [g for g, share in enumerate(took_part) if share > 0.5]
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

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
        if self._members != self.members:
            self._changed(self._members)
        if len(self._members) < self.ft.groups:
            self.fewer_steps += 1
        return True

    def _changed(self, members: list[int]) -> None:
        step, was = self.step + 1, self.members
        self.members = members
        if was is None and len(members) == self.ft.groups:  # the first step, every group there: nothing to say
            return
        event = {"groups": members, "was": was}
        if len(members) < len(was or range(self.ft.groups)):
            self.fewer_since = self.fewer_since or time.monotonic()
        elif len(members) == self.ft.groups and self.fewer_since is not None:
            event["seconds_fewer"] = round(time.monotonic() - self.fewer_since, 1)
            self.fewer_since = None
        if dist.get_rank() == 0:
            log.warning(f"hybridpar: step {step} committed by replica group(s) {members} of {self.ft.groups}"
                        + (f" (was {was})" if was is not None else ""))
        self.metrics.event(step, "groups", **event)

    def writes_checkpoints(self) -> bool:
        """The quorum's first group writes the job's checkpoints; the others keep training."""
        return self.manager.participating_rank() == 0

    def row(self) -> dict:
        return {"groups": len(self.members or ())}

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
