"""This rank's sends and receives, for the hang watchdog: a listener of diagnostics.wrap.

torch's flight recorder has no P2P entries on gloo (torch 2.13: dist.isend/irecv/send/recv and
batch_isend_irecv leave no entry; they only advance the group's sequence number, once per op), so
a rank waiting in a pipeline's receive would look, to the hang analysis, like a rank in no
collective at all. While a P2PLog listens, every send and receive is counted per (group, op, peer)
and kept until it completes (a blocking one returns, an async one's Work says it is done):

    with P2PLog() as log:
        schedule.step(...)   # torch.distributed.pipelining: isend/irecv through batch_isend_irecv
    log.snapshot()           # {"issued": {...}, "pending": [...]}

Each rank's heartbeat holds one, listening while its watchdog watches (set-up and training alike:
the counts go on across a pause, so that every rank counts the same ops), and puts its snapshot in
the rank's trace; the analysis (flight.py) matches a rank's n-th receive from a peer with the
peer's n-th send to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Iterator, Optional

import torch.distributed as dist

from .traces import P2P, dim_from_desc
from .wrap import Call, Listener

__all__ = ["P2PLog"]

KEEP = 256  # ops kept before the done ones are dropped (a step's are done within it)


class P2PLog(Listener):
    """Counts this rank's sends and receives and keeps those not yet complete (see the module)."""

    def __init__(self, dims: Optional[dict[str, str]] = None) -> None:
        """`dims`: group name -> the mesh dimension it serves, where its description may not say (a
        pp dimension spanning the world is the default group: at pp 2 x nothing else, "pp", not "world")."""
        self._dims = dict(dims or {})
        self.issued: dict[str, int] = {}  # P2P.key -> ops issued
        self._open: dict[int, tuple[P2P, object]] = {}  # id -> (the op, its Work once returned)
        self._ids = itertools.count()
        self._groups: dict[str, tuple[str, list[int]]] = {}  # group name -> (dim, global ranks)
        self._lock = threading.Lock()  # the heartbeat's thread reads while the main thread records

    def around(self, call: Call):
        # The isend/irecv a batch_isend_irecv calls are recorded, each with its Work; the batch is not.
        if call.kind in ("send", "recv") and (call.outer is None or call.outer.kind not in ("send", "recv")):
            return self._recording(call)
        return None

    @contextlib.contextmanager
    def _recording(self, call: Call) -> Iterator[None]:
        op = self._op(call)
        key = next(self._ids)
        with self._lock:
            self.issued[P2P.key(op.group, op.op, op.peer)] = op.n
            self._open[key] = (op, None)
            if len(self._open) > KEEP:
                self._forget_done()
        try:
            yield
        finally:
            with self._lock:
                work = call.result if call.name in ("isend", "irecv") else None
                if work is not None:  # open until its Work is done (looked at when the log grows, or is read)
                    self._open[key] = (op, work)
                else:  # a blocking send or recv returned (or raised): over
                    self._open.pop(key, None)

    def _forget_done(self) -> None:
        for key, (_, work) in list(self._open.items()):
            if work is not None and _done(work):
                del self._open[key]

    def _op(self, call: Call) -> P2P:
        group = call.group if call.group is not None else dist.group.WORLD
        name = group.group_name
        if name not in self._groups:
            self._groups[name] = (self._dims.get(name) or dim_from_desc(getattr(group, "group_desc", "")),
                                  dist.get_process_group_ranks(group))
        dim, ranks = self._groups[name]
        kind = call.kind
        names = ("dst", "group_dst") if kind == "send" else ("src", "group_src")
        peer = call.kwargs.get(names[0], call.args[1] if len(call.args) > 1 else None)
        group_peer = call.kwargs.get(names[1], call.args[4] if len(call.args) > 4 else None)
        if peer is None:
            peer = ranks[group_peer] if group_peer is not None else -1  # -1: a receive from any rank
        tensor = call.kwargs.get("tensor", call.args[0] if call.args else None)
        n = self.issued.get(P2P.key(name, kind, peer), 0) + 1
        return P2P(kind, int(peer), name, dim, list(ranks), n, [list(getattr(tensor, "shape", ()))])

    def snapshot(self) -> dict:
        """{"issued": {P2P.key: count}, "pending": [the open ops, oldest first]} (JSON-ready)."""
        with self._lock:
            self._forget_done()
            return {"issued": dict(self.issued), "pending": [dataclasses.asdict(op) for op, _ in self._open.values()]}


def _done(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # a Work that failed: its error is the rank's note
        return True

