"""Cross-rank protocols: one rank acts, every rank learns the outcome, and all fail together.

A rank that fails between collectives leaves the others waiting in the next one until it times
out, so every step that can fail on some ranks only ends at an agreed point where the outcome is
shared. One wording for what the ranks raise:

  - a refusal, an error of the caller's `error_type` (bad input, an occupied folder), reads the
    same on every rank;
  - any other failure is re-raised where it happened; the other ranks raise
    `error_type("rank R could not <what>: <Type>: <message>")`.

Without a process group (a world of one) everything runs locally. torch is imported on use: the
command line reports a refused start (raised_by_every_rank) without loading it.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, NoReturn, Optional, TypeVar

T = TypeVar("T")


def _dist():
    import torch.distributed as dist

    return dist


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without one."""
    if "torch" not in sys.modules:  # a process that never imported torch has no process group
        return 0, 1
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (picklable), in rank order."""
    _, world = rank_and_world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    _dist().all_gather_object(out, value)
    return out


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank, so every rank takes the same decision."""
    _, world = rank_and_world()
    if world == 1:
        return value
    box = [value]
    _dist().broadcast_object_list(box, src=0)
    return box[0]


def _shared(error: BaseException, error_type: type[Exception]) -> tuple[bool, str]:
    """(is a refusal, text) as the other ranks will see it."""
    if isinstance(error, error_type):
        return True, str(error)
    return False, f"{type(error).__name__}: {error}"


def raised_by_every_rank(error: BaseException) -> bool:
    """Is this an error every rank raises alike (a refusal, a bad config, a check all ranks make)?
    Such errors are worth one line on rank 0, not one traceback per rank. Marked by a class
    attribute `every_rank = True` or by mark_every_rank."""
    return bool(getattr(error, "every_rank", False))


def mark_every_rank(error: BaseException) -> BaseException:
    try:
        error.every_rank = True
    except AttributeError:  # an exception type without a __dict__: left unmarked
        pass
    return error


def _raise_for_other(rank: int, what: str, refusal: bool, text: str, error_type: type[Exception]) -> NoReturn:
    raise mark_every_rank(error_type(text if refusal else f"rank {rank} could not {what}: {text}"))


def on_rank0(work: Callable[[], T], what: str, *, error_type: type[Exception] = RuntimeError) -> T:
    """Run `work()` on rank 0 alone; every rank returns its result, or raises (see the module's
    wording) if it failed, instead of the others waiting for rank 0 until a collective times out.
    `what` completes "rank 0 could not ..."."""
    rank, world = rank_and_world()
    if world == 1:
        return work()
    outcome: Any = None
    error: Optional[Exception] = None
    if rank == 0:
        try:
            outcome = ("ok", work())
        except Exception as err:  # noqa: BLE001 - shared with every rank, then re-raised
            error = err
            outcome = ("error", *_shared(err, error_type))
    outcome = broadcast_from_rank0(outcome)
    if error is not None:
        raise mark_every_rank(error)
    if outcome[0] == "error":
        _raise_for_other(0, what, outcome[1], outcome[2], error_type)
    return outcome[1]


def _flag_device():
    import torch

    # A backend string with gloo in it ("gloo", "cpu:gloo,cuda:nccl") reduces CPU tensors.
    backend = str(_dist().get_backend())
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def raise_if_any_failed(error: Optional[BaseException], what: str, *,
                        error_type: type[Exception] = RuntimeError) -> None:
    """Collective: each rank passes its own error (or None). If any rank failed, every rank
    raises: its own error if it had one, else one naming the first rank that failed. Costs one
    all-reduce of a flag when nothing failed."""
    _, world = rank_and_world()
    if world == 1:
        if error is not None:
            raise error
        return
    import torch

    failed = torch.tensor([0 if error is None else 1], device=_flag_device())
    _dist().all_reduce(failed)
    if not failed.item():
        return
    shared = gather_objects(None if error is None else _shared(error, error_type))
    if error is not None:
        raise mark_every_rank(error)
    rank, (refusal, text) = next((r, s) for r, s in enumerate(shared) if s is not None)
    _raise_for_other(rank, what, refusal, text, error_type)


def restart_count() -> int:
    """How many times torchrun has restarted the job's ranks (0 outside torchrun)."""
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Start:
    """One start of the job, held for its default process group: the name every rank agreed on
    (agree_attempt; None until then) and how many times each wait_for_every_rank name was called in
    it (every rank counts alike, so the counts name the same store keys on every rank)."""

    def __init__(self) -> None:
        self.name: Optional[str] = None
        self.arrivals: dict[str, int] = {}

    def arrive(self, what: str) -> int:
        """Count a call of wait_for_every_rank(what); the count so far, this one included."""
        self.arrivals[what] = self.arrivals.get(what, 0) + 1
        return self.arrivals[what]


# Each default process group's Start, gone with its group: a new group (a restarted job in the same
# process, a test's next one) starts with no name and no counts; one group kept across many test
# cases keeps counting, so its keys never repeat.
_STARTS: "weakref.WeakKeyDictionary[Any, Start]" = weakref.WeakKeyDictionary()


def this_start() -> Optional[Start]:
    """The default group's Start (None before a process group exists)."""
    import torch.distributed as dist

    group = dist.group.WORLD  # the default group (None before one exists)
    return None if group is None else _STARTS.setdefault(group, Start())


def agree_attempt(name: Optional[str] = None) -> None:
    """Name this start of the job alike on every rank: `name` where the ranks agreed on it already
    (mesh.rendezvous, through torchrun's store), else rank 0 draws one and the others receive it.
    Collective: init_parallel calls it as the mesh is made, every rank there. torchrun's restart count
    cannot name it: the agent whose rank failed counts a restart, an agent restarted for its peer's
    failure does not (seen: 0 on one node and 1 on the other, every rank then waiting for ever on keys
    the others never wrote)."""
    import uuid

    import torch.distributed as dist

    start = this_start()
    if dist.get_backend() == "fake" or start.name:
        return  # the dry run (one process plays its rank, nothing moves), or this start named already
    start.name = name or broadcast_from_rank0(uuid.uuid4().hex)


def attempt_id() -> str:
    """This start of the job, for keys in the job's store (which may outlive a restart): the name the
    ranks agreed on (agree_attempt), else torchrun's run id and restart count."""
    import os

    start = this_start() if "torch" in sys.modules else None
    if start is not None and start.name:
        return start.name
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{restart_count()}"


def wait_for_every_rank(name: str, poll: float = 0.2) -> None:
    """Return once every rank has called this with `name`, however long that takes: through the
    job's store, not a collective, whose timeout would end a job whose nodes finish some long local
    work (preparing data in a node's own cache) minutes apart. A rank that dies meanwhile is the
    watchdog's to report; the ones still to come are named by rank 0 every REPORT_EVERY seconds."""
    import logging
    import time

    from ..compat.torch import default_store
    from .rendezvous import Clock, short_list

    rank, world = rank_and_world()
    if world == 1:
        return
    key = f"hybridpar/arrived/{attempt_id()}/{name}/{this_start().arrive(name)}"
    store = default_store()
    store.append(f"{key}/ranks", f"{rank},")  # read only to name the late: the count is what every rank polls
    store.add(key, 1)
    clock = Clock()
    while store.add(key, 0) < world:
        if rank == 0 and clock.word_due():
            came = {int(r) for r in store.get(f"{key}/ranks").decode().split(",") if r}
            late = sorted(set(range(world)) - came)
            logging.getLogger(__name__).warning(
                f"hybridpar: waited {clock.waited():.0f} s for rank(s) {short_list(late)} to finish {name}")
        time.sleep(poll)
