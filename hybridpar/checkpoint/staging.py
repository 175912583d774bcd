"""The host copy a GPU's asynchronous saves stage into: made once, in a background thread, before
the first save, and reused by every save (checkpoint.dcp's Checkpointer.prepare_staging).

torch's BlockingAsyncStager with its cache makes that copy at the first save: on an H200 the first
save of an 8B-shaped model blocked training 22 s (docs/benchmarks.md) while it pinned 17.8 GB of
host memory, after copying every DTensor shard to pageable host memory only to learn its layout.
HostStaging allocates the same tensors (pinned, uninitialised, never reading the GPU) while training
runs, and hands them to that stager as its cache: each save copies into them as torch's would, so
the files are the same bytes. Off CUDA there is nothing to pin and no HostStaging: DCP's own
staging runs as before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.tensor import DTensor

from ..compat.torch import dtensor_over

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """close() asked the allocation to end early."""


class HostStaging:
    """One rank's staging copy: prepare(state) starts allocating it in a thread; ready(state) waits
    for it and returns the stager that saves stage with. `pin`: page-locked host memory (CUDA)."""

    def __init__(self, device: torch.device, pin: bool = True) -> None:
        self.device, self.pin = torch.device(device), pin
        self.stager = BlockingAsyncStager(cache_staged_state_dict=True)
        self._thread: Optional[threading.Thread] = None
        self._made: Any = None
        self._error: Optional[BaseException] = None
        self._stop = False
        self.prepared_s: Optional[float] = None  # how long the allocation took, in the background
        self.figures: dict = {}  # of the save that waited for it: {"staging_wait_s", "staging_prepared_s"}

    @property
    def started(self) -> bool:
        return self._thread is not None or self.stager.state_dict_cache is not None

    def prepare(self, state: dict) -> None:
        """Start allocating a host copy of `state` (DCP's state dict: its layout, not its values)."""
        if self.started:
            return
        self._thread = threading.Thread(target=self._allocate, args=(state,), name="hybridpar-checkpoint-staging",
                                        daemon=True)
        self._thread.start()

    def _allocate(self, state: dict) -> None:
        begun = time.perf_counter()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # pinned through this rank's GPU, not device 0's context
            self._made = self._host_like(state)
        except BaseException as err:  # noqa: BLE001 - raised by the save that waits for it (ready)
            self._error = err
        self.prepared_s = time.perf_counter() - begun

    def _host_like(self, obj: Any) -> Any:
        """An uninitialised host tensor for each tensor of `obj`, laid out as torch's stager lays out
        its cache (torch.distributed._state_dict_utils._create_cpu_state_dict); other values kept."""
        if self._stop:
            raise _Stopped
        if isinstance(obj, DTensor):
            if obj.dim() == 0:
                return obj  # as torch's: a scalar DTensor is saved as it is
            return dtensor_over(self._plain(obj.to_local()), obj)
        if isinstance(obj, torch.Tensor):
            return torch.tensor(0, dtype=obj.dtype) if obj.dim() == 0 else self._plain(obj)
        if isinstance(obj, dict):
            return {key: self._host_like(value) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._host_like(value) for value in obj)
        return obj

    def _plain(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:  # nothing to pin (pinning no bytes fails)
            return torch.zeros(t.shape, dtype=t.dtype)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)

    def ready(self, state: dict) -> BlockingAsyncStager:
        """The stager, its cache the prepared copy when it matches `state` (the prepared copy is
        waited for: figures says how long, the first time). A copy that does not match (the state
        changed its layout) is dropped, and the stager makes its own, as torch's does."""
        if self._thread is not None:
            begun = time.perf_counter()
            self._thread.join()
            self._thread = None
            self.figures = {"staging_wait_s": round(time.perf_counter() - begun, 3),
                            "staging_prepared_s": round(self.prepared_s or 0.0, 3)}
            made, self._made = self._made, None
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if _same_layout(made, state):
                self.stager.state_dict_cache = made
            else:
                log.warning("checkpoint staging: the state's layout changed since its host copy was made; "
                            "this save makes a new one")
        else:
            self.figures = {}
        return self.stager

    def close(self) -> None:
        """End an allocation still running (between two tensors) and wait for it."""
        if self._thread is not None:
            self._stop = True
            self._thread.join()
            self._thread, self._made, self._error = None, None, None


def _same_layout(made: Any, state: Any) -> bool:
    """Whether host copy `made` has `state`'s keys, and a tensor of the same shape and dtype for
    each of its tensors (what the stager's copy into it needs)."""
    if isinstance(state, torch.Tensor):
        return isinstance(made, torch.Tensor) and made.shape == state.shape and made.dtype == state.dtype
    if isinstance(state, dict):
        return isinstance(made, dict) and made.keys() == state.keys() and all(
            _same_layout(made[k], v) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return isinstance(made, (list, tuple)) and len(made) == len(state) and all(
            _same_layout(m, s) for m, s in zip(made, state))
    return not isinstance(made, (torch.Tensor, dict, list, tuple))


def host_staging(device: torch.device) -> Optional[HostStaging]:
    """A GPU's HostStaging (pinned); None off CUDA, where DCP stages each save itself."""
    return HostStaging(device) if torch.device(device).type == "cuda" else None
