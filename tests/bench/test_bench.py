"""The training-throughput benchmark: its collective counter against hand counts, and one tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _count_by_hand_case():
    """Collectives whose bytes are known by hand; returns what the counter saw, per block."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.comm import CollectiveCounter
    from hybridpar.parallel import ColumnParallelLinear, RowParallelLinear
    from tests.distributed import parallel_dims

    seen = {}
    # torch 2.13 renamed all_gather_into_tensor all_gather_single; torch 2.11 has only the old name.
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    originals = (dist.all_reduce, getattr(dist, gather_name))
    # Meshes made before counting: making one is collective (init_parallel agrees the attempt's name).
    world_dims, mp2_dims = parallel_dims(mp=1), parallel_dims(mp=2)
    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(10))  # 40 bytes
        dist.all_gather([torch.zeros(3), torch.zeros(3)], torch.ones(3))  # gathered 24 bytes
        out = torch.zeros(4)
        with warnings.catch_warnings():  # torch 2.13 deprecates the alias; older torch has only it
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(out, torch.ones(2))  # calls all_gather_single: counted once
        seen["plain"] = counter.summary()
        counter.reset()

        # FSDP2 over both ranks, resharding after forward: gather in forward, again in backward,
        # reduce-scatter the gradient; each moves the whole 8 x 4 fp32 weight (128 bytes).
        torch.manual_seed(0)
        linear = nn.Linear(4, 8, bias=False)
        fully_shard(linear, mesh=init_device_mesh("cpu", (2,)), reshard_after_forward=True)
        linear(torch.randn(3, 4)).sum().backward()
        seen["fsdp"] = counter.summary()
        counter.reset()

        # The same with hybridpar's gloo collectives (all-to-all): the same wire bytes, the same gradient.
        from hybridpar.fastpaths.gloo_collectives import use_gloo_collectives

        torch.manual_seed(0)
        a2a = nn.Linear(4, 8, bias=False)
        fully_shard(a2a, mesh=init_device_mesh("cpu", (2,)), reshard_after_forward=True)
        use_gloo_collectives([a2a], world_dims)
        torch.manual_seed(1)
        x = torch.randn(3, 4)
        counter.enabled = False
        linear.zero_grad()
        linear(x).square().sum().backward()
        counter.enabled = True
        a2a(x).square().sum().backward()
        seen["a2a"] = counter.summary()
        seen["a2a_grad_diff"] = (a2a.weight.grad.to_local() - linear.weight.grad.to_local()).abs().max().item()
        counter.reset()

        # Tensor parallelism at mp 2: the row layer's output [2, 3, 4] all-reduced in forward, the
        # column layer's input gradient (same shape) in backward: 96 bytes each.
        parallel = mp2_dims
        column = ColumnParallelLinear(4, 8, bias=False, gather_output=False, parallel=parallel)
        row = RowParallelLinear(8, 4, bias=False, input_is_parallel=True, parallel=parallel)
        x = torch.randn(2, 3, 4, requires_grad=True)
        row(column(x)).sum().backward()
        seen["tp"] = counter.summary()
    seen["restored"] = (dist.all_reduce, getattr(dist, gather_name)) == originals
    return seen


def test_counter_matches_hand_counts(workers):
    for seen in workers(2).run(_count_by_hand_case):
        plain = {k: (v["calls"], v["payload"], v["wire"]) for k, v in seen["plain"].items()}
        assert plain == {"all_gather/n2": (2, 24 + 16, (24 + 16) / 2), "all_reduce/n2": (1, 40, 40.0)}, plain
        fsdp = {k: (v["calls"], v["payload"], v["wire"]) for k, v in seen["fsdp"].items()}
        assert fsdp == {"all_gather/n2": (2, 256, 128.0), "reduce_scatter/n2": (1, 128, 64.0)}, fsdp
        a2a = {k: (v["calls"], v["payload"], v["wire"]) for k, v in seen["a2a"].items()}
        # Two gathers and a reduce-scatter, each an all-to-all that hands over only the 64 bytes
        # (half the weight) going to the other rank: the same wire bytes as FSDP's own.
        assert a2a == {"all_to_all/n2": (3, 3 * 64, 3 * 64.0)}, a2a
        assert seen["a2a_grad_diff"] < 1e-6
        tp = {k: (v["calls"], v["payload"], v["wire"]) for k, v in seen["tp"].items()}
        assert tp == {"all_reduce/n2": (2, 192, 192.0)}, tp
        assert seen["restored"]


def test_analytic_minimum_by_hand():
    from bench.comm import analytic_bytes
    from hybridpar.models.args import ModelArgs

    args = ModelArgs.from_preset("debug")  # dim 64, 2 layers, vocab 128, ffn 192, 8 heads = kv heads
    # mp 2, dp_shard 2, one replica, 1 x 4 tokens: the numbers written out.
    got = analytic_bytes(args, mp=2, dp_shard=2, dp_replicate=1, micro_batch=1, seq_len=4)
    block = (64 * 64 * 4 + 3 * 64 * 192) // 2 + 2 * 64  # wq wk wv wo, w1 w2 w3 split; two norms whole
    units = 128 * 64 // 2 + 128 * 64 // 2 + 64 + 2 * block  # gathered once, blocks once more
    gathered = units + 2 * block
    fsdp = 0.5 * gathered * 4 + 0.5 * (units) * 4  # all-gathers + one reduce-scatter of everything
    activation = 1 * 4 * 64 * 4
    tp = 1.0 * activation * (4 * 2 + 1 + 1) + 1.0 * 3 * 4 * 4  # blocks, head grad, embedding, loss
    scalars = 2 * 1.0 * 4 + 1.5 * 4
    assert got == {"fsdp": fsdp, "tp": tp, "scalars": scalars, "total": fsdp + tp + scalars}


@pytest.mark.slow
def test_entry_point_tiny_world2(tmp_path, check_close):
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--shapes", "tiny", "--layouts", "2:1:1", "--repeats", "1",
         "--steps", "1", "--warmup", "1", "--weak", "", "--peak-seconds", "0.2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"machine", "options", "cases", "ratios", "weak_scaling"} <= set(report) and report["complete"]
    engines = {c["engine"]: c for c in report["cases"]}
    assert set(engines) == {"hybridpar", "recipe"}
    for case in engines.values():
        run, mem = case["runs"][0], case["memory_run"]  # a paired timing run; a run of the engine alone
        assert run["engines_in_run"] == ["hybridpar", "recipe"]
        for key in ("tokens_per_s", "tokens_per_cpu_s", "step_time", "mfu", "mfu_cpu", "losses"):
            assert run[key] is not None, key
        for key in ("state_ratio", "comm_wire_bytes", "comm_analytic", "comm_ratio", "peak_rss_train_max", "losses"):
            assert mem[key] is not None, key
        assert run["tokens_per_s"] > 0 and 0 < run["mfu"] < 2
        assert len(run["losses"]) == 3  # warm-up, timed, counted
        # Per-rank state: FSDP pads, norms are whole on each mp rank: close to, never below, ideal.
        assert 1.0 <= mem["state_ratio"]["total"] < 1.01
        assert mem["comm_wire_bytes"] >= mem["comm_analytic"]["tp"] > 0
    hybrid, recipe = engines["hybridpar"], engines["recipe"]
    # The recipe gathers the full logits; hybridpar moves the analytic minimum at this layout.
    assert recipe["memory_run"]["comm_wire_bytes"] > hybrid["memory_run"]["comm_wire_bytes"]
    assert abs(hybrid["memory_run"]["comm_ratio"] - 1) < 1e-3
    ratio = report["ratios"][0]
    assert (ratio["engine"], ratio["vs"]) == ("hybridpar", "recipe") and ratio["tokens_per_s"] > 0
    # Same weights, same batches, same math: the losses agree to fp32 rounding (printed at the end).
    diffs = {}
    for kind, a, b in (("paired", hybrid["runs"][0], recipe["runs"][0]), ("alone", hybrid["memory_run"], recipe["memory_run"])):
        diffs |= {f"{kind} step {i}": abs(x - y) / abs(y) for i, (x, y) in enumerate(zip(a["losses"], b["losses"]))}
    check_close("hybridpar vs recipe losses", diffs, 1e-5)
    assert ratio["loss_max_rel_diff"] == max(diffs.values())


@pytest.mark.slow
def test_context_parallel_bench_measures_what_cp_saves(tmp_path):
    """bench/context_parallel.py at world 2 on the debug preset: at cp 1 the measured activations are
    the planner's (a few scalars aside); at cp 2 each rank holds half the tokens, so well under cp 1's."""
    out = tmp_path / "cp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "bench" / "context_parallel.py"), "--preset", "debug", "--seq-lens", "256", "--cps", "1,2",
         "--rounds", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["cp"]: r for r in json.loads(out.read_text())["rows"]}
    assert abs(rows[1]["activations"] / rows[1]["planned"] - 1) < 1e-4
    assert 0.4 < rows[2]["activation_ratio"] < 0.8, rows[2]
    assert rows[2]["activations"] >= rows[2]["planned"], rows[2]
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert "planned" in proc.stdout


@pytest.mark.slow
def test_float8_bench_trains_each_recipe_and_prices_its_emulation(tmp_path):
    """bench/float8.py as bench/README.md runs it, at world 2 (the local job at mp 2) and one step
    a run: each recipe's validation loss against bf16's, and its step time in an interleaved round."""
    out = tmp_path / "float8.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "bench" / "float8.py"), "--steps", "1", "--rounds", "1", "--timing-steps", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["recipe"]: r for r in report["rows"]}
    assert list(rows) == ["none", "tensorwise", "rowwise"] and report["layout"] == "mp 2 x dp 1"
    assert rows["none"]["val_ratio"] == rows["none"]["step_ratio"] == 1.0
    for r in rows.values():
        assert r["val_loss"] > 0 and r["step_s"] > 0 and len(r["step_ratios"]) == 1
    # float8 trained (its numbers are not bf16's), from the same weights and data (close to them)
    assert len({r["final_train_loss"] for r in rows.values()}) == 3
    assert all(abs(r["val_ratio"] - 1) < 0.05 for r in rows.values())
    assert "not a speed" in proc.stdout


@pytest.mark.slow
def test_experts_bench_trains_ep1_and_ep2_and_times_the_exchange(tmp_path):
    """bench/experts.py in its tiny mode (debug_llama4, one pair of one-step runs, one GEMM size):
    ep 1 and ep 2 train to the same losses, ep 2 holds half the experts per rank and spends part of
    its step in the all-to-all, and the grouped GEMM equals the loop exactly in fp32."""
    out = tmp_path / "experts.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "experts.py"), "--shape", "debug_llama4", "--micro-batch", "2",
         "--seq-len", "32", "--pairs", "1", "--steps", "1", "--gemm-experts", "4", "--gemm-tokens", "64",
         "--gemm-repeats", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ep1, ep2 = report["summary"]["1"], report["summary"]["2"]
    assert [r["ep"] for r in report["runs"]] == [1, 2] and ep1["tokens_per_s"] > 0 and ep2["tokens_per_s"] > 0
    assert report["loss_max_rel_diff_ep1_ep2"] < 1e-5
    # debug_llama4: 2 MoE layers of 4 experts, w1 w3 [32, 64] and w2 [64, 32] each, fp32; ep 2 halves them
    experts = 2 * 4 * 3 * 32 * 64 * 4
    assert ep2["expert_parameters_per_rank"] == [experts // 2] * 2, ep2
    assert all(0 < share < 1 for share in ep2["exchange_share_per_rank"]) and "exchange_share_per_rank" not in ep1
    assert all(rss > 0 for rss in ep1["peak_rss_train_per_rank"] + ep2["peak_rss_train_per_rank"])
    rows = {r["dtype"]: r for r in report["gemm"]}
    assert set(rows) == {"float32", "bfloat16"} and rows["float32"]["max_abs_diff"] == 0
    assert all(r["grouped_s"] > 0 and r["loop_s"] > 0 for r in rows.values())
    assert "not a GPU" in proc.stdout
