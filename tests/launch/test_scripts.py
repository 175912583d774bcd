"""The Slurm scripts without Slurm: syntax, and the dry run's exact commands, mesh and rehearsal for 16 x 8 ranks."""

import json
import resource
import subprocess
import time

import pytest

from tests.launch.common import (
    LLAMA3_405B_SH, LLAMA3_8B_128K_SH, MP8_DP16_SH, ROOT, SLURM_SH, documented_coords, mesh_table, printed_command, run_script, script_env,
)


@pytest.mark.parametrize("script", [SLURM_SH, MP8_DP16_SH, LLAMA3_8B_128K_SH, LLAMA3_405B_SH], ids=lambda p: p.name)
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_mp8_dp16_dry_run_prints_the_exact_commands_and_mesh_and_rehearses_rank_0(tmp_path):
    run_dir = tmp_path / "run"
    report = tmp_path / "rehearsal.json"
    start = time.perf_counter()
    result = run_script(MP8_DP16_SH, "--dry-run", env=script_env(RDZV_HOST="gpu001", RDZV_PORT=29400, RUN_DIR=run_dir,
                                                                 REHEARSE=1, DRY_RUN_JSON=report, DRY_RUN_GPU="h100"),
                        timeout=600)
    seconds = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    assert result.returncode == 0, result.stdout + result.stderr
    print("\n" + result.stdout[result.stdout.index("dry run of rank"):])
    print(f"the whole dry run: {seconds:.0f} s; largest process {peak_gb:.2f} GB resident")
    _check_rehearsal(json.loads(report.read_text()))
    assert seconds < 120 and peak_gb < 4
    out = result.stdout
    job = f"{run_dir}/job-dryrun"
    assert printed_command(out, "srun") == [
        "srun", "--nodes=16", "--ntasks=16", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label"]
    assert printed_command(out, "torchrun") == [
        "python3", "-m", "torch.distributed.run", "--nnodes=16", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu001:29400", "--rdzv-id=dryrun", "--max-restarts=3", f"--log-dir={job}/torchrun",
        "--tee=3", "-m", "hybridpar", "train", "--config", "llama2_70b",
        "--parallel.mp", "8", "--parallel.dp_shard", "8", "--parallel.dp_replicate", "2",
        "--output.run_dir", job, "--checkpoint.folder", f"{run_dir}/checkpoints", "--checkpoint.resume", "true"]
    assert printed_command(out, "mesh") == [
        "python3", "-m", "hybridpar", "mesh", "--world", "128", "--mp", "8", "--dp-shard", "8",
        "--dp-replicate", "2", "--procs-per-node", "8"]
    assert "world 128 = dp_replicate 2 x dp_shard 8 x mp 8" in out
    rows = mesh_table(out)
    assert [r[0] for r in rows] == list(range(128))
    for rank, node, mp_rank, dp_rank, replicate, shard in rows:
        assert node == rank // 8  # torchrun: node k holds ranks 8k..8k+7, so each mp group is one node
        assert dict(mp_rank=mp_rank, dp_rank=dp_rank, replicate=replicate, shard=shard) == documented_coords(rank, 8, 8)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in out and "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in out
    assert f"TORCH_FR_DUMP_TEMP_FILE={job}/flight_recorder/" in out
    assert not run_dir.exists(), "a dry run must not create the run folder"


def _check_rehearsal(report: dict) -> None:
    """Rank 0 of Llama 2 70B at mp 8 x dp_shard 8 x dp_replicate 2, as hybridpar.cli.dryrun reports it."""
    assert report["ok"] and report["world"] == 128
    assert report["layout"].startswith("dp_replicate 2 x dp_shard 8 x mp 8 = 128 ranks")
    assert {"mp", "dp_shard", "dp_replicate"} <= {r["dim"] for r in report["collectives"]}
    share = sum(report["state_bytes"].values()) / sum(report["expected_bytes"].values())
    assert 1.0 <= share < 1.01, share  # sharded over mp x dp_shard = 64 (the norms are replicated over mp)
    names = {p["name"] for p in report["parameters"]}
    assert "layers.*.attention.wq.weight" in names and "tok_embeddings.weight" in names
    assert all(len(p["layers"]) in (0, 80) for p in report["parameters"])
    assert report["checkpoint"]["files"] == 128 + 5
    # The planner's step time for this layout on the GPU asked for (hybridpar plan's estimate).
    memory = report["memory"]
    assert memory["gpu"] == "h100" and 0 <= memory["fsdp_exposed_s"] < memory["step_s"]
    assert 0.05 < memory["mfu"] < 0.6 and memory["tokens_per_s_per_gpu"] > 0
    # One 4096-token sequence per GPU cannot hide the all-gathers of a 70B/8 slice: a warning, not a failure.
    hidden = next(c for c in report["checks"] if c["name"] == "communication hidden")
    assert hidden["warning"] and "wait for FSDP's all-gathers" in hidden["detail"], hidden


def test_shard_group_size_is_configurable(tmp_path):
    result = run_script(MP8_DP16_SH, "--dry-run", "--dp-shard", "16", env=script_env(RUN_DIR=tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world 128 = dp_replicate 1 x dp_shard 16 x mp 8" in result.stdout
    argv = printed_command(result.stdout, "torchrun")
    assert argv[argv.index("--parallel.dp_shard") + 1] == "16"
    assert argv[argv.index("--parallel.dp_replicate") + 1] == "1"


def test_generic_script_takes_sizes_from_environment_and_options(tmp_path):
    env = script_env(NODES=4, PROCS_PER_NODE=2, MP=2, DP_REPLICATE=2, RUN_DIR=tmp_path / "run", MAX_RESTARTS=1)
    result = run_script(SLURM_SH, "--dry-run", "--config", "hybridpar/configs/local.toml", "--", "--train.steps", "7",
                        env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world 8 = dp_replicate 2 x dp_shard 2 x mp 2" in result.stdout
    argv = printed_command(result.stdout, "torchrun")
    assert "--nnodes=4" in argv and "--nproc-per-node=2" in argv and "--max-restarts=1" in argv
    assert argv[-2:] == ["--train.steps", "7"]  # user overrides come last: they win


# Each outer dimension slurm.sh takes: its flag, the summary and mesh lines, its groups at 2 nodes x 4
# with mp 2 (cp next to mp; pp outermost: a stage fills a node), and the refusal at size 3.
OUTER_DIMS = {
    "cp": ("mp 2 x cp 2 x dp_shard 2 x dp_replicate 1", "world 8 = dp_replicate 1 x dp_shard 2 x cp 2 x mp 2",
           "cp groups (4): [0, 2] [1, 3] [4, 6] [5, 7]", "not divisible by mp * cp * dp_replicate = 2 * 3 * 1 = 6",
           "not divisible by MP x CP x DP_SHARD = 2 x 2 x 3"),
    "pp": ("mp 2 x pp 2 x dp_shard 2 x dp_replicate 1", "world 8 = pp 2 x dp_replicate 1 x dp_shard 2 x mp 2",
           "pp groups (4): [0, 4] [1, 5] [2, 6] [3, 7]", "not divisible by mp * dp_replicate * pp = 2 * 1 * 3 = 6",
           "not divisible by MP x PP x DP_SHARD = 2 x 2 x 3"),
}


@pytest.mark.parametrize("dim", list(OUTER_DIMS))
def test_generic_script_takes_cp_and_pp(tmp_path, dim):
    """--cp / --pp reach the training command, the mesh command, the summary line and the -1 arithmetic."""
    summary, world, groups, refused, refused_rest = OUTER_DIMS[dim]
    env = script_env(NODES=2, PROCS_PER_NODE=4, MP=2, RUN_DIR=tmp_path / "run", REHEARSE=0)
    result = run_script(SLURM_SH, "--dry-run", f"--{dim}", "2", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"8 ranks, {summary}" in out and world in out and groups in out  # dp_shard = 8 / (mp x 2)
    argv = printed_command(out, "torchrun")
    assert argv[argv.index(f"--parallel.{dim}") + 1] == "2" and argv[argv.index("--parallel.dp_shard") + 1] == "2"
    mesh = printed_command(out, "mesh")
    assert mesh[mesh.index(f"--{dim}") + 1] == "2"
    bad = run_script(SLURM_SH, "--dry-run", f"--{dim}", "3", env=env)
    assert bad.returncode != 0 and refused in bad.stderr
    assert "Traceback" not in bad.stderr, bad.stderr
    rest = run_script(SLURM_SH, "--dry-run", f"--{dim}=2", "--dp-replicate", "-1", "--dp-shard", "3", env=env)
    assert rest.returncode != 0 and refused_rest in rest.stderr, rest.stderr


def test_llama3_405b_example_tiles_512_ranks_with_pipeline_stages_across_nodes(tmp_path):
    """The 405B example (the planner's best layout on 64 x 8 H100: mp 8 x pp 8 x FSDP 8, Interleaved1F1B):
    its sizes tile 512 ranks, its config loads, each mp group is one node and each pp group one rank
    of every eighth node (pp outermost), and the planner's settings reach the training command."""
    result = run_script(LLAMA3_405B_SH, "--dry-run", env=script_env(RUN_DIR=tmp_path / "run", REHEARSE=0))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "64 nodes x 8 processes = 512 ranks, mp 8 x pp 8 x dp_shard 8 x dp_replicate 1" in out
    assert "world 512 = pp 8 x dp_replicate 1 x dp_shard 8 x mp 8" in out
    assert "mp groups (64): [0, 1, 2, 3, 4, 5, 6, 7] [8, 9, 10, 11, 12, 13, 14, 15]" in out
    assert "pp groups (64): [0, 64, 128, 192, 256, 320, 384, 448] [1, 65," in out
    argv = printed_command(out, "torchrun")
    for key, value in [("--parallel.pp", "8"), ("--parallel.mp", "8"), ("--parallel.dp_shard", "8"),
                       ("--model.preset", "llama3.1_405b"), ("--parallel.pp_schedule", "Interleaved1F1B"),
                       ("--parallel.pp_microbatches", "256"), ("--data.micro_batch_size", "256")]:
        assert argv[argv.index(key) + 1] == value, key


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 511])
def test_llama3_405b_example_dry_run_rehearses_a_stage_pair_of_512_ranks(tmp_path, rank):
    """The issue's 512-rank rehearsal: 405B's every size at tp 8 x pp 8 x FSDP 8, Interleaved1F1B with 256
    micro-batches and sequence parallelism, one step of rank 0 (the embedding's stage 0 and stage 8) and
    of rank 511 (stage 7 and the head's stage 15) on fake tensors. 14 of the 126 identical layers, so the
    16 stages hold one unit each (all 126 take about 15 times as long and prove nothing more)."""
    out_json = tmp_path / "dry.json"
    result = run_script(LLAMA3_405B_SH, "--dry-run", "--", "--model.n_layers", "14",
                        env=script_env(RUN_DIR=tmp_path / "run", REHEARSE=1, DRY_RUN_RANK=rank,
                                       DRY_RUN_JSON=out_json, DRY_RUN_GPU="h100"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out_json.read_text())
    print(f"\n405B dry run, rank {rank}: {report['seconds']:.0f} s; {report['layout']}; state {report['state_bytes']}")
    assert report["ok"] and report["world"] == 512 and report["rank"] == rank
    assert report["layout"].startswith("pp 8 x dp_replicate 1 x dp_shard 8 x mp 8 = 512 ranks")
    held = {row["name"].split(".")[0] for row in report["parameters"]}
    assert held == ({"tok_embeddings", "layers"} if rank == 0 else {"layers", "norm", "output"}), held
    calls = {(c["dim"], c["op"]): c["calls"] for c in report["collectives"]}
    assert calls[("pp", "all_reduce")] == 1  # the last stage's loss to every stage
    # FSDP keeps each stage gathered over the 256 micro-batches: one all-gather and one reduce-scatter per
    # FSDP unit of the two stages (a block, the embedding; the head apart from the norm), not per micro-batch.
    assert calls[("dp", "all_gather")] == calls[("dp", "reduce_scatter")] in (2, 3), calls
    assert calls[("mp", "reduce_scatter")] % 256 == 0  # sequence parallelism's, every micro-batch alike
    share = sum(report["state_bytes"].values()) / sum(report["expected_bytes"].values())
    assert 0.8 < share < 1.25, share  # 1 / (pp x mp x dp_shard) of the model, give or take the stage's units
    assert report["seconds"] < 150


@pytest.mark.slow
def test_llama3_8b_128k_example_dry_run(tmp_path):
    """The long-context example (the planner's best layout for 8B at 131,072 tokens on 2 x 8 H100)
    tiles, its config loads, and rank 0's step is rehearsed on fake tensors at the example's shape: every
    size of 8B at seq 131072, with 2 of its 32 identical layers (one activation-checkpointed, one not, as
    ac_every 2 does; all 32 took 77 s of the step on fake tensors and prove nothing more)."""
    result = run_script(LLAMA3_8B_128K_SH, "--dry-run", "--", "--model.n_layers", "2",
                        env=script_env(RUN_DIR=tmp_path / "run", REHEARSE=1), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "2 nodes x 8 processes = 16 ranks, mp 4 x cp 4 x dp_shard 1 x dp_replicate 1" in out
    assert "world 16 = dp_replicate 1 x dp_shard 1 x cp 4 x mp 4" in out
    argv = printed_command(out, "torchrun")
    assert argv[argv.index("--parallel.cp") + 1] == "4" and argv[argv.index("--data.seq_len") + 1] == "131072"
    assert argv[argv.index("--parallel.sequence_parallel") + 1] == "true"
    assert "dry run of rank 0 of 16 (GPU job): 1.49B parameters (2 layers, dim 4096)" in out and "dp_replicate 1 x dp_shard 1 x cp 4 x mp 4 = 16 ranks" in out
    assert not (tmp_path / "run").exists(), "a dry run must not create the run folder"


@pytest.mark.parametrize("env, args, message", [
    ({"MP": 3}, ["--dry-run"], "128 ranks (16 nodes x 8) are not divisible by MP x DP_SHARD = 3 x 8"),
    ({}, ["--dry-run", "--dp-shard", "5"], "not divisible by MP x DP_SHARD = 8 x 5"),
    ({}, ["--dry-run", "--", "--train.stepz", "3"], "unknown config key 'train.stepz'"),
    ({}, [], "not inside a Slurm job: submit it"),
], ids=["mp3", "dp-shard5", "bad-key", "outside-a-job"])
def test_bad_input_is_one_clear_error_before_anything_starts(tmp_path, env, args, message):
    result = run_script(MP8_DP16_SH, *args, env=script_env(RUN_DIR=tmp_path / "run", **env))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_mesh_command_prints_the_128_rank_layout():
    result = subprocess.run(["python3", "-m", "hybridpar", "mesh", "--world", "128", "--mp", "8", "--dp-shard", "8",
                             "--dp-replicate", "2", "--procs-per-node", "8"], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(mesh_table(result.stdout)) == 128
    assert "mp groups (16): [0, 1, 2, 3, 4, 5, 6, 7] [8, 9, 10, 11, 12, 13, 14, 15]" in result.stdout
    assert "warning" not in result.stdout
