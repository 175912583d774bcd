"""The device mesh: how ranks split into model-parallel and data-parallel groups.

Layout (the contract every other module relies on): a DeviceMesh of shape
(dp_replicate, dp_shard, mp) with those dim names, mp innermost, so

    rank = (replicate_idx * dp_shard + shard_idx) * mp + mp_rank
    dp_rank = replicate_idx * dp_shard + shard_idx,  dp_size = dp_replicate * dp_shard

A model-parallel group is `mp` contiguous ranks (inside one node when mp divides the GPUs per node), exactly
fairscale's `arange(world).reshape(dp, mp)` layout, and the flattened data-parallel group of a rank
is fairscale's data-parallel group.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import re
import socket
from datetime import timedelta
from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .compat.torch import flatten_mesh

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "mp")
DEFAULT_TIMEOUT = timedelta(minutes=10)


class MeshSizeError(ValueError):
    """Parallel sizes that cannot tile the world."""
    every_rank = True  # raised alike on every rank: hybridpar.ranks.raised_by_every_rank


def resolve_sizes(world_size: int, mp: int = 1, dp_shard: int = -1, dp_replicate: int = 1) -> tuple[int, int, int]:
    """Return (dp_replicate, dp_shard, mp) for `world_size` ranks; dp_shard=-1 takes the remaining ranks.

    Raises MeshSizeError naming the numbers and what to change when the sizes do not tile the world.
    """
    for name, value in (("mp", mp), ("dp_replicate", dp_replicate)):
        if not isinstance(value, int) or value < 1:
            raise MeshSizeError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(dp_shard, int) or (dp_shard < 1 and dp_shard != -1):
        raise MeshSizeError(f"dp_shard must be a positive integer or -1 (the remaining ranks), got {dp_shard!r}")
    fixed = mp * dp_replicate
    if dp_shard == -1:
        if world_size % fixed:
            raise MeshSizeError(
                f"world size {world_size} is not divisible by mp * dp_replicate = {mp} * {dp_replicate} = {fixed}; "
                f"choose mp and dp_replicate whose product divides {world_size} "
                f"(divisors: {_divisors(world_size)})"
            )
        dp_shard = world_size // fixed
    product = dp_replicate * dp_shard * mp
    if product != world_size:
        raise MeshSizeError(
            f"dp_replicate * dp_shard * mp = {dp_replicate} * {dp_shard} * {mp} = {product}, but the world size "
            f"is {world_size}; the product must equal the number of ranks (set dp_shard=-1 to use the rest)"
        )
    return dp_replicate, dp_shard, mp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class MeshCoords:
    """Where one rank sits in the mesh. Pure arithmetic, no process groups: usable for planning."""

    rank: int
    replicate_idx: int
    shard_idx: int
    mp_rank: int
    dp_rank: int

    @staticmethod
    def of(rank: int, dp_replicate: int, dp_shard: int, mp: int) -> "MeshCoords":
        world = dp_replicate * dp_shard * mp
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world} ranks")
        dp_rank, mp_rank = divmod(rank, mp)
        replicate_idx, shard_idx = divmod(dp_rank, dp_shard)
        return MeshCoords(rank, replicate_idx, shard_idx, mp_rank, dp_rank)

    def describe(self) -> str:
        """'mp 1, dp 2 (replicate 1, shard 0)': how reports place a rank."""
        return f"mp {self.mp_rank}, dp {self.dp_rank} (replicate {self.replicate_idx}, shard {self.shard_idx})"


def group_ranks(dp_replicate: int, dp_shard: int, mp: int) -> dict[str, list[list[int]]]:
    """Every group of every kind as lists of global ranks, in the mesh's order."""
    grid = torch.arange(dp_replicate * dp_shard * mp).reshape(dp_replicate, dp_shard, mp)
    return {
        "mp": grid.reshape(-1, mp).tolist(),
        "dp": grid.reshape(-1, mp).t().tolist(),
        "dp_shard": grid.permute(0, 2, 1).reshape(-1, dp_shard).tolist(),
        "dp_replicate": grid.permute(1, 2, 0).reshape(-1, dp_replicate).tolist(),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelDims:
    """The mesh of one job and this rank's place in it. Pass it explicitly to whatever needs groups."""

    dp_replicate: int
    dp_shard: int
    mp: int
    mesh: DeviceMesh
    # The flattened (dp_replicate * dp_shard) mesh, kept here: torch deprecates slicing it back out of `mesh`.
    dp_flat_mesh: DeviceMesh
    device: torch.device
    backend: str
    timeout: timedelta

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.mp

    @property
    def coords(self) -> MeshCoords:
        return MeshCoords.of(dist.get_rank(), self.dp_replicate, self.dp_shard, self.mp)

    @property
    def rank(self) -> int:
        return self.coords.rank

    @property
    def mp_rank(self) -> int:
        return self.coords.mp_rank

    @property
    def mp_size(self) -> int:
        return self.mp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def replicate_idx(self) -> int:
        return self.coords.replicate_idx

    @property
    def shard_idx(self) -> int:
        return self.coords.shard_idx

    # Sub-meshes: DTensor parameters live on mp_mesh; FSDP works over dp_mesh (2D, hybrid sharding)
    # or dp_flat_mesh (1D).
    @property
    def mp_mesh(self) -> DeviceMesh:
        return self.mesh["mp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def mp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("mp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_flat_mesh.get_group()

    @property
    def dp_shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp_shard")

    @property
    def dp_replicate_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp_replicate")

    def describe(self) -> str:
        c = self.coords
        return (
            f"rank {c.rank}/{self.world_size}: mp {c.mp_rank}/{self.mp}, dp {c.dp_rank}/{self.dp_size} "
            f"(replicate {c.replicate_idx}/{self.dp_replicate}, shard {c.shard_idx}/{self.dp_shard}), "
            f"{self.backend} on {self.device}"
        )


# ---------------------------------------------------------------------------------------------
# Launcher environment: torchrun, plain srun, or nothing at all.


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as 'gpu[01-03,07],rack[1-2]-n[1-2]-ib' into host names, in order."""
    hosts: list[str] = []
    for expression in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        hosts.extend(_expand_host(expression))
    return hosts


def _expand_host(expression: str) -> list[str]:
    """Expand the first [...] range of one host expression, then the rest of it, recursively."""
    match = re.match(r"([^\[]*)\[([^\]]+)\](.*)", expression)
    if not match:
        return [expression]
    prefix, ranges, rest = match.groups()
    numbers: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        # Zero padding follows the lower bound's width, as in Slurm: [08-10] -> 08 09 10.
        numbers.extend([lo] if not hi else [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)])
    return [prefix + n + tail for n in numbers for tail in _expand_host(rest)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Read rank, world size and rendezvous from torchrun's variables, else Slurm's, else world of one."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return LaunchEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(environ.get("MASTER_PORT", 29500)),
            source="torchrun",
        )
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        if "MASTER_ADDR" in environ:
            addr = environ["MASTER_ADDR"]
        else:
            nodes = expand_nodelist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""))
            if not nodes:
                raise RuntimeError("under srun but SLURM_JOB_NODELIST is empty: set MASTER_ADDR to the first host")
            addr = nodes[0]
        # One port per job so two jobs sharing a first node do not collide.
        port = int(environ.get("MASTER_PORT", 15000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000))
        return LaunchEnv(
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", 0)),
            master_addr=addr,
            master_port=port,
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(environ.get("MASTER_PORT", 0)) or free_port(), "single")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _shutdown() -> None:
    """Tear the process groups down before interpreter exit.

    Gloo groups left to the interpreter's final garbage collection can abort the process
    ("terminate called without an active exception") after the job's work is done, which the
    launcher then reports as a failure (bench/README.md, "Notes").
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def init_parallel(
    mp: int = 1,
    dp_shard: int = -1,
    dp_replicate: int = 1,
    timeout: Union[timedelta, float, None] = None,
    backend: Optional[str] = None,
) -> ParallelDims:
    """Initialise the process group (if needed) and build the (dp_replicate, dp_shard, mp) mesh.

    Works under torchrun, under plain srun (RANK etc. derived from SLURM_*), and with no launcher at
    all (world size 1). nccl + cuda when GPUs are present, gloo + cpu otherwise; `backend` overrides.
    `timeout` (seconds or timedelta) is the process group's collective timeout when this call
    creates it; an already initialised process group is reused as it is.
    """
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))

    if dist.is_initialized():
        backend = dist.get_backend()
        # The caller's group: the GPU is the launcher's local rank (torchrun's, or Slurm's under srun).
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    else:
        env = launch_env(os.environ)
        backend = backend or default_backend()
        # The env:// rendezvous reads these; fill them in for srun and single-process runs.
        os.environ.update(
            RANK=str(env.rank),
            WORLD_SIZE=str(env.world_size),
            LOCAL_RANK=str(env.local_rank),
            MASTER_ADDR=env.master_addr,
            MASTER_PORT=str(env.master_port),
        )
        local_rank = env.local_rank
        if "nccl" in backend:  # "nccl", or a per-device string such as "cpu:gloo,cuda:nccl"
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, timeout=timeout)
        atexit.register(_shutdown)

    device = torch.device("cuda", local_rank) if "nccl" in backend else torch.device("cpu")
    sizes = resolve_sizes(dist.get_world_size(), mp=mp, dp_shard=dp_shard, dp_replicate=dp_replicate)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=MESH_DIM_NAMES)
    dp_flat_mesh = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
    return ParallelDims(*sizes, mesh=mesh, dp_flat_mesh=dp_flat_mesh, device=device, backend=backend, timeout=timeout)
