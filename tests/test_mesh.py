"""The mesh: size resolution, the documented rank layout, launcher environments and the `mesh` CLI.

The layout every module relies on (hybridpar/mesh/device.py): a (pp, dp_replicate, dp_shard, cp, mp) grid with
mp innermost and pp outermost; without pp and cp, rank = (replicate_idx * dp_shard + shard_idx) * mp + mp_rank,
which is fairscale's `arange(world).reshape(dp, mp)`. The expected tables below are written out by hand on purpose.
"""

import ast
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from hybridpar.mesh.layout import (LaunchEnv, MeshCoords, MeshSizeError, expand_nodelist, group_ranks, launch_env,
                              resolve_sizes)
from tests.distributed import free_port, parallel_dims

# World 8, (pp, dp_replicate, dp_shard, cp, mp) = (1, 2, 2, 1, 2):
# (rank, replicate_idx, shard_idx, cp_rank, mp_rank, dp_rank[, pp_rank when not 0]).
LAYOUT_8 = [
    (0, 0, 0, 0, 0, 0),
    (1, 0, 0, 0, 1, 0),
    (2, 0, 1, 0, 0, 1),
    (3, 0, 1, 0, 1, 1),
    (4, 1, 0, 0, 0, 2),
    (5, 1, 0, 0, 1, 2),
    (6, 1, 1, 0, 0, 3),
    (7, 1, 1, 0, 1, 3),
]
GROUPS_8 = {
    "mp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "dp_shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp_replicate": [[0, 4], [1, 5], [2, 6], [3, 7]],
}
# World 4, mp 2, dp_shard -1 (the rest) -> (1, 1, 2, 1, 2).
LAYOUT_4 = [(0, 0, 0, 0, 0, 0), (1, 0, 0, 0, 1, 0), (2, 0, 1, 0, 0, 1), (3, 0, 1, 0, 1, 1)]
GROUPS_4 = {
    "mp": [[0, 1], [2, 3]],
    "dp": [[0, 2], [1, 3]],
    "dp_shard": [[0, 2], [1, 3]],
    "dp_replicate": [[0], [1], [2], [3]],
}
# World 8 with context parallelism, (pp, dp_replicate, dp_shard, cp, mp) = (1, 1, 2, 2, 2): cp next to mp,
# so a cp x mp block is 4 contiguous ranks; the dp coordinate is shared by a block.
LAYOUT_8_CP = [
    (0, 0, 0, 0, 0, 0),
    (1, 0, 0, 0, 1, 0),
    (2, 0, 0, 1, 0, 0),
    (3, 0, 0, 1, 1, 0),
    (4, 0, 1, 0, 0, 1),
    (5, 0, 1, 0, 1, 1),
    (6, 0, 1, 1, 0, 1),
    (7, 0, 1, 1, 1, 1),
]
GROUPS_8_CP = {
    "mp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp_shard": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp_replicate": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp_shard_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
}
# World 4 with pipeline parallelism, (pp, dp_replicate, dp_shard, cp, mp) = (2, 1, 2, 1, 1): pp outermost,
# so stage 0 is ranks 0-1 and stage 1 ranks 2-3; the data-parallel groups stay inside a stage and the
# stages of one data-parallel coordinate share its dp_rank (they read the same batch).
LAYOUT_4_PP = [(0, 0, 0, 0, 0, 0, 0), (1, 0, 1, 0, 0, 1, 0), (2, 0, 0, 0, 0, 0, 1), (3, 0, 1, 0, 0, 1, 1)]
GROUPS_4_PP = {
    "mp": [[0], [1], [2], [3]],
    "dp": [[0, 1], [2, 3]],
    "dp_shard": [[0, 1], [2, 3]],
    "dp_replicate": [[0], [1], [2], [3]],
    "pp": [[0, 2], [1, 3]],
}
# World 16, (pp, dp_replicate, dp_shard, cp, mp) = (2, 1, 2, 2, 2): every dimension but dp_replicate.
GROUPS_16_PP_CP = {
    "mp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_shard": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_replicate": [[r] for r in range(16)],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp_shard_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
}
# name -> (world, (pp, dp_replicate, dp_shard, cp, mp), init_parallel arguments, layout, groups). The
# arguments are spelled as elsewhere in the tests so that each worker reuses its memoised mesh.
TABLES = {
    "world8": (8, (1, 2, 2, 1, 2), dict(mp=2, dp_shard=2, dp_replicate=2), LAYOUT_8, GROUPS_8),
    "world4": (4, (1, 1, 2, 1, 2), dict(mp=2), LAYOUT_4, GROUPS_4),
    "world8-cp2": (8, (1, 1, 2, 2, 2), dict(mp=2, cp=2), LAYOUT_8_CP, GROUPS_8_CP),
    "world4-pp2": (4, (2, 1, 2, 1, 1), dict(pp=2), LAYOUT_4_PP, GROUPS_4_PP),
}


def _layout(rows) -> list[tuple]:
    """A table's rows with the pp_rank (0 where the table leaves it out)."""
    return [tuple(row) + (0,) * (7 - len(row)) for row in rows]


def _groups_of(rank: int, groups: dict) -> dict:
    """The one group of each kind that contains `rank`."""
    return {kind: next(g for g in lists if rank in g) for kind, lists in groups.items()}


# --- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world,kwargs,expected",
    [
        (1, {}, (1, 1, 1, 1, 1)),
        (8, dict(mp=2), (1, 1, 4, 1, 2)),
        (8, dict(mp=2, dp_replicate=2), (1, 2, 2, 1, 2)),
        (8, dict(mp=2, dp_shard=2, dp_replicate=2), (1, 2, 2, 1, 2)),
        (16, dict(mp=8, dp_shard=-1), (1, 1, 2, 1, 8)),
        (12, dict(mp=1, dp_shard=3, dp_replicate=4), (1, 4, 3, 1, 1)),
        (16, dict(mp=2, cp=4), (1, 1, 2, 4, 2)),
        (32, dict(mp=2, cp=2, dp_replicate=2), (1, 2, 4, 2, 2)),
        (16, dict(mp=2, pp=4), (4, 1, 2, 1, 2)),
        (32, dict(mp=2, cp=2, pp=2, dp_replicate=2), (2, 2, 2, 2, 2)),
    ],
)
def test_resolve_sizes(world, kwargs, expected):
    assert resolve_sizes(world, **kwargs) == expected


@pytest.mark.parametrize(
    "world,kwargs,numbers",
    [
        (8, dict(mp=3), ["8", "3"]),  # mp does not divide the world
        (8, dict(mp=2, dp_replicate=3), ["8", "6"]),  # mp * dp_replicate does not divide it
        (8, dict(mp=2, dp_shard=2, dp_replicate=1), ["4", "8"]),  # product != world
        (8, dict(mp=2, dp_shard=8), ["16", "8"]),  # product > world
        (8, dict(mp=0), ["mp", "0"]),
        (8, dict(mp=-2), ["mp", "-2"]),
        (8, dict(dp_replicate=0), ["dp_replicate", "0"]),
        (8, dict(dp_shard=0), ["dp_shard", "0"]),
        (8, dict(dp_shard=-2), ["dp_shard", "-2"]),
        (8, dict(cp=0), ["cp", "0"]),
        (12, dict(mp=2, cp=4), ["12", "8", "cp"]),  # mp * cp does not divide the world
        (8, dict(mp=2, cp=2, dp_shard=4), ["16", "8", "cp"]),  # product != world
        (8, dict(pp=0), ["pp", "0"]),
        (12, dict(mp=2, pp=8), ["12", "16", "pp"]),  # mp * pp does not divide the world
        (8, dict(mp=2, pp=2, dp_shard=4), ["16", "8", "pp"]),  # product != world
    ],
)
def test_resolve_sizes_errors_name_the_numbers(world, kwargs, numbers):
    with pytest.raises(MeshSizeError) as info:
        resolve_sizes(world, **kwargs)
    _assert_names(str(info.value), numbers)


def _assert_names(text: str, words: list[str]) -> None:
    """Each word appears as a whole token ("8" does not count inside "18")."""
    for word in words:
        assert re.search(rf"(?<![\w-]){re.escape(word)}(?!\w)", text), (word, text)


# --- the layout, as pure arithmetic --------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TABLES))
def test_coords_and_groups_match_the_documented_table(name):
    world, sizes, _, layout, groups = TABLES[name]
    coords = [MeshCoords.of(rank, *sizes) for rank in range(world)]
    assert [(c.rank, c.replicate_idx, c.shard_idx, c.cp_rank, c.mp_rank, c.dp_rank, c.pp_rank)
            for c in coords] == _layout(layout)
    assert group_ranks(*sizes) == groups


def test_pp_is_outermost_and_every_other_group_stays_in_a_stage():
    assert group_ranks(2, 1, 2, 2, 2) == GROUPS_16_PP_CP
    c = MeshCoords.of(13, 2, 1, 2, 2, 2)  # stage 1, shard 1, cp 0, mp 1
    assert (c.pp_rank, c.shard_idx, c.cp_rank, c.mp_rank, c.dp_rank) == (1, 1, 0, 1, 1)
    assert c.describe() == "pp 1, mp 1, cp 0, dp 1 (replicate 0, shard 1)"
    assert MeshCoords.of(5, 1, 2, 2, 1, 2).describe() == "mp 1, dp 2 (replicate 1, shard 0)"  # no pp, no cp


@pytest.mark.parametrize("sizes", [(1, 1, 2, 2, 2), (1, 2, 2, 4, 1), (1, 2, 1, 2, 4), (1, 1, 4, 2, 2),
                                   (2, 1, 2, 2, 2), (4, 2, 1, 1, 2), (2, 2, 2, 1, 1), (3, 1, 2, 2, 1)])
def test_a_rank_is_numbered_pp_outermost_cp_next_to_mp(sizes):
    """rank = (((p * dp_replicate + r) * dp_shard + s) * cp + c) * mp + m: torch's row-major mesh of
    these dims; the groups of every kind partition the world."""
    grid = torch.arange(sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4]).reshape(sizes)
    for rank in range(grid.numel()):
        c = MeshCoords.of(rank, *sizes)
        assert grid[c.pp_rank, c.replicate_idx, c.shard_idx, c.cp_rank, c.mp_rank] == rank
        assert c.dp_rank == c.replicate_idx * sizes[2] + c.shard_idx
    for kind, groups in group_ranks(*sizes).items():
        assert sorted(r for g in groups for r in g) == list(range(grid.numel())), kind
    assert ("pp" in group_ranks(*sizes)) == (sizes[0] > 1)
    assert "cp 1, dp" in MeshCoords.of(sizes[4], *sizes).describe() or sizes[3] == 1


@pytest.mark.parametrize(
    "dp_replicate,dp_shard,mp", [(1, 4, 1), (1, 2, 2), (1, 1, 4), (1, 4, 2), (1, 2, 8), (2, 2, 2), (2, 4, 2)]
)
def test_groups_are_fairscales_layout(dp_replicate, dp_shard, mp):
    """mp groups are the rows and dp groups the columns of fairscale's arange(world).reshape(dp, mp)."""
    grid = torch.arange(dp_replicate * dp_shard * mp).reshape(dp_replicate * dp_shard, mp)
    groups = group_ranks(1, dp_replicate, dp_shard, 1, mp)
    assert groups["mp"] == grid.tolist()
    assert groups["dp"] == grid.t().tolist()


def test_coords_outside_the_world_are_refused():
    with pytest.raises(ValueError, match="8"):
        MeshCoords.of(8, 1, 2, 2, 1, 2)


# --- launcher environments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("n1", ["n1"]),
        ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
        ("node[9-11]", ["node9", "node10", "node11"]),
        ("localhost", ["localhost"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


# Slurm's host lists allow a suffix after the brackets; MASTER_ADDR would come out as "node1".
def test_expand_nodelist_with_suffix():
    assert expand_nodelist("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    assert expand_nodelist("rack[1-2]-n[08-09],x") == ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09", "x"]


SLURM = dict(
    SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_JOB_NODELIST="gpu[03-04]", SLURM_JOB_ID="4242"
)


@pytest.mark.parametrize(
    "environ,expected",
    [
        # torchrun's variables win, even inside an srun allocation.
        (
            dict(SLURM, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="h0", MASTER_PORT="1234"),
            LaunchEnv(3, 4, 1, "h0", 1234, "torchrun"),
        ),
        # srun: the first host of the node list, a port derived from the job id (15000 + 4242 % 20000).
        (SLURM, LaunchEnv(5, 8, 1, "gpu03", 19242, "slurm")),
        (dict(SLURM, MASTER_ADDR="10.0.0.7", MASTER_PORT="2222"), LaunchEnv(5, 8, 1, "10.0.0.7", 2222, "slurm")),
    ],
    ids=["torchrun", "srun", "srun-with-master"],
)
def test_launch_env(environ, expected):
    assert launch_env(environ) == expected


def test_launch_env_without_a_launcher_is_a_world_of_one():
    env = launch_env({})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (0, 1, 0, "127.0.0.1", "single")
    assert env.master_port == 0  # no port: init_parallel makes an in-process store
    assert launch_env({"MASTER_PORT": "2345"}).master_port == 0  # a shell's leftover: no peer dials it


# --- init_parallel on real process groups -----------------------------------------------------------


def _case_mesh(dims: dict) -> dict:
    import torch.distributed as dist
    from fairscale.nn.model_parallel import initialize as fs

    parallel = parallel_dims(**dims)
    ranks = dist.get_process_group_ranks
    seen = {
        "coords": (dist.get_rank(), parallel.replicate_idx, parallel.shard_idx, parallel.cp_rank, parallel.mp_rank,
                   parallel.dp_rank, parallel.pp_rank),
        "groups": {
            "mp": ranks(parallel.mp_group),
            "dp": ranks(parallel.dp_group),
            "dp_shard": ranks(parallel.dp_shard_group),
            "dp_replicate": ranks(parallel.dp_replicate_group),
        },
        # FSDP's meshes: every rank holding the same mp shard (flat), and hybrid sharding's 2-D one.
        "fsdp_flat": ranks(parallel.dp_cp_mesh.get_group()),
        "fsdp": {n: ranks(parallel.fsdp_mesh.get_group(n)) for n in parallel.fsdp_mesh.mesh_dim_names},
    }
    if parallel.cp > 1:
        seen["groups"].update(cp=ranks(parallel.cp_group), dp_cp=ranks(parallel.dp_cp_group),
                              dp_shard_cp=seen["fsdp"]["dp_shard_cp"])
    else:
        assert parallel.cp_group is None
    if parallel.pp > 1:
        seen["groups"]["pp"] = ranks(parallel.pp_group)
        assert ranks(parallel.pp_mesh.get_group()) == seen["groups"]["pp"]
    else:
        assert parallel.pp_group is None
    fs.initialize_model_parallel(parallel.mp)
    try:
        seen["fairscale"] = {"mp": ranks(fs.get_model_parallel_group()), "dp": ranks(fs.get_data_parallel_group())}
    finally:
        fs.destroy_model_parallel()
    return seen


@pytest.mark.parametrize("name", sorted(TABLES))
def test_init_parallel_builds_the_documented_mesh(workers, name):
    world, sizes, dims, layout, groups = TABLES[name]
    for rank, seen in enumerate(workers(world).run(_case_mesh, dims)):
        mine = _groups_of(rank, groups)
        assert seen["coords"] == _layout(layout)[rank]
        assert seen["groups"] == mine, f"rank {rank}"
        dp_cp = mine.get("dp_cp", mine["dp"])
        assert seen["fsdp_flat"] == dp_cp, f"rank {rank}"
        shard = mine.get("dp_shard_cp", mine["dp_shard"])
        assert seen["fsdp"] == {"dp_replicate": mine["dp_replicate"], ("dp_shard_cp" if sizes[3] > 1 else "dp_shard"): shard}
        if sizes[0] == sizes[3] == 1:  # fairscale knows no cp, nor this pp
            assert seen["fairscale"] == {"mp": mine["mp"], "dp": mine["dp"]}, f"rank {rank}"


def _case_expert_meshes(dims: dict) -> dict:
    import torch.distributed as dist

    parallel = parallel_dims(**dims)
    ranks = dist.get_process_group_ranks
    return {"ep_rank": parallel.ep_rank, "ep": ranks(parallel.ep_group),
            "mp": ranks(parallel.expert_mesh.get_group("mp")),
            "experts_fsdp": {n: ranks(parallel.expert_fsdp_mesh.get_group(n))
                             for n in parallel.expert_fsdp_mesh.mesh_dim_names},
            "describe": parallel.describe()}


@pytest.mark.parametrize("world,dims", [(4, dict(ep=2)), (8, dict(mp=2, dp_replicate=2, ep=2)), (8, dict(ep=4))],
                         ids=["dp_shard4-ep2", "mp2-hybrid2x2-ep2", "dp_shard8-ep4"])
def test_expert_parallel_groups_are_neighbouring_shards_of_one_mp_rank(workers, world, dims):
    """ep splits dp_shard as (dp_shard_mod_ep, ep), ep innermost: an ep group is ep neighbouring shard
    indices; the experts' FSDP ranks are the dp ranks holding the same experts (same ep rank)."""
    mp, replicate = dims.get("mp", 1), dims.get("dp_replicate", 1)
    shard, ep = world // (mp * replicate), dims["ep"]
    for rank, seen in enumerate(workers(world).run(_case_expert_meshes, dims)):
        r, s, m = rank // (shard * mp), rank // mp % shard, rank % mp
        at = lambda r, s: (r * shard + s) * mp + m  # noqa: E731
        assert seen["ep_rank"] == s % ep and f"ep {s % ep}/{ep}" in seen["describe"]
        assert seen["ep"] == [at(r, s - s % ep + k) for k in range(ep)], rank
        assert seen["mp"] == [rank - m + k for k in range(mp)]
        assert seen["experts_fsdp"] == {"dp_replicate": [at(k, s) for k in range(replicate)],
                                        "dp_shard_mod_ep": [at(r, j * ep + s % ep) for j in range(shard // ep)]}, rank
        # What `hybridpar mesh --ep` prints, by arithmetic, is what the mesh made.
        printed = group_ranks(1, replicate, shard, 1, mp, ep=ep)
        assert seen["ep"] in printed["ep"] and seen["experts_fsdp"]["dp_shard_mod_ep"] in printed["dp_shard_mod_ep"]


def test_hybridpar_mesh_shows_the_ep_groups_and_ranks(capsys):
    from hybridpar import cli

    assert cli.main(["mesh", "--world", "16", "--mp", "2", "--ep", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "world 16 = dp_replicate 1 x dp_shard 8 (ep 4) x mp 2"
    assert out[1].split()[-1] == "ep_rank" and [row.split()[-1] for row in out[2:18:2]] == list("01230123")
    assert "ep groups (4): [0, 2, 4, 6] [1, 3, 5, 7] [8, 10, 12, 14] [9, 11, 13, 15]" in out
    assert "dp_shard_mod_ep groups (8): [0, 8] [1, 9] [2, 10] [3, 11] [4, 12] [5, 13] [6, 14] [7, 15]" in out
    assert cli.main(["mesh", "--world", "16", "--mp", "2", "--ep", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hybridpar: error: ep = 3 does not divide dp_shard = 8: the experts are split over ep of the "
                   "dp_shard ranks; choose an ep dividing 8 (divisors: [1, 2, 4, 8])"]


def test_an_ep_that_does_not_divide_dp_shard_is_refused_before_any_group():
    from hybridpar.mesh.layout import MeshSizeError, ep_split

    assert ep_split(6, 3) == 2
    with pytest.raises(MeshSizeError, match=r"^ep = 4 does not divide dp_shard = 6: the experts are split over ep of "
                                            r"the dp_shard ranks; choose an ep dividing 6 \(divisors: \[1, 2, 3, 6\]\)$"):
        ep_split(6, 4)


# --- launchers (real subprocesses) ---------------------------------------------------------------

LAUNCHER_VARS = re.compile(
    r"RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK|MASTER_ADDR|MASTER_PORT"
    r"|TORCHELASTIC_\w*|SLURM_\w*"
)
SUBPROCESS_TIMEOUT = 120

# Initialise from whatever launcher started it, all-reduce rank + 1 over the world and over the mp
# group, write what it saw to <out_dir>/rank<r>.json (files, because ranks share one stdout).
WORKER_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
import hybridpar
from hybridpar.mesh.device import launch_env

mp, out_dir = int(sys.argv[1]), sys.argv[2]
source = launch_env(os.environ).source
parallel = hybridpar.init_parallel(mp=mp)
world_sum, mp_sum = torch.tensor([dist.get_rank() + 1.0]), torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(world_sum)
dist.all_reduce(mp_sum, group=parallel.mp_group)
print(parallel.describe(), flush=True)
seen = dict(source=source, rank=dist.get_rank(), world=dist.get_world_size(), mp_rank=parallel.mp_rank,
            world_sum=world_sum.item(), mp_sum=mp_sum.item())
with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(seen, f)
# No explicit teardown: init_parallel's exit hook must make a plain end of script exit cleanly.
"""


def _clean_env(**extra: str) -> dict:
    """This environment without any launcher's variables, single-threaded, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.fullmatch(k)}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(commands: list[tuple[list[str], dict]]) -> list[str]:
    """Start every (argv, env) at once, wait for all; on a failure or timeout show every output."""
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for argv, env in commands
    ]
    outputs, problem = [], None
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=SUBPROCESS_TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            problem = f"timed out after {SUBPROCESS_TIMEOUT}s"
            for other in procs:
                other.kill()
            outputs.append(proc.communicate()[0])
        if proc.returncode and problem is None:
            problem = f"exit code {proc.returncode}"
    if problem:
        shown = "".join(f"\n--- process {i}: {' '.join(commands[i][0])} ---\n{out}" for i, out in enumerate(outputs))
        pytest.fail(f"{problem}{shown}")
    return outputs


@pytest.fixture
def launch(tmp_path):
    """launch(argv_prefix, envs, mp) -> (outputs, per-rank results): the worker script under a launcher."""
    script, out_dir = tmp_path / "worker.py", tmp_path / "results"
    script.write_text(WORKER_SCRIPT)
    out_dir.mkdir()

    def run(argv_prefix: list[str], envs: list[dict], mp: int):
        outputs = _run([([*argv_prefix, str(script), str(mp), str(out_dir)], env) for env in envs])
        results = [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]
        return "".join(outputs), results

    return run


def _expected(source: str, world: int) -> list[dict]:
    """These runs use mp = world, so both all-reduces give 1 + 2 + ... + world."""
    total = world * (world + 1) / 2
    return [dict(source=source, rank=r, world=world, mp_rank=r, world_sum=total, mp_sum=total) for r in range(world)]


def test_single_process_without_a_launcher(launch):
    out, results = launch([sys.executable], [_clean_env()], mp=1)
    assert "rank 0/1: mp 0/1, dp 0/1" in out, out
    assert results == _expected("single", 1), out


STORE_SCRIPT = """
import hybridpar
import torch.distributed as dist

import os
hybridpar.init_parallel(mp=1)
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):  # the PrefixStores torch wraps it in
    store = store.underlying_store
print("store", type(store).__name__, "RANK" in os.environ)
"""


def test_a_world_of_one_binds_no_port_it_picked(tmp_path):
    # A free port found by one command can be bound by another started beside it before this one binds
    # it (an export and a generate from one summary, side by side: EADDRINUSE): a world of one without a
    # launcher keeps its store in-process (gloo's own listener takes whatever port the kernel gives it).
    script = tmp_path / "store.py"
    script.write_text(STORE_SCRIPT)
    out = _run([([sys.executable, str(script)], _clean_env())])[0]
    assert "store HashStore False" in out, out
    # A MASTER_PORT left in the shell, already bound by another process: nothing dials it (CI once failed
    # when an in-process world of one wrote RANK=0 into os.environ and two commands it started read that
    # as torchrun's and both bound 29500). Nor does the process leave RANK for what it starts.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run([([sys.executable, str(script)], _clean_env(MASTER_PORT=str(port)))])[0]
    assert "store HashStore False" in out, out


def test_srun_style_environment(launch):
    slurm = dict(SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77", MASTER_PORT=str(free_port()))
    envs = [_clean_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **slurm) for r in range(2)]
    out, results = launch([sys.executable], envs, mp=2)
    assert results == _expected("slurm", 2), out


@pytest.mark.slow
def test_torchrun(launch):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out, results = launch(torchrun, [_clean_env()], mp=2)
    assert results == _expected("torchrun", 2), out


# --- the `hybridpar mesh` command ----------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridpar", "mesh", *args],
        env=_clean_env(), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name,args", [("world8", ["--dp-shard", "2", "--dp-replicate", "2"]),
                                       ("world8-cp2", ["--cp", "2", "--procs-per-node", "2"])])
def test_cli_prints_the_documented_table(name, args):
    world, sizes, _, layout, expected_groups = TABLES[name]
    result = _cli("--world", str(world), "--mp", "2", *args)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    cp = sizes[3] > 1
    # Rows: rank node mp_rank [cp_rank] dp_rank replicate shard.
    rows = [tuple(map(int, line.split())) for line in out.splitlines()
            if re.fullmatch(r"(\s*\d+){%d}\s*" % (7 if cp else 6), line)]
    assert [(row[0], row[2], row[3] if cp else 0, *row[-3:]) for row in rows] == [
        (rank, mp_rank, cp_rank, dp_rank, rep, shard) for rank, rep, shard, cp_rank, mp_rank, dp_rank in layout
    ], out
    groups = {
        m.group(1): [ast.literal_eval(g) for g in re.findall(r"\[[^\]]*\]", m.group(2))]
        for m in re.finditer(r"^(\w+) groups \(\d+\): (.*)$", out, re.MULTILINE)
    }
    assert groups == expected_groups, out
    shape = "dp_replicate 1 x dp_shard 2 x cp 2 x mp 2" if cp else "dp_replicate 2 x dp_shard 2 x mp 2"
    assert f"world 8 = {shape}" in out, out
    # A cp x mp block of 4 ranks on nodes of 2: said, since the key/value all-gathers then leave the node.
    assert ("a cp x mp block of 4 ranks spans nodes of 2" in out) == cp, out


def test_cli_rejects_sizes_that_do_not_divide_the_world():
    result = _cli("--world", "8", "--mp", "3")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "error" in out, out
    _assert_names(out, ["8", "3"])
    assert "Traceback" not in out, out


def test_cli_shows_the_pipeline_stage():
    result = _cli("--world", "4", "--pp", "2")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "world 4 = pp 2 x dp_replicate 1 x dp_shard 2 x mp 1" in out, out
    assert "pp groups (2): [0, 2] [1, 3]" in out, out
    # Rows: rank node pp_rank mp_rank dp_rank replicate shard.
    rows = [tuple(map(int, line.split())) for line in out.splitlines() if re.fullmatch(r"(\s*\d+){7}\s*", line)]
    assert [(row[0], row[2], row[4]) for row in rows] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], out
    assert "pp_rank" in out and "pp" not in _cli("--world", "4").stdout
