"""The mesh's arithmetic, without torch: which rank sits where in a (pp, dp_replicate, dp_shard, cp,
mp) mesh, its groups, and the launcher's environment. `hybridpar mesh`, `--help` and the config checks
use it before (or without) importing torch; hybridpar.mesh.device builds the process groups on it.

    rank = (((pp_rank * dp_replicate + replicate_idx) * dp_shard + shard_idx) * cp + cp_rank) * mp + mp_rank

mp is innermost (fairscale's layout), cp next to it, so a cp x mp block sits inside a node when it
fits. The cp ranks of a data-parallel coordinate read the same sequences (each its own chunks) and
hold the same parameters: FSDP shards over dp_shard x cp, gradients and the loss are reduced over
dp x cp. pp is outermost (torchtitan's and Megatron's choice: only point-to-point activations cross
stages, so stages may sit on different nodes); every group but "pp" lies within one stage, and the
stages of a data-parallel coordinate read the same batch (the first needs the tokens, the last the
targets), so dp_rank does not depend on the stage.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from typing import Mapping, Optional

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "mp")


class MeshSizeError(ValueError):
    """Parallel sizes that cannot tile the world."""
    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def resolve_sizes(world_size: int, mp: int = 1, dp_shard: int = -1, dp_replicate: int = 1,
                  cp: int = 1, pp: int = 1) -> tuple[int, int, int, int, int]:
    """Return (pp, dp_replicate, dp_shard, cp, mp) for `world_size` ranks; dp_shard=-1 takes the remaining ranks.

    Raises MeshSizeError naming the numbers and what to change when the sizes do not tile the world.
    """
    for name, value in (("mp", mp), ("dp_replicate", dp_replicate), ("cp", cp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MeshSizeError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(dp_shard, int) or (dp_shard < 1 and dp_shard != -1):
        raise MeshSizeError(f"dp_shard must be a positive integer or -1 (the remaining ranks), got {dp_shard!r}")
    fixed = mp * cp * dp_replicate * pp
    if dp_shard == -1:
        if world_size % fixed:
            shown = _shown((("mp", mp), ("cp", cp), ("dp_replicate", dp_replicate), ("pp", pp)))
            names = [n for n, _ in shown]
            raise MeshSizeError(
                f"world size {world_size} is not divisible by {' * '.join(names)} = "
                f"{' * '.join(str(v) for _, v in shown)} = {fixed}; choose {', '.join(names[:-1])} and {names[-1]} "
                f"whose product divides {world_size} (divisors: {_divisors(world_size)})"
            )
        dp_shard = world_size // fixed
    product = fixed * dp_shard
    if product != world_size:
        shown = _shown((("pp", pp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("cp", cp), ("mp", mp)))
        raise MeshSizeError(
            f"{' * '.join(n for n, _ in shown)} = {' * '.join(str(v) for _, v in shown)} = {product}, but the "
            f"world size is {world_size}; the product must equal the number of ranks (set dp_shard=-1 to use the rest)"
        )
    return pp, dp_replicate, dp_shard, cp, mp


def _shown(named):
    """The (name, size) pairs a message names: cp and pp only where they exist (> 1)."""
    return [(n, v) for n, v in named if n not in ("cp", "pp") or v > 1]


def ep_split(dp_shard: int, ep: int) -> int:
    """dp_shard / ep: the FSDP ranks left to each expert, ep being taken from dp_shard; MeshSizeError
    naming the sizes when ep does not divide it."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise MeshSizeError(f"ep must be a positive integer, got {ep!r}")
    if dp_shard % ep:
        raise MeshSizeError(f"ep = {ep} does not divide dp_shard = {dp_shard}: the experts are split over ep of the "
                            f"dp_shard ranks; choose an ep dividing {dp_shard} (divisors: {_divisors(dp_shard)})")
    return dp_shard // ep


def sizes_text(pp: int, dp_replicate: int, dp_shard: int, cp: int, mp: int, ep: int = 1) -> str:
    """'dp_replicate 1 x dp_shard 2 x mp 2' (pp and cp named only when > 1): how commands and reports state a
    mesh; with expert parallelism 'dp_shard 32 (ep 8) x mp 8': ep takes its ranks from dp_shard."""
    named = (("pp", pp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("cp", cp), ("mp", mp))
    return " x ".join(f"{n} {v}" + (f" (ep {ep})" if n == "dp_shard" and ep > 1 else "") for n, v in _shown(named))


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
    """Where one rank sits in the mesh. Pure arithmetic, no process groups: usable for planning.
    dp_rank is the data-parallel coordinate (cp peers and pp stages share it: they read the same sequences)."""

    rank: int
    replicate_idx: int
    shard_idx: int
    mp_rank: int
    dp_rank: int
    cp_rank: int = 0
    cp: int = 1  # the cp size, so that reports show the dimension only where it exists
    pp_rank: int = 0  # the pipeline stage
    pp: int = 1

    @staticmethod
    def of(rank: int, pp: int, dp_replicate: int, dp_shard: int, cp: int, mp: int) -> "MeshCoords":
        """The sizes in the mesh's order, as resolve_sizes returns them: MeshCoords.of(rank, *sizes)."""
        world = pp * dp_replicate * dp_shard * cp * mp
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world} ranks")
        pp_rank, in_stage = divmod(rank, world // pp)
        outer, mp_rank = divmod(in_stage, mp)
        dp_rank, cp_rank = divmod(outer, cp)
        replicate_idx, shard_idx = divmod(dp_rank, dp_shard)
        return MeshCoords(rank, replicate_idx, shard_idx, mp_rank, dp_rank, cp_rank, cp, pp_rank, pp)

    def describe(self, group: Optional[int] = None) -> str:
        """'mp 1, dp 2 (replicate 1, shard 0)' ('pp 1, mp 1, cp 0, dp 2 (...)' with pp and cp): how reports place a rank;
        'group 1, mp 1, ...' in replica group `group` of a fault-tolerant job (fault_tolerance.group)."""
        where = f"group {group}, " if group is not None else ""
        pp = f"pp {self.pp_rank}, " if self.pp > 1 else ""
        cp = f"cp {self.cp_rank}, " if self.cp > 1 else ""
        return f"{where}{pp}mp {self.mp_rank}, {cp}dp {self.dp_rank} (replicate {self.replicate_idx}, shard {self.shard_idx})"


def group_ranks(pp: int, dp_replicate: int, dp_shard: int, cp: int, mp: int, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every kind as lists of global ranks, in the mesh's order (group_ranks(*sizes)). With cp > 1 also the
    cp groups, dp_shard_cp (FSDP's shards: every rank of a replica holding the same mp shard) and
    dp_cp (every rank holding a copy of the same mp shard: the loss and replicated gradients); with pp > 1
    also the pp groups (one rank per stage: the pipeline's sends and receives). Every other group lies
    within one stage: the stages hold different layers. With ep > 1 also the ep groups (ep neighbouring
    shard indices: the experts' all-to-alls) and dp_shard_mod_ep (the shards holding the same experts)."""
    def rank(p: int, r: int, s: int, c: int, m: int) -> int:
        return (((p * dp_replicate + r) * dp_shard + s) * cp + c) * mp + m

    P, R, S, C, M = range(pp), range(dp_replicate), range(dp_shard), range(cp), range(mp)
    groups = {
        "mp": [[rank(p, r, s, c, m) for m in M] for p in P for r in R for s in S for c in C],
        "dp": [[rank(p, r, s, c, m) for r in R for s in S] for p in P for c in C for m in M],
        "dp_shard": [[rank(p, r, s, c, m) for s in S] for p in P for r in R for c in C for m in M],
        "dp_replicate": [[rank(p, r, s, c, m) for r in R] for p in P for s in S for c in C for m in M],
    }
    if cp > 1:
        groups["cp"] = [[rank(p, r, s, c, m) for c in C] for p in P for r in R for s in S for m in M]
        groups["dp_shard_cp"] = [[rank(p, r, s, c, m) for s in S for c in C] for p in P for r in R for m in M]
        groups["dp_cp"] = [[rank(p, r, s, c, m) for r in R for s in S for c in C] for p in P for m in M]
    if pp > 1:
        groups["pp"] = [[rank(p, r, s, c, m) for p in P] for r in R for s in S for c in C for m in M]
    if ep > 1:
        E, O = range(ep), range(ep_split(dp_shard, ep))
        groups["ep"] = [[rank(p, r, o * ep + e, c, m) for e in E] for p in P for r in R for o in O for c in C for m in M]
        groups["dp_shard_mod_ep"] = [[rank(p, r, o * ep + e, c, m) for o in O]
                                     for p in P for r in R for e in E for c in C for m in M]
    return groups


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
    # No launcher: the process group needs no port at all (init_parallel: an in-process store), so two
    # commands started side by side cannot race for one.
    return LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single")
