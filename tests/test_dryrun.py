"""`hybridpar train --dry-run`: one process plays one rank of the whole world on a fake process group.
What it reports is held to real gloo runs of the same config: per-rank state bytes exactly, and the
collectives of a step as the same counter counts them on the real step. (The 128-rank rehearsal of
Llama 2 70B runs through launch/mp8_dp16.sh: tests/launch/test_scripts.py.)"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import make_config

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(flags: dict, world: int, rank: int, out: Path, config: str = "", timeout: float = 600):
    cmd = [sys.executable, "-m", "hybridpar", "train", "--dry-run", "--world", str(world), "--dry-run-rank", str(rank),
           "--json", str(out), *(["--config", config] if config else []),
           *[x for k, v in flags.items() for x in (f"--{k}", str(v))]]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    return result, time.perf_counter() - start


def _case_real_step(config):
    """Rank r of a real gloo run: the trainer's step under the collective counter, and the state
    bytes the dry run reports (gradients as backward left them, the optimizer's after its step)."""
    import torch.distributed as dist

    import torch

    from hybridpar.diagnostics.collectives import CollectiveCounter, mesh_dims
    from hybridpar.cli.dryrun import state_bytes
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    model = torch.nn.ModuleList(trainer.model_parts)  # the model, or this rank's pipeline stages
    seen = {}
    step = trainer.optimizer.step

    def step_and_measure(*args, **kwargs):
        seen["grads"] = [p.grad for p in model.parameters() if p.grad is not None]
        return step(*args, **kwargs)

    if trainer.parallel.pp > 1:  # torch's pipeline learns its shapes in the first step (one more forward per stage)
        trainer.train_step()
    trainer.optimizer.step = step_and_measure
    with CollectiveCounter(label=mesh_dims(trainer.parallel)) as counter:
        trainer.train_step()
    trainer.optimizer.step = step
    return {"rank": dist.get_rank(), "state": state_bytes(model, trainer.optimizer, seen["grads"]),
            "collectives": counter.by_dim_and_op()}


LAYOUTS = {
    # Context parallelism: the K/V all-gather and the causal masks on fake tensors, sequence parallel.
    "world4-cp2-mp2": (4, dict(mp=2, dp=1, strategy="full_shard", **{"parallel.cp": 2, "data.seq_len": 64})),
    "world4-mp2-dp2": (4, dict(mp=2, dp_shard=2, dp=2, strategy="hybrid_shard")),
    # Float8 weights all-gathered as bytes, their scales' amax all-reduced after the step (and at the first forward).
    "world4-mp2-dp2-float8_gather": (4, dict(mp=2, dp_shard=2, dp=2, strategy="hybrid_shard", **{
        "float8.recipe": "tensorwise", "float8.fsdp_all_gather": True})),
    "world8-mp2-2x2-ac": (8, dict(mp=2, dp_shard=2, dp_replicate=2, dp=4, strategy="hybrid_shard",
                                  **{"fsdp.activation_checkpointing": "full"})),
    "world8-mp1-dp8-accum2": (8, dict(mp=1, dp_shard=8, dp=4, grad_accum=2, strategy="full_shard")),
    # Pipeline stages (two per rank, interleaved) with sequence parallelism between them, FSDP kept
    # gathered over the micro-batches: everything but the pipeline's own sends.
    "world8-pp2-mp2-dp2-sp": (8, dict(mp=2, dp_shard=2, dp=2, strategy="full_shard", **{
        "parallel.pp": 2, "parallel.pp_schedule": "Interleaved1F1B", "parallel.sequence_parallel": True,
        "data.micro_batch_size": 4, "data.val_fraction": 0.0})),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_dry_run_reports_what_a_real_gloo_run_holds_and_sends(workers, corpus, tmp_path, layout):
    world, kwargs = LAYOUTS[layout]
    overrides = {"parallel.backend": "gloo", "diagnostics.data_guard": False, **{
        k: v for k, v in kwargs.items() if "." in k}}
    plain = {k: v for k, v in kwargs.items() if "." not in k}
    config = make_config(corpus, tmp_path / "run", **plain, **overrides)
    real = workers(world).run(_case_real_step, config)
    flags = {f"{s}.{k}": v for s, section in config.to_dict().items() for k, v in section.items()
             if f"{s}.{k}" not in ("output.run_dir",)}
    for rank in (0, world - 1):
        result, seconds = _dry_run(flags, world, rank, tmp_path / f"dry{rank}.json")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        dry = json.loads((tmp_path / f"dry{rank}.json").read_text())
        mine = real[rank]
        print(f"\n{layout} rank {rank}: dry run in {seconds:.1f} s; state {dry['state_bytes']} "
              f"(real {mine['state']}); {sum(r['calls'] for r in dry['collectives'])} collectives "
              f"(real {sum(r['calls'] for r in mine['collectives'])})")
        assert dry["state_bytes"] == mine["state"]  # exactly
        assert dry["collectives"] == mine["collectives"]  # count, payload and wire bytes per (dim, op)
        assert dry["ok"] and all(c["ok"] for c in dry["checks"])


def test_a_layout_that_cannot_run_fails_the_dry_run_with_the_reason(tmp_path):
    """Refused as the job refuses it (hybridpar.preflight.check_config): its one line, exit code 2, no report."""
    result, _ = _dry_run({"parallel.mp": 3}, 128, 0, tmp_path / "dry.json", config="llama2_70b")
    print("\n" + result.stdout + result.stderr)
    assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "dry.json").exists()
    said = result.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("hybridpar: error: ") and "world size 128" in said[0], said


@pytest.mark.slow
def test_a_128_rank_context_parallel_job_is_rehearsed(tmp_path):
    """Llama 2 70B at mp 8 x cp 4 x dp_shard 4 = 128 ranks: rank 0's step runs on fake tensors with the
    K/V all-gather over cp and FSDP over dp_shard x cp, each rank holding 1/128 of the state. Two of the
    80 identical layers: every size and collective of 70B, at a tenth of the time on fake tensors."""
    flags = {"parallel.mp": 8, "parallel.cp": 4, "parallel.dp_shard": 4, "parallel.dp_replicate": 1,
             "model.n_layers": 2, "output.run_dir": tmp_path / "run"}
    result, seconds = _dry_run(flags, 128, 0, tmp_path / "dry.json", config="llama2_70b")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "dry.json").read_text())
    print(f"\n128-rank cp 4 dry run: {seconds:.0f} s; {report['layout']}")
    assert report["ok"] and report["world"] == 128 and report["layout"].startswith("dp_replicate 1 x dp_shard 4 x cp 4 x mp 8 = 128 ranks")
    dims = {(c["dim"], c["op"]) for c in report["collectives"]}
    assert {("cp", "all_gather"), ("cp", "reduce_scatter"), ("dp_shard_cp", "all_gather")} <= dims, dims
    share = sum(report["state_bytes"].values()) / sum(report["expected_bytes"].values())
    assert 1.0 <= share < 1.01, share  # sharded over mp x dp_shard x cp = 128 (norms replicated over mp)
    assert seconds < 120


@pytest.mark.slow
def test_the_dry_run_rehearses_float8_and_counts_the_amax_all_reduces(tmp_path):
    """`hybridpar train --dry-run --config llama2_70b --world 128 --float8.recipe rowwise` on two of
    the 80 identical layers: torchao's casts run on fake tensors, and the collectives table counts
    their amax all-reduces over mp on top of bf16's: per block, in forward one for the input and
    weight of each of the 2 row-parallel linears (per token, per out-feature; stacked), again in full
    activation checkpointing's recompute, and in backward one for the output gradient and weight of
    each of the 5 column-parallel ones: 2 x 2 + 5 = 9; nothing else changes."""
    counts = {}
    for recipe in ("none", "rowwise"):
        flags = {"model.n_layers": 2, "float8.recipe": recipe, "output.run_dir": tmp_path / "run"}
        result, seconds = _dry_run(flags, 128, 0, tmp_path / f"{recipe}.json", config="llama2_70b")
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads((tmp_path / f"{recipe}.json").read_text())
        assert report["ok"] and report["world"] == 128
        counts[recipe] = {(c["dim"], c["op"]): c["calls"] for c in report["collectives"]}
        print(f"\n{recipe}: dry run in {seconds:.0f} s; mp all_reduce calls {counts[recipe][('mp', 'all_reduce')]}")
    amaxes = counts["rowwise"].pop(("mp", "all_reduce")) - counts["none"].pop(("mp", "all_reduce"))
    assert amaxes == 2 * 9 and counts["rowwise"] == counts["none"]


def _rehearsed(gpu: str, **flags):
    """The in-process dry run of rank 0 of mp 2 x dp_shard 2 (the debug model, bf16 compute) on `gpu`:
    its memory estimate and report."""
    from hybridpar.cli.dryrun import dry_run
    from hybridpar.config import load_config

    flags = {"model.preset": "debug", "data.seq_len": 64, "parallel.mp": 2, "parallel.dp_shard": 2,
             "fsdp.param_dtype": "bfloat16", **flags}
    run = dry_run(load_config(None, [f"--{k}={v}" for k, v in flags.items()]), 4, 0, gpu=gpu, progress=False)
    return run.memory, run.text()


@pytest.mark.slow
def test_the_dry_runs_memory_is_the_planners_float8_and_the_allocator_included():
    """The dry run's memory line is hybridpar.plan's estimate of its layout: with float8 the weights FSDP
    gathers in float8 (float8.fsdp_all_gather) take 1 byte, and nothing else changes (float8 saves for
    backward what bf16 saves, and its forward's amaxes: tests/test_plan_float8.py); a GPU job's adds the
    caching allocator's reserve."""
    from hybridpar.models.args import ModelArgs
    from hybridpar.plan.inputs import ALLOCATOR_OVERHEAD
    from hybridpar.plan.memory import gathered_bytes, local_param_shapes

    bf16, _ = _rehearsed("h100")
    rowwise, said = _rehearsed("a100", **{"float8.recipe": "rowwise"})
    gathered, report = _rehearsed("h100", **{"float8.recipe": "tensorwise", "float8.fsdp_all_gather": "true"})
    cpu, cpu_report = _rehearsed("h100", **{"parallel.backend": "gloo"})
    same = ("activations", "gathered_params", "grad_buffers", "transient", "allocator", "total")
    assert {k: rowwise[k] for k in same} == {k: bf16[k] for k in same}
    # The planner's gathered block: its float8 linears in 1 byte; two blocks gathered at once (full_shard).
    block = local_param_shapes(ModelArgs.from_preset("debug"), 2)["block"]
    halved = 2 * (gathered_bytes(block, 2) - gathered_bytes(block, 2, True))
    assert halved > 0 and gathered["gathered_params"] == bf16["gathered_params"] - halved
    for m in (bf16, gathered):
        assert m["allocator"] == pytest.approx(ALLOCATOR_OVERHEAD * (m["total"] - m["allocator"]))
    assert gathered["total"] == pytest.approx((bf16["total"] - bf16["allocator"] - halved) * (1 + ALLOCATOR_OVERHEAD))
    assert "memory per rank (the planner's estimate for a step, float8 tensorwise, its linears' weights gathered " \
           "in 1 byte): " in report and ", the allocator's reserve " in report, report
    assert "ok   float8 matmuls: h100 has them" in report and "time per step (the planner, on h100" in report
    # On a card without float8 matmuls the job would be refused: said, and no step time is priced.
    assert "warn float8 matmuls: float8.recipe = \"rowwise\" and a100 (--gpu) has no float8 matmuls" in said, said
    assert "step_s" not in rowwise and "time per step" not in said
    # A CPU job has no caching allocator.
    assert cpu["allocator"] == 0 and "allocator" not in cpu_report and cpu["total"] == pytest.approx(
        bf16["total"] - bf16["allocator"])


@pytest.mark.slow
def test_the_256_rank_llama4_maverick_job_is_rehearsed_with_balanced_routing(tmp_path):
    """Llama 4 Maverick, 400.7B parameters, at mp 8 x dp_shard 32 with its 128 experts over ep 8 (16 per
    rank): rank 0's step on fake tensors, every layer, the tokens routed balanced (fake tensors have no
    values to route by; the report says so). The state it holds, counted on the real model, is what the
    planner prices exactly; the all-to-alls the step issues are the bytes the planner prices."""
    from hybridpar.models.args import ModelArgs
    from hybridpar.plan import Layout, Workload, estimate
    from hybridpar.plan.hardware import spec

    flags = {"model.preset": "llama4_maverick", "parallel.mp": 8, "parallel.ep": 8, "parallel.dp_shard": 32,
             "data.seq_len": 8192, "data.micro_batch_size": 1, "fsdp.param_dtype": "bfloat16",
             "fsdp.activation_checkpointing": "full", "gpu": "h100", "output.run_dir": tmp_path / "run"}
    result, seconds = _dry_run(flags, 256, 0, tmp_path / "dry.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "dry.json").read_text())
    print(f"\n256-rank Maverick dry run: {seconds:.0f} s; {report['layout']}")
    assert report["ok"] and report["layout"].startswith("dp_replicate 1 x dp_shard 32 (ep 8) x mp 8 = 256 ranks")
    assert report["routing"].startswith("balanced (fake tensors have no values to route by)")
    assert "16 experts per ep rank" in report["routing"] and "routing balanced" in result.stdout
    planned = estimate(ModelArgs.from_preset("llama4_maverick"), Layout(mp=8, dp_shard=32, ep=8, ac="full"),
                       Workload(seq_len=8192), spec("h100", 256))
    tensors = sum(max(1, len(row["layers"])) for row in report["parameters"])  # AdamW's step: an fp32 scalar each
    assert report["state_bytes"]["parameters"] == report["state_bytes"]["gradients"] == planned.memory.params
    assert report["state_bytes"]["optimizer"] == planned.memory.optimizer + 4 * tensors
    issued = [c for c in report["collectives"] if c["dim"] == "ep"]
    assert [c["op"] for c in issued] == ["all_to_all"] and issued[0]["group_size"] == 8
    assert issued[0]["payload"] == planned.experts.all_to_all_mb == report["memory"]["all_to_all_bytes"]
    assert report["memory"]["experts_per_rank"] == 16
    assert "all-to-all per step 11.3 GiB planned, 11.3 GiB issued" in result.stdout


def test_an_ep_that_does_not_divide_the_experts_fails_the_dry_run_in_one_line(tmp_path):
    flags = {"model.preset": "debug_llama4", "parallel.ep": 3, "parallel.dp_shard": 6, "data.seq_len": 64}
    result, _ = _dry_run(flags, 6, 0, tmp_path / "dry.json")
    said = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "dry.json").exists()
    assert len(said) == 1 and said[0].startswith("hybridpar: error: parallel.ep = 3 does not divide the model's 4 "
                                                 "experts"), said
