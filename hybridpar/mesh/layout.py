"""The mesh's arithmetic, without torch: which rank sits where in a (dp_replicate, dp_shard, mp) mesh,
its groups, and the launcher's environment. `hybridpar mesh`, `--help` and the config checks use it
before (or without) importing torch; hybridpar.mesh.device builds the process groups on it.

    rank = (replicate_idx * dp_shard + shard_idx) * mp + mp_rank
"""

from __future__ import annotations

import dataclasses
import re
import socket
from typing import Mapping

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "mp")


class MeshSizeError(ValueError):
    """Parallel sizes that cannot tile the world."""
    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


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


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError that says which size must change."""
    if numerator % denominator:
        raise ValueError(
            f"{what} = {numerator} is not divisible by the model-parallel size mp = {denominator}; "
            f"choose an mp that divides {numerator}"
        )
    return numerator // denominator


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
    def rank(r: int, s: int, m: int) -> int:
        return (r * dp_shard + s) * mp + m

    R, S, M = range(dp_replicate), range(dp_shard), range(mp)
    return {
        "mp": [[rank(r, s, m) for m in M] for r in R for s in S],
        "dp": [[rank(r, s, m) for r in R for s in S] for m in M],
        "dp_shard": [[rank(r, s, m) for s in S] for r in R for m in M],
        "dp_replicate": [[rank(r, s, m) for r in R] for s in S for m in M],
    }



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
