"""Timeouts and collective tracing on by default, so a stuck collective fails fast and leaves a trace.

Start-up (rendezvous, first compilation, data preparation) legitimately takes long, so the process
group starts with the generous init timeout; once the first step has completed, every group of
the mesh gets the shorter train timeout: a collective that waits longer than that is a hang.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import MutableMapping, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..mesh import ParallelDims

# Read by torch when the process group is created: set them before init_parallel.
ENV_DEFAULTS = {
    "TORCH_FR_BUFFER_SIZE": "2000",  # the flight recorder: the last 2000 collectives of every group
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # write the flight recorder out when a collective times out
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a timed-out NCCL collective tears the process down
    "NCCL_DEBUG": "WARN",
}
BACKSTOP_GRACE = 30.0  # seconds the c10d timeout leaves the watchdog to report first


def apply_env_defaults(trace_dir: Optional[Path] = None,
                       environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the tracing variables the user has not set; returns those it set."""
    wanted = dict(ENV_DEFAULTS)
    if trace_dir is not None:
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(Path(trace_dir) / "flight_recorder_rank_")
    applied = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(applied)
    if trace_dir is not None and "TORCH_FR_DUMP_TEMP_FILE" in applied:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    return applied


def mesh_groups(parallel: ParallelDims) -> list[tuple[str, object]]:
    """(dimension name, group) for every process group a training step can use; each group once."""
    named = [("mp", parallel.mp_group), ("dp_shard", parallel.dp_shard_group),
             ("dp_replicate", parallel.dp_replicate_group), ("dp", parallel.dp_group), ("world", dist.group.WORLD)]
    seen, out = set(), []
    for dim, group in named:
        if group is not None and group.group_name not in seen:
            seen.add(group.group_name)
            out.append((dim, group))
    return out


def set_train_timeout(parallel: ParallelDims, seconds: float) -> None:
    """Give every group of the mesh the (shorter) timeout used once training runs."""
    timeout = timedelta(seconds=seconds)
    for _, group in mesh_groups(parallel):
        distributed_c10d._set_pg_timeout(timeout, group)
