"""One layer over torch.distributed: the collectives hybridpar watches, each wrapped once, and the
listeners that watch them (the collective counter, the straggler timer, the profiler's ranges).

    with counter, timer:      # any number of listeners, nested or side by side
        train_step()

A listener is entered and left as a context (`with listener:`, the Listener base class). The first
listener in installs one wrapper per function of COLLECTIVES and P2P (on torch.distributed and on
distributed_c10d, where torch's own aliases find them) and on Work.wait; the last one out puts the
original objects back, exceptions included. Nothing is kept between: a process with no listener has
torch.distributed exactly as torch made it.

Every call reaches every listener's `around(call)`, which returns a context to run around the call
or None. `call.outer` is the wrapped call it runs inside (an alias calling torch's new name,
all_gather_object's tensor all_gather, a collective's own Work.wait), None at the top. FSDP2, FSDP1,
fairscale's mappings and hybridpar all call the module functions at call time
(`dist.all_reduce(...)`), so these wrappers see every collective they issue; torch.distributed.
pipelining builds its P2POps from `dist.isend`/`dist.irecv` at each action, so they hold the wrappers
(a P2POp kept from before the first listener or past the last one holds the other object, which
batch_isend_irecv's `op is isend` then misreads: build P2POps where they run). Inside torch.compile
the wrappers are transparent: nothing for dynamo to guard on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, ContextManager, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.compiler import is_compiling

# THE collectives hybridpar wraps: name -> (kind, position of the group argument). Both torch 2.13's
# names and the older ones (all_gather_into_tensor before its rename to all_gather_single,
# reduce_scatter_tensor before reduce_scatter_single); a name this torch lacks is skipped. Kinds:
# what the call does with its tensors ("object": pickled objects, through tensor collectives inside).
COLLECTIVES: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 2),
    "all_reduce_coalesced": ("all_reduce", 2),
    "broadcast": ("broadcast", 2),
    "reduce": ("reduce", 3),
    "all_gather": ("all_gather", 2),
    "all_gather_single": ("all_gather", 2),
    "all_gather_into_tensor": ("all_gather", 2),
    "_all_gather_base": ("all_gather", 2),
    "all_gather_coalesced": ("all_gather", 2),
    "reduce_scatter": ("reduce_scatter", 3),
    "reduce_scatter_single": ("reduce_scatter", 3),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "_reduce_scatter_base": ("reduce_scatter", 3),
    "all_to_all_single": ("all_to_all", 4),
    "all_to_all": ("all_to_all", 2),
    "barrier": ("barrier", 0),
    "all_gather_object": ("object", 2),
    "broadcast_object_list": ("object", 2),
}
# The point-to-point ops (a pipeline's sends and receives): name -> (kind, position of the group
# argument). batch_isend_irecv's group is its P2POps'; the isend and irecv it calls run inside it
# (call.outer), each with its own Work.
P2P: dict[str, tuple[str, int]] = {
    "send": ("send", 2),
    "recv": ("recv", 2),
    "isend": ("send", 2),
    "irecv": ("recv", 2),
    "batch_isend_irecv": ("p2p_batch", -1),
}
P2P_KINDS = frozenset(kind for kind, _ in P2P.values())
WRAPPED = {**COLLECTIVES, **P2P}  # every function the layer replaces
WAIT = "wait"  # the kind (and name) of Work.wait: where an async collective is waited for


@dataclasses.dataclass(slots=True)
class Call:
    """One call of a wrapped function, as the listeners see it."""

    name: str
    kind: str
    args: tuple
    kwargs: dict
    outer: Optional["Call"] = None  # the wrapped call this one runs inside; None at the top
    result: Any = None  # what the call returned, once it has

    @property
    def group(self):
        """The process group argument, by keyword or position (None: the default group)."""
        if "group" in self.kwargs:
            return self.kwargs["group"]
        if self.name == "batch_isend_irecv":
            ops = self.kwargs.get("p2p_op_list", self.args[0] if self.args else None)
            return ops[0].group if ops else None
        index = WRAPPED[self.name][1] if self.kind != WAIT else -1
        return self.args[index] if 0 <= index < len(self.args) else None

    @property
    def is_p2p(self) -> bool:
        """A send, a receive or a batch of them (not a collective, not a wait)."""
        return self.kind in P2P_KINDS

    @property
    def async_op(self) -> bool:
        return bool(self.kwargs.get("async_op", False))

    @property
    def work(self):
        """Work.wait's Work."""
        return self.args[0] if self.kind == WAIT and self.args else None


class Listener:
    """Base of the listeners: `with listener:` listens to every wrapped call until the block ends.
    Subclasses implement `around(call)`: a context to run around the call, or None (nothing to do)."""

    def around(self, call: Call) -> Optional[ContextManager]:
        raise NotImplementedError

    def __enter__(self):
        _LAYER.attach(self)
        return self

    def __exit__(self, *exc) -> None:
        _LAYER.detach(self)


class _Layer:
    """The wrappers over torch.distributed and the listeners they call: one per process, as
    torch.distributed is one. Installed while at least one listener listens."""

    def __init__(self) -> None:
        self.listeners: tuple[Listener, ...] = ()  # replaced, never mutated: calls on other threads read it
        self.local = threading.local()  # per thread: the innermost wrapped call running
        self.saved: list[tuple[object, str, object, bool]] = []  # (owner, name, original, own attribute)
        self.lock = threading.Lock()  # one listener in or out at a time

    def attach(self, listener: Listener) -> None:
        with self.lock:
            if listener in self.listeners:
                raise RuntimeError(f"{type(listener).__name__} is already listening: enter it once")
            if not self.listeners:
                self.install()
            self.listeners = self.listeners + (listener,)

    def detach(self, listener: Listener) -> None:
        with self.lock:
            if listener not in self.listeners:
                return
            self.listeners = tuple(x for x in self.listeners if x is not listener)
            if not self.listeners:
                self.restore()

    def install(self) -> None:
        wrappers: dict[int, Callable] = {}  # one wrapper per original function, wherever it is reachable
        try:
            for module in (dist, c10d):
                for name, (kind, _) in WRAPPED.items():
                    original = getattr(module, name, None)
                    if original is not None:
                        self._replace(module, name, wrappers.setdefault(id(original), self._wrap(name, kind, original)))
            self._replace(dist.Work, "wait", self._wrap(WAIT, WAIT, dist.Work.wait))
        except BaseException:
            self.restore()
            raise

    def _replace(self, owner, name: str, wrapper: Callable) -> None:
        self.saved.append((owner, name, getattr(owner, name), name in vars(owner)))
        setattr(owner, name, wrapper)

    def restore(self) -> None:
        while self.saved:
            owner, name, original, own = self.saved.pop()
            if own:
                setattr(owner, name, original)
            else:  # inherited: drop the wrapper and the base's shows through again
                delattr(owner, name)

    def _wrap(self, name: str, kind: str, original: Callable) -> Callable:
        layer = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if is_compiling():
                return original(*args, **kwargs)
            return layer.call(original, Call(name, kind, args, kwargs))

        return wrapper

    def call(self, original: Callable, call: Call):
        local = self.local
        call.outer = getattr(local, "inner", None)
        local.inner = call  # set first: a collective a listener issues is inside this call
        try:
            hooks = [hook for listener in self.listeners if (hook := listener.around(call)) is not None]
            if not hooks:  # the common case (the timer between its measured steps): kept cheap
                return original(*call.args, **call.kwargs)
            with contextlib.ExitStack() as stack:
                for hook in hooks:
                    stack.enter_context(hook)
                call.result = original(*call.args, **call.kwargs)
            return call.result
        finally:
            local.inner = call.outer


# The one layer (torch.distributed is one per process); it holds nothing while no listener listens.
_LAYER = _Layer()


def listeners() -> tuple[Listener, ...]:
    """The listeners listening now (none: torch.distributed is torch's own)."""
    return _LAYER.listeners
