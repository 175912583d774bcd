"""A store of its own for each start of the job, even where torchrun keeps one store across restarts.

torchrun (torch 2.5 and later) lends its agent's TCPStore to the ranks (TORCHELASTIC_USE_AGENT_STORE)
and keeps it across restarts, with no prefix per attempt (pytorch/pytorch#135712). Restarted ranks
then find the previous attempt's keys: gloo connects to a dead rank's address ("connectFullMesh"
fails), or a store barrier counts the dead ranks' arrivals and the new ranks wait for ever. The
restart count cannot name the attempt either: each agent counts its own restarts.

So before any process group is made, the ranks agree on a fresh name through the store itself, and
every key of this start (the process groups', hybridpar's) lives under it. Stale keys cannot fool
the agreement: each rank announces a new random token in one list; rank 0 draws the name and
answers every token it finds under a key named by that token (a key no earlier attempt wrote), and
is done when every rank has acknowledged under a key named by the new name.

Waiting here is not silent: after `REPORT_EVERY` seconds rank 0 names the ranks that have not
started, and a rank that rank 0 has not answered says so (one line per node); making the process
groups and the mesh that follow says how long it has waited (`words_while`), until the watchdog
takes over.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

log = logging.getLogger(__name__)

REPORT_EVERY = 20.0  # seconds of waiting before a word, and between words
_HELLOS = "hybridpar/rendezvous/hellos"


def uses_agent_store(environ=os.environ) -> bool:
    """torchrun lends its agent's store, kept across restarts (not with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _answer_key(token: str) -> str:
    return f"hybridpar/rendezvous/answer/{token}"


def _acks_key(name: str) -> str:
    return f"hybridpar/rendezvous/{name}/acks"


class Clock:
    """Seconds waited, and whether it is time for another word."""

    def __init__(self, timeout: float = float("inf")) -> None:
        self.start = time.monotonic()
        self.timeout = timeout
        self.next_word = REPORT_EVERY

    def waited(self) -> float:
        return time.monotonic() - self.start

    def word_due(self) -> bool:
        if self.waited() < self.next_word:
            return False
        self.next_word += REPORT_EVERY
        return True

    def expired(self) -> bool:
        return self.waited() > self.timeout


def _lead(store, world: int, clock: Clock, poll: Callable[[], None]) -> str:
    """Rank 0: draw the name, answer every token until each rank has acknowledged it."""
    name = uuid.uuid4().hex
    answered: set[str] = set()
    acked: set[int] = set()
    while len(acked) < world - 1:
        if store.check([_HELLOS]):
            for entry in store.get(_HELLOS).decode().split(";"):
                if entry and entry not in answered:  # a stale token's answer is read by no one
                    store.set(_answer_key(entry.split(":", 1)[1]), name)
                    answered.add(entry)
        if store.check([_acks_key(name)]):
            acked = {int(r) for r in store.get(_acks_key(name)).decode().split(",") if r}
        if len(acked) == world - 1:
            break
        missing = sorted(set(range(1, world)) - acked)
        if clock.expired():
            raise RuntimeError(f"hybridpar: rank(s) {short_list(missing)} did not start within {clock.timeout:.0f} s "
                               f"(parallel.init_timeout): see their launcher's log")
        if clock.word_due():
            log.warning(f"hybridpar: waiting {clock.waited():.0f} s for rank(s) {short_list(missing)} to start")
        poll()
    return name


def _follow(store, rank: int, clock: Clock, poll: Callable[[], None]) -> str:
    """A rank but 0: announce a fresh token, wait for rank 0's answer, acknowledge it."""
    token = uuid.uuid4().hex
    store.append(_HELLOS, f"{rank}:{token};")
    key = _answer_key(token)
    while not store.check([key]):
        if clock.expired():
            raise RuntimeError(f"hybridpar: rank 0 did not answer rank {rank} within {clock.timeout:.0f} s "
                               f"(parallel.init_timeout): see rank 0's launcher log")
        if clock.word_due() and os.environ.get("LOCAL_RANK", "0") == "0":  # one line a node
            log.warning(f"hybridpar: rank {rank} has waited {clock.waited():.0f} s for rank 0 to start")
        poll()
    name = store.get(key).decode()
    store.append(_acks_key(name), f"{rank},")
    return name


def short_list(ranks: list[int]) -> str:
    """Ranks for a line: the first 16, and how many more."""
    return str(ranks) if len(ranks) <= 16 else f"{ranks[:16]} and {len(ranks) - 16} more"


def agree_on_start(store, rank: int, world: int, timeout: float, *, poll_seconds: float = 0.05) -> str:
    """The name every rank of this start agrees on, through `store` (which may hold earlier starts' keys)."""
    clock = Clock(timeout)
    delay = [poll_seconds]

    def poll() -> None:  # quick at first, then gentle on the store: 16k ranks may be waiting
        time.sleep(delay[0])
        delay[0] = min(delay[0] * 1.5, 0.5)

    if world == 1:
        return uuid.uuid4().hex
    return _lead(store, world, clock, poll) if rank == 0 else _follow(store, rank, clock, poll)


def store_of_this_start(addr: str, port: int, rank: int, world: int,
                        timeout: timedelta) -> tuple[object, str]:
    """(a store holding only this start's keys, its name): a client of torchrun's agent store,
    prefixed by the name the ranks agree on."""
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, world_size=None, is_master=False, timeout=timeout, wait_for_workers=False)
    name = agree_on_start(store, rank, world, timeout.total_seconds())
    return dist.PrefixStore(f"hybridpar/start/{name}/", store), name



@contextmanager
def words_while(what: str, rank: int) -> Iterator[None]:
    """Rank `rank` says every REPORT_EVERY seconds that `what` is still going on (nothing else can yet:
    the watchdog needs the groups being made)."""
    done = threading.Event()
    start = time.monotonic()

    def speak() -> None:
        while not done.wait(REPORT_EVERY):
            log.warning(f"hybridpar: {what}: waited {time.monotonic() - start:.0f} s so far (a rank that "
                        f"has not connected, or a slow network; parallel.init_timeout ends the wait)")

    if rank == 0:
        threading.Thread(target=speak, name="hybridpar-set-up-words", daemon=True).start()
    try:
        yield
    finally:
        done.set()
