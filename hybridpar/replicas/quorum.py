"""The quorum before a replica group's step, asked until it forms (ReplicaGroups.begin_step): a quorum
that does not form in torchft's quorum timeout (the lighthouse gone, fewer groups than its
--min-groups) or forms with fewer than fault_tolerance.min_groups groups is waited out, said once per
reason (rank 0), and told to the watchdog as a wait, not a hang (Supervisor.waiting). The ranks of a
group decide together whether to ask again; ranks that leave it at different steps (a heal that
reached some of them only) stop the group, for its launcher to restart it."""

from __future__ import annotations

import logging
import re
import time
import urllib.request
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from ..mesh.ranks import gather_objects

log = logging.getLogger(__name__)

RETRY_S = 1.0  # seconds between tries at a quorum that did not form, or formed with too few groups


class GroupOutOfStep(RuntimeError):
    """A group's ranks came out of the quorum at different steps: this group's failure."""


def nowhere(phase: str, step: Optional[int] = None) -> None:
    """Where a rank is, told to no one (before ReplicaGroups.connect gives the supervisor's)."""


@contextmanager
def unwatched(what: str) -> Iterator[Callable[[str], None]]:
    """A wait no watchdog is told of (before ReplicaGroups.connect gives the supervisor's)."""
    yield lambda note: None


def join(replicas, say: Callable[[str], None]) -> None:
    """Ask for `replicas`' quorum (a ReplicaGroups) until one of fault_tolerance.min_groups groups or
    more forms; what it waits for meanwhile goes to `say` (the heartbeat's note), for the watchdog's
    line if the wait outlasts its limit."""
    ft, manager = replicas.ft, replicas.manager
    began, said = time.monotonic(), None
    while (why := agreed(ask(manager, ft), replicas.step, ft.group)) is not None:
        say(f"the quorum of the replica groups before step {replicas.step + 1} ({why})")
        if why != said and dist.get_rank() == 0:
            log.warning(f"hybridpar: replica group {ft.group} waits for the quorum before step "
                        f"{replicas.step + 1}: {why}; it trains on when the quorum forms")
        said = why
        time.sleep(RETRY_S)
    if said is not None and dist.get_rank() == 0:
        log.warning(f"hybridpar: replica group {ft.group} is in a quorum of {manager.num_participants()} "
                    f"group(s) after waiting {time.monotonic() - began:.1f} s; it trains step {replicas.step + 1}")


def agreed(why: Optional[str], step: int, group: int) -> Optional[str]:
    """Whether every rank of this group got the quorum (`why` not, if this one did not), and at the same
    step (one gather). If one missed it, all ask again together: torchft's manager answers a group's
    ranks together, and a rank that asked again alone would wait there for the others, gone on to
    train, until its quorum timeout. Ranks at different steps were healed in part (the live peer of
    some failed meanwhile): GroupOutOfStep, so that the group's launcher restarts it to be healed whole."""
    votes = gather_objects((why is not None, step))
    lowest, highest = min(s for _, s in votes), max(s for _, s in votes)
    if any(missed for missed, _ in votes):
        return why or "another rank of this group missed it"
    if highest != lowest:
        raise GroupOutOfStep(f"replica group {group}: its ranks left the quorum at steps {lowest} and {highest}, a "
                             "heal from a live group reached some of them only (that group failed meanwhile); the "
                             "group stops so that its launcher restarts it to be healed again")
    return None


def ask(manager, ft) -> Optional[str]:
    """One try at the quorum through torchft's `manager`: None when it formed with enough groups, else why not."""
    try:
        manager.start_quorum()
    except Exception as err:
        future = manager._quorum_future
        if future is None or not future.done() or future.exception() is not err:
            raise  # not the quorum's own failure (a heal's state that does not load is a bug to see)
        # torchft 0.2 keeps a failed quorum's future and raises its error again at every start_quorum.
        manager._quorum_future = None
        return lighthouse_says(ft)
    found = manager.num_participants()
    if found < ft.min_groups:
        return f"{found} group(s) in it, fewer than fault_tolerance.min_groups = {ft.min_groups}"
    return None


def lighthouse_says(ft) -> str:
    """Why no quorum formed in torchft's quorum timeout (2 x fault_tolerance.timeout): the lighthouse does
    not answer, or what its status page says it waits for."""
    address = ft.address()
    try:
        with urllib.request.urlopen(f"{address}/status", timeout=ft.timeout) as f:
            status = f.read().decode(errors="replace")
    except OSError as err:
        reason = re.sub(r"^\[Errno \d+\]\s*", "", str(getattr(err, "reason", err)))
        return f"the lighthouse at {address} does not answer: {reason}"
    found = re.search(r"Next quorum status:\s*([^<\[]+)", status)
    said = f"; the lighthouse: {found.group(1).strip()}" if found else ""
    return f"no quorum in {2 * ft.timeout:g} s{said}"
