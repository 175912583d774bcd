"""How much room a checkpoint takes, and the pieces of a save that ran out of it (dcp.Checkpointer).

The size is known before anything is written: the bytes of the tensors DCP will store, each stored
piece counted once (DCP writes a piece held by several ranks once), plus what DCP adds around them.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..diagnostics.liveness import lost_in_collective
from ..files import out_of_space
from ..mesh.ranks import gather_objects

# What DCP writes besides the tensors' bytes, measured on tmpfs (tests/checkpoint/test_disk_full.py
# prints the estimate against the folder's size): torch.save's zip records around every tensor, and
# its share of the .metadata file (names, shapes, chunk offsets); per rank, its files' headers, the
# last block of each, and its RNG file.
BYTES_PER_TENSOR = 1024
BYTES_PER_RANK = 64 * 1024
MARGIN = 1.02  # and 2% for block rounding and anything not counted above


def checkpoint_bytes(state: Any, world_size: int) -> int:
    """Bytes the checkpoint of `state` (the dict dcp.save gets) takes on disk, all ranks together.
    Collective: one all-gather of a number."""
    tensor_bytes, tensors = local_share(state, world_size)
    shares = gather_objects((tensor_bytes, tensors))
    total_bytes = sum(b for b, _ in shares)
    total_tensors = sum(n for _, n in shares)
    return int(MARGIN * (total_bytes + BYTES_PER_TENSOR * total_tensors) + BYTES_PER_RANK * world_size)


def local_share(state: Any, world_size: int) -> tuple[float, float]:
    """(bytes, tensors) of this rank's share: a piece held by k ranks counts 1/k on each of them."""
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        parts = [local_share(v, world_size) for v in state]
        return sum(b for b, _ in parts), sum(n for _, n in parts)
    if isinstance(state, DTensor):
        copies = 1
        for dim, placement in enumerate(state.placements):
            if placement.is_replicate():
                copies *= state.device_mesh.size(dim)
        local = state.to_local()
        return local.numel() * local.element_size() / copies, 1 / copies
    if isinstance(state, torch.Tensor):  # a plain tensor is the same on every rank: DCP stores it once
        return state.numel() * state.element_size() / world_size, 1 / world_size
    return 0.0, 0.0


def no_space_reason(error: BaseException) -> Optional[str]:
    """'No space left on device' (or the quota's wording) when `error` comes from a full file system,
    including one rank's failure inside DCP's CheckpointException; else None."""
    causes = [error]
    if isinstance(error, CheckpointException):
        causes += [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]
    for cause in causes:
        found = out_of_space(cause)
        if found is not None:
            return found.strerror or os.strerror(found.errno)  # a DiskFullError has the errno alone
    return None


def no_space_reasons(error: BaseException) -> list[str]:
    """Collective, after a failed save: every rank's no_space_reason that is not None. Nothing when a
    collective of the save lost its peer (liveness.lost_in_collective): this agreement could not
    complete, and it would meet the surviving peers' next save collective, which the watchdog reads
    as collectives out of step (the program's fault) rather than the dead rank's node."""
    if lost_in_collective(error):
        return []
    return [r for r in gather_objects(no_space_reason(error)) if r is not None]


def join_dcp_writers(timeout: float = 60.0) -> None:
    """Wait for DCP's writer threads: when one fails, dcp.save raises without joining the others."""
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)  # threading.Thread's own attribute; None once run
        if thread is not threading.current_thread() and "torch.distributed.checkpoint" in getattr(
                target, "__module__", ""):
            thread.join(timeout)


def remove_folder(path: Path, tries: int = 5) -> None:
    """Remove `path` and everything under it; a file a late writer adds meanwhile is caught by a retry."""
    for _ in range(tries):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.1)
    shutil.rmtree(path)  # still there: its error says why
