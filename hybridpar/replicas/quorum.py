"""The quorum before a replica group's step, asked until it forms (ReplicaGroups.begin_step): a quorum
that does not form in torchft's quorum timeout (the lighthouse gone, fewer groups than its
--min-groups) or forms with fewer than fault_tolerance.min_groups groups is waited out, said once per
reason (rank 0), and told to the watchdog as a wait, not a hang (Supervisor.waiting). The ranks of a
group decide together whether to ask again; ranks that leave it at different steps (a heal that
reached some of them only) stop the group, for its launcher to restart it. A stop signal (stop.py)
ends the wait, not its try at the quorum: the try runs in a thread of its own, and the group leaves
with QuorumStopped as soon as its ranks have agreed (each try may otherwise wait 2 x
fault_tolerance.timeout for a lighthouse that is gone).

Before a group's first quorum, its rank 0 makes sure the lighthouse answers (reach): a group started
while it is down, or at a wrong address, says so in one line instead of torchft's traceback."""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from ..checkpoint.dcp import step_dir_name
from ..mesh.ranks import gather_objects

log = logging.getLogger(__name__)

RETRY_S = 1.0  # seconds between tries at a quorum that did not form, or formed with too few groups
POLL_S = 0.2  # how often a rank waiting for its try at the quorum looks for a stop signal
# Seconds a try at the quorum may still take after a stop signal: one that forms the quorum trains the
# step, and the stop ballots end every group after it (a preemption signals them all at once).
STOP_GRACE_S = 5.0


class GroupOutOfStep(RuntimeError):
    """A group's ranks came out of the quorum at different steps: this group's failure."""


class LighthouseUnreachable(RuntimeError):
    """The lighthouse does not answer a group in set-up: one line, said once by the group's rank 0
    (every rank raises it alike: reporting.report_error), and the group exits for its launcher to try again."""

    every_rank = True


class QuorumStopped(Exception):
    """A stop signal came while the group waited for the quorum: every rank of the group raises it,
    after the same agreement. signal_name: the signal; step: the last step the group committed;
    waited_for: why the quorum had not formed; group: the group's index."""

    def __init__(self, signal_name: str, step: int, waited_for: str, group: int) -> None:
        super().__init__(f"stopped on {signal_name} while waiting for the quorum before step {step + 1} ({waited_for})")
        self.signal_name, self.step, self.waited_for, self.group = signal_name, step, waited_for, group
        self.saved: Optional[Path] = None  # what the group then saved (the trainer's)

    def line(self, newest: Optional[Path], writes: bool) -> str:
        """The stop's line (the group's rank 0): `newest` the newest checkpoint now, `writes` whether the
        group was the first of its last quorum."""
        saved = self.saved
        if saved is not None:
            kept = f"saved step {self.step}: {saved}"
        elif newest is not None and newest.name == step_dir_name(self.step):
            kept = f"step {self.step} is saved already: {newest}"
        elif self.step == 0:
            kept = "no step trained, nothing to save"
        else:
            kept = (f"step {self.step} not saved by this group: "
                    + ("the first group of its last quorum writes the job's checkpoints" if not writes else
                       "its save did not complete") + f" (the newest: {newest or 'none'})")
        return (f"hybridpar: stopped on {self.signal_name} while replica group {self.group} waited for the quorum "
                f"before step {self.step + 1} ({self.waited_for}); {kept}. To continue, run the same command again.")


def nowhere(phase: str, step: Optional[int] = None) -> None:
    """Where a rank is, told to no one (before ReplicaGroups.connect gives the supervisor's)."""


@contextmanager
def unwatched(what: str) -> Iterator[Callable[[str], None]]:
    """A wait no watchdog is told of (before ReplicaGroups.connect gives the supervisor's)."""
    yield lambda note: None


def join(replicas, say: Callable[[str], None]) -> None:
    """Ask for `replicas`' quorum (a ReplicaGroups) until one of fault_tolerance.min_groups groups or
    more forms; what it waits for meanwhile goes to `say` (the heartbeat's note), for the watchdog's
    line if the wait outlasts its limit. QuorumStopped on every rank of the group when a stop signal
    reached one of them meanwhile."""
    ft, manager = replicas.ft, replicas.manager
    began, said = time.monotonic(), None
    try:
        while (why := agreed(asked(replicas), replicas.step, ft.group, replicas.stop, said)) is not None:
            say(f"the quorum of the replica groups before step {replicas.step + 1} ({why})")
            if why != said and dist.get_rank() == 0:
                log.warning(f"hybridpar: replica group {ft.group} waits for the quorum before step "
                            f"{replicas.step + 1}: {why}; it trains on when the quorum forms")
            said = why
            time.sleep(RETRY_S)
    except QuorumStopped as stopped:
        replicas.stopped = stopped  # for the trainer's stop line
        raise
    if said is not None and dist.get_rank() == 0:
        log.warning(f"hybridpar: replica group {ft.group} is in a quorum of {manager.num_participants()} "
                    f"group(s) after waiting {time.monotonic() - began:.1f} s; it trains step {replicas.step + 1}")


def agreed(why: Optional[str], step: int, group: int, stop=None, before: Optional[str] = None) -> Optional[str]:
    """Whether every rank of this group got the quorum (`why` not, if this one did not), and at the same
    step (one gather). If one missed it, all ask again together: torchft's manager answers a group's
    ranks together, and a rank that asked again alone would wait there for the others, gone on to
    train, until its quorum timeout. Ranks at different steps were healed in part (the live peer of
    some failed meanwhile): GroupOutOfStep, so that the group's launcher restarts it to be healed whole.
    A stop signal on any rank (`stop`: its StopRequest) and a quorum missed: QuorumStopped on every rank
    (`before`: why the wait began, if this is not its first try)."""
    signal_name = stop.signal_name if stop is not None else ""
    votes = gather_objects((why is not None, step, signal_name))
    lowest, highest = min(v[1] for v in votes), max(v[1] for v in votes)
    stopped = next((v[2] for v in votes if v[2]), "")
    if any(v[0] for v in votes):
        if stopped and highest == lowest:
            raise QuorumStopped(stopped, step, before or (why if why not in (None, STOPPING) else
                                                          "its try at the quorum was not answered yet"), group)
        return why or "another rank of this group missed it"
    if highest != lowest:
        raise GroupOutOfStep(f"replica group {group}: its ranks left the quorum at steps {lowest} and {highest}, a "
                             "heal from a live group reached some of them only (that group failed meanwhile); the "
                             "group stops so that its launcher restarts it to be healed again")
    return None


STOPPING = "a stop signal came"  # what a rank that left its try at the quorum for a stop says of it


def asked(replicas) -> Optional[str]:
    """ask() for `replicas`' quorum in a thread of its own, waited for until it ends, or STOP_GRACE_S
    after a stop signal (then STOPPING: the try goes on unheeded, and the group leaves; replicas.abandon()
    keeps a heal that comes later from loading)."""
    stop = replicas.stop
    if stop is None:
        return ask(replicas.manager, replicas.ft, replicas.formed)
    outcome: dict = {}

    def attempt() -> None:
        try:
            outcome["why"] = ask(replicas.manager, replicas.ft, replicas.formed)
        except BaseException as err:  # noqa: BLE001 - raised again on the main thread
            outcome["error"] = err

    thread = threading.Thread(target=attempt, name="hybridpar-quorum", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.requested:
        thread.join(POLL_S)
    thread.join(STOP_GRACE_S)
    if thread.is_alive():
        replicas.abandon()
        if not thread.is_alive():  # it ended meanwhile: its outcome stands
            return _outcome(outcome)
        return STOPPING
    return _outcome(outcome)


def _outcome(outcome: dict) -> Optional[str]:
    if "error" in outcome:
        raise outcome["error"]
    return outcome["why"]


def ask(manager, ft, formed: Callable[[], None] = lambda: None) -> Optional[str]:
    """One try at the quorum through torchft's `manager`: None when it formed with enough groups, else why
    not; formed() is called when a quorum formed (enough groups or not)."""
    try:
        manager.start_quorum()
    except Exception as err:
        future = manager._quorum_future
        if future is None or not future.done() or future.exception() is not err:
            raise  # not the quorum's own failure (a heal's state that does not load is a bug to see)
        # torchft 0.2 keeps a failed quorum's future and raises its error again at every start_quorum.
        manager._quorum_future = None
        return lighthouse_says(ft)
    formed()
    found = manager.num_participants()
    if found < ft.min_groups:
        return f"{found} group(s) in it, fewer than fault_tolerance.min_groups = {ft.min_groups}"
    return None


def status(address: str, timeout: float) -> tuple[Optional[str], str]:
    """(the lighthouse's status page, "") or (None, why it does not answer). An HTTP error is an answer."""
    if urllib.parse.urlsplit(address).scheme not in ("http", "https"):  # torchft too needs the scheme
        return None, f"{address} is not a URL (write it as http://HOST:PORT)"
    try:
        with urllib.request.urlopen(f"{address}/status", timeout=timeout) as f:
            return f.read().decode(errors="replace"), ""
    except urllib.error.HTTPError as err:
        return "", f"HTTP {err.code}"
    except OSError as err:
        return None, re.sub(r"^\[Errno -?\d+\]\s*", "", str(getattr(err, "reason", err)))



def reach(ft, group: int, seconds: float) -> None:
    """Until the lighthouse answers (`seconds` at most, as torchft's own connect would try):
    LighthouseUnreachable naming the address, where it comes from, and what to do."""
    address = ft.address()
    deadline = time.monotonic() + seconds
    while True:
        page, why = status(address, max(0.5, min(5.0, seconds)))
        if page is not None:
            return
        if time.monotonic() >= deadline:
            raise LighthouseUnreachable(unreachable(ft, group, why, seconds))
        time.sleep(0.5)


def unreachable(ft, group: int, why: str, seconds: float) -> str:
    """The line of a group whose lighthouse does not answer."""
    address = ft.address()
    key = "fault_tolerance.lighthouse" if ft.lighthouse else "TORCHFT_LIGHTHOUSE"
    port = urllib.parse.urlsplit(address).port
    start = f"`hybridpar lighthouse --port {port}`" if port else "`hybridpar lighthouse`"
    return (f"replica group {group} cannot reach the lighthouse at {address} ({key}) in {seconds:g} s "
            f"(fault_tolerance.timeout): {why}; start it there ({start}) or correct {key}; the group exits for its "
            "launcher to try again")


def lighthouse_says(ft) -> str:
    """Why no quorum formed in torchft's quorum timeout (2 x fault_tolerance.timeout): the lighthouse does
    not answer, or what its status page says it waits for."""
    address = ft.address()
    page, reason = status(address, ft.timeout)
    if page is None:
        return f"the lighthouse at {address} does not answer: {reason}"
    found = re.search(r"Next quorum status:\s*([^<\[]+)", page)
    said = f"; the lighthouse: {found.group(1).strip()}" if found else ""
    return f"no quorum in {2 * ft.timeout:g} s{said}"
