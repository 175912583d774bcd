"""The device mesh: how ranks split into model-parallel and data-parallel groups.

Layout (the contract every other module relies on): a DeviceMesh of shape
(pp, dp_replicate, dp_shard, cp, mp) with those dim names, mp innermost, cp next to it, pp outermost, so

    rank = (((pp_rank * dp_replicate + replicate_idx) * dp_shard + shard_idx) * cp + cp_rank) * mp + mp_rank
    dp_rank = replicate_idx * dp_shard + shard_idx,  dp_size = dp_replicate * dp_shard

The cp ranks of a data-parallel coordinate hold the same parameters: FSDP shards over dp_shard x cp
(`fsdp_mesh`, `dp_cp_mesh`) and the loss is summed over dp x cp (`dp_cp_group`). With cp = 1
those are the (dp_replicate, dp_shard) meshes and the dp group themselves. Every group but pp's lies
within one pipeline stage (the stage's layers are all FSDP and the loss know); `pp_group` joins the
stages of one (dp, cp, mp) coordinate, for the pipeline's sends and receives.

Expert parallelism (parallel.ep, models.moe) takes its ranks from dp_shard, no GPUs of its own: dp_shard
splits as (dp_shard_mod_ep, ep), ep innermost, so an ep group is ep neighbouring shard indices
(ep_rank = shard_idx % ep) of one mp rank. Each holds n_experts / ep of the experts, as DTensors on
`expert_mesh` (ep, mp); FSDP shards them over `expert_fsdp_mesh` (dp_replicate, dp_shard_mod_ep),
the data-parallel ranks holding the same experts, and everything else over the dp ranks as before.

A model-parallel group is `mp` contiguous ranks (inside one node when mp divides the GPUs per node), exactly
fairscale's `arange(world).reshape(dp, mp)` layout, and the flattened data-parallel group of a rank
is fairscale's data-parallel group.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..compat.torch import flatten_mesh, unflatten_mesh
# The arithmetic lives in the torch-free layout module.
from .layout import MESH_DIM_NAMES, MeshCoords, ep_split, launch_env, resolve_sizes
from .ranks import agree_attempt
from .rendezvous import store_of_this_start, uses_agent_store, words_while

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelDims:
    """The mesh of one job and this rank's place in it. Pass it explicitly to whatever needs groups."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    mp: int
    mesh: DeviceMesh
    # Flattened meshes are kept here: torch deprecates slicing them back out of `mesh`.
    dp_flat_mesh: DeviceMesh  # (dp_replicate * dp_shard): the data-parallel coordinate
    dp_cp_mesh: DeviceMesh  # (dp_replicate * dp_shard * cp): every rank holding a copy of one mp shard
    fsdp_mesh: DeviceMesh  # 2-D (dp_replicate, dp_shard * cp): hybrid sharding's
    device: torch.device
    backend: str
    timeout: timedelta
    # Expert parallelism; the meshes None at ep 1 (the experts are then laid out as every other weight).
    ep: int = 1
    expert_mesh: Optional[DeviceMesh] = None  # (ep, mp): the experts' DTensors, split on the expert (dim 0)
    expert_fsdp_mesh: Optional[DeviceMesh] = None  # (dp_replicate, dp_shard_mod_ep): FSDP's for the experts

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.mp

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """(pp, dp_replicate, dp_shard, cp, mp), as layout.resolve_sizes returns them."""
        return self.pp, self.dp_replicate, self.dp_shard, self.cp, self.mp

    @property
    def coords(self) -> MeshCoords:
        return MeshCoords.of(dist.get_rank(), *self.sizes)

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
    def cp_rank(self) -> int:
        return self.coords.cp_rank

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return self.coords.pp_rank

    @property
    def ep_rank(self) -> int:
        """Which of the ep shares of the experts this rank holds (0 at ep 1)."""
        return self.coords.shard_idx % self.ep

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks exchanging tokens for their experts (one mp rank's), None without expert parallelism."""
        return self.expert_mesh.get_group("ep") if self.ep > 1 else None

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        """The stages of this rank's (dp, cp, mp) coordinate, None without pipeline parallelism."""
        return self.mesh.get_group("pp") if self.pp > 1 else None

    @property
    def replicate_idx(self) -> int:
        return self.coords.replicate_idx

    @property
    def shard_idx(self) -> int:
        return self.coords.shard_idx

    # Sub-meshes: DTensor parameters live on mp_mesh; FSDP works over fsdp_mesh (2D, hybrid sharding)
    # or dp_cp_mesh (1D).
    @property
    def mp_mesh(self) -> DeviceMesh:
        return self.mesh["mp"]

    @property
    def cp_group(self) -> Optional[dist.ProcessGroup]:
        """The context-parallel group, None without context parallelism (attention makes no collective)."""
        return self.mesh.get_group("cp") if self.cp > 1 else None

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """Every rank holding a copy of this rank's mp shard: the loss and token counts are summed over it."""
        return self.dp_cp_mesh.get_group()

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
        cp = f"cp {c.cp_rank}/{self.cp}, " if self.cp > 1 else ""
        pp = f"pp {c.pp_rank}/{self.pp}, " if self.pp > 1 else ""
        ep = f"ep {self.ep_rank}/{self.ep}, " if self.ep > 1 else ""
        return (
            f"rank {c.rank}/{self.world_size}: {pp}mp {c.mp_rank}/{self.mp}, {cp}{ep}dp {c.dp_rank}/{self.dp_size} "
            f"(replicate {c.replicate_idx}/{self.dp_replicate}, shard {c.shard_idx}/{self.dp_shard}), "
            f"{self.backend} on {self.device}"
        )


def mesh_groups(parallel: ParallelDims) -> list[tuple[str, object]]:
    """(dimension name, group) for every process group a training step can use; each group once."""
    named = [("mp", parallel.mp_group), ("cp", parallel.cp_group), ("dp_shard", parallel.dp_shard_group),
             ("dp_replicate", parallel.dp_replicate_group), ("dp", parallel.dp_group),
             ("dp_shard_cp", parallel.fsdp_mesh.get_group("dp_shard_cp") if parallel.cp > 1 else None),
             ("dp_cp", parallel.dp_cp_group), ("pp", parallel.pp_group), ("ep", parallel.ep_group),
             ("dp_shard_mod_ep", parallel.expert_fsdp_mesh.get_group("dp_shard_mod_ep") if parallel.ep > 1 else None),
             ("world", dist.group.WORLD)]
    seen, out = set(), []
    for dim, group in named:
        if group is not None and group.group_name not in seen:
            seen.add(group.group_name)
            out.append((dim, group))
    return out


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
    cp: int = 1,
    pp: int = 1,
    timeout: Union[timedelta, float, None] = None,
    backend: Optional[str] = None,
    ep: int = 1,
) -> ParallelDims:
    """Initialise the process group (if needed) and build the (pp, dp_replicate, dp_shard, cp, mp) mesh;
    with ep > 1 also the experts' meshes, ep taken from dp_shard (which it must divide).

    Works under torchrun, under plain srun (RANK etc. derived from SLURM_*), and with no launcher at
    all (world size 1). nccl + cuda when GPUs are present, gloo + cpu otherwise; `backend` overrides.
    `timeout` (seconds or timedelta) is the process group's collective timeout when this call
    creates it; an already initialised process group is reused as it is.
    """
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))

    start = None  # this start's name, where init_parallel agrees on it before the process group
    if dist.is_initialized():
        backend = dist.get_backend()
        # The caller's group: the GPU is the launcher's local rank (torchrun's, or Slurm's under srun).
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    else:
        env = launch_env(os.environ)
        backend = backend or default_backend()
        # The env:// rendezvous reads these; fill them in for srun and single-process runs.
        os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                          MASTER_ADDR=env.master_addr)
        if env.master_port:
            os.environ["MASTER_PORT"] = str(env.master_port)
        local_rank = env.local_rank
        if "nccl" in backend:  # "nccl", or a per-device string such as "cpu:gloo,cuda:nccl"
            torch.cuda.set_device(local_rank)
        if uses_agent_store(os.environ):  # torchrun's store, kept across restarts: this start's keys apart
            store, start = store_of_this_start(env.master_addr, env.master_port, env.rank, env.world_size, timeout)
            joined = dict(store=store, rank=env.rank, world_size=env.world_size)
        elif env.world_size == 1 and not env.master_port:
            # A world of one with no launcher: an in-process store, no port to pick and lose to a
            # command started beside this one (a free port found here could be taken before it is bound).
            joined = dict(store=dist.HashStore(), rank=0, world_size=1)
        else:
            joined = {}
        with words_while("making the process group", env.rank):
            dist.init_process_group(backend=backend, timeout=timeout, **joined)
        atexit.register(_shutdown)

    device = torch.device("cuda", local_rank) if "nccl" in backend else torch.device("cpu")
    sizes = resolve_sizes(dist.get_world_size(), mp=mp, dp_shard=dp_shard, dp_replicate=dp_replicate, cp=cp, pp=pp)
    ep_split(sizes[2], ep)  # refused before any group is made
    with words_while("making the mesh's groups", dist.get_rank()):
        mesh = init_device_mesh(device.type, sizes, mesh_dim_names=MESH_DIM_NAMES)
        dp_flat_mesh = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        if cp == 1:  # no new groups: the cp-inclusive meshes are the data-parallel ones
            dp_cp_mesh, fsdp_mesh = dp_flat_mesh, mesh["dp_replicate", "dp_shard"]
        else:
            dp_cp_mesh = flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp")
            fsdp_mesh = unflatten_mesh(dp_cp_mesh, (sizes[1], sizes[2] * cp), ("dp_replicate", "dp_shard_cp"))
        expert_mesh = expert_fsdp_mesh = None
        if ep > 1:
            split = unflatten_mesh(mesh, (sizes[2] // ep, ep), ("dp_shard_mod_ep", "ep"), dim=2)
            expert_mesh, expert_fsdp_mesh = split["ep", "mp"], split["dp_replicate", "dp_shard_mod_ep"]
        agree_attempt(start)  # every rank is here: the name of this start for the store's keys
    return ParallelDims(*sizes, mesh=mesh, dp_flat_mesh=dp_flat_mesh, dp_cp_mesh=dp_cp_mesh, fsdp_mesh=fsdp_mesh,
                        device=device, backend=backend, timeout=timeout, ep=ep, expert_mesh=expert_mesh,
                        expert_fsdp_mesh=expert_fsdp_mesh)
