"""`hybridpar plan` with context parallelism (parallel.cp, hybridpar.parallel.context): the terms it
prices by hand, the long-context plans it finds, the short-context plans it leaves as they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.models.args import ModelArgs
from hybridpar.plan import Hardware, Layout, Workload, activation_bytes, collective_bytes, estimate, make_plan
from hybridpar.plan.compute import micro_batch_work
from hybridpar.plan.hardware import spec
from hybridpar.plan.memory import gathered_kv_bytes, param_counts
from hybridpar.plan.report import config_flags, plan_json

S = 131072


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    from hybridpar.cli import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_layout_counts_cp_in_its_world_its_shard_group_and_its_name():
    lay = Layout(8, 1, 2, "full", cp=4)
    assert (lay.world, lay.dp, lay.fsdp_shard) == (64, 2, 4)
    # The cp ranks of a dp coordinate share parameters: FSDP shards over them even at dp_shard 1.
    assert lay.strategy == "hybrid_shard" and Layout(8, 1, 1, cp=4).strategy == "full_shard"
    assert lay.name == "mp8_cp4_dp2" and Layout(8, 1, 2).name == "mp8_dp2"
    assert lay.describe().startswith("mp 8 x cp 4 x dp_shard 1 x dp_replicate 2")


def test_context_parallel_terms_by_hand():
    """Llama 3.1 70B at 131,072 tokens, mp 8 x cp 4 x dp_shard 2, no AC: each term from its formula."""
    args = ModelArgs.from_preset("llama3.1_70b")
    hw = Hardware(gpus=64, gpu_mem_gib=80, intra_node_busbw=100e9, inter_node_busbw=10e9)
    w = Workload(seq_len=S, global_batch=8)
    lay, L, cp = Layout(8, 2, 1, "none", cp=4), args.n_layers, 4
    e = estimate(args, lay, w, hw)
    # One layer's K|V of the whole sequence: 8 kv heads / mp 8 = 1 head of 128, K and V, bfloat16.
    kv = gathered_kv_bytes(args, 8, 1, S, 2)
    assert kv == S * 1 * 2 * 128 * 2
    # Activations: the cp 1 ones of S / cp tokens, but the attention keeps the gathered K|V, not the local k, v.
    local = activation_bytes(args, 8, 1, S // cp, 2, 0, True)
    mine = activation_bytes(args, 8, 1, S, 2, 0, True, cp)
    assert mine.per_block == local.per_block - 2 * (S // cp) * 2 * 128 + kv
    assert mine.saved == pytest.approx(local.saved + L * (kv - 2 * (S // cp) * 2 * 128))
    assert e.memory.activations == mine.saved
    # Parameters and optimizer state: sharded over dp_shard x cp = 8 ranks.
    assert e.memory.params == param_counts(args, 8, 8).sharded * 4
    # The collectives: a K|V all-gather and a dK|dV reduce-scatter per block, over 4 ranks 8 apart
    # (a 32-rank cp x mp block: between nodes), (n - 1) / n of the gathered bytes each.
    comm = collective_bytes(args, lay, w)
    assert (comm.cp_all_gather, comm.cp_reduce_scatter, comm.cp_calls) == (L * kv, L * kv, 2 * L)
    assert e.grad_accum == 4 and e.global_batch == 8  # the batch counts dp coordinates, not cp ranks
    assert e.time.cp_comm == pytest.approx(e.grad_accum * 2 * L * kv * 3 / 4 / 10e9)
    assert e.time.cp_exposed == e.time.cp_comm  # hybridpar.parallel.context waits for each
    # mp 2 x cp 4 fits a node of 8: NVLink.
    inside = estimate(args, Layout(2, 8, 1, "none", cp=4), w, hw)
    assert inside.time.cp_comm == pytest.approx(inside.grad_accum * 2 * L * gathered_kv_bytes(args, 2, 1, S, 2)
                                                * 3 / 4 / 100e9)
    # The kernels: matmuls and attention are the cp 1 ones divided by cp (the chunks balance the causal work).
    plain, split = micro_batch_work(args, Layout(8, 2, 1, "none"), w), micro_batch_work(args, lay, w)
    assert split.attention_flops == pytest.approx(plain.attention_flops / cp)
    assert split.gemm_flops == pytest.approx(plain.gemm_flops / cp)
    assert e.time.step == pytest.approx(e.time.compute + e.time.tp_comm + e.time.cp_exposed + e.time.dp_exposed)
    # Tokens per GPU count every GPU, the cp ones too.
    assert e.tokens_per_s_per_gpu == pytest.approx(8 * S / e.time.step / 64)
    # A recomputed block gathers K|V again; its backward reduce-scatters once.
    full = collective_bytes(args, Layout(8, 2, 1, "full", cp=4), w)
    assert (full.cp_all_gather, full.cp_reduce_scatter) == (2 * L * kv, L * kv)


def test_llama31_70b_at_128k_tokens_on_256_h100_finds_layouts_with_cp(capsys):
    """The issue's failure on main: 'no layout fits ... more GPUs will not do'."""
    code, out, err = _run(capsys, "--model", "llama3.1_70b", "--gpus", "256", "--gpu", "h100", "--seq-len", str(S),
                          "--global-batch", "16Mtok")
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "layout"])
    assert "cp s" in lines[header]
    first = lines[header + 1].split()
    assert first[1].startswith("mp8_cp"), out
    assert any(line.startswith("best: mp 8 x cp ") for line in lines)
    assert "  context parallelism: each GPU holds " in out and "--parallel.cp " in out
    assert "assumed: context parallelism:" in out
    # docs/planner.md shows this plan's first rows: they must be today's.
    page = (Path(__file__).resolve().parent.parent / "docs" / "planner.md").read_text().splitlines()
    stale = [line for line in lines[header:header + 3] if line not in page]
    assert not stale, f"docs/planner.md's long-context example differs from the output: {stale}"
    plan = make_plan(ModelArgs.from_preset("llama3.1_70b"), Workload(seq_len=S, global_batch=128), spec("h100", 256))
    assert plan.fitting and all(e.layout.cp > 1 for e in plan.fitting)
    best = plan.fitting[0]
    assert best.tokens_per_step == 16 * 2**20 and best.memory.total <= best.usable_bytes
    assert plan_json(plan)["layouts"][0]["cp"] == best.layout.cp and "--parallel.cp" in plan_json(plan)["best"]
    # The cp line weighs the collectives against the attention they could hide behind.
    attention = best.grad_accum * micro_batch_work(plan.args, best.layout, plan.workload).attention_flops / (
        plan.hardware.peak_flops * plan.hardware.attention_efficiency)
    assert f"{100 * best.time.cp_comm / attention:.0f}% of the attention's" in out


def test_llama31_8b_at_128k_tokens_on_8_h100_finds_several_layouts():
    """On main 1 of 30 layouts fits (mp 8, full AC) at 48.5 GiB; cp is faster, and gives more."""
    plan = make_plan(ModelArgs.from_preset("llama3.1_8b"), Workload(seq_len=S), spec("h100", 8))
    assert plan.context_parallel and len(plan.fitting) > 1
    # find names a cp: mp 1 over 8 GPUs without cp needs more than the card, at cp 4 x dp_shard 2 it fits.
    without = plan.find(1, 8, 1)
    assert without and not any(e.fits for e in without) and plan.find(1, 2, 1, "full", cp=4)[0].fits
    no_cp = [e for e in plan.fitting if e.layout.cp == 1]
    assert plan.fitting[0].layout.cp > 1
    assert plan.fitting[0].tokens_per_s_per_gpu > max(e.tokens_per_s_per_gpu for e in no_cp)


@pytest.mark.parametrize("preset, gpus, gpu, batch, fitting, layouts, tokens, gib", [
    ("llama3_70b", 128, "h100", 512, 4, 78, 768, 73.5),  # README.md's and docs/planner.md's example
    ("llama3_8b", 16, "a100", 0, 31, 42, 3482, 54.6),  # docs/development.md's
])
def test_short_context_plans_stay_without_cp(preset, gpus, gpu, batch, fitting, layouts, tokens, gib):
    args = ModelArgs.from_preset(preset)
    plan = make_plan(args, Workload(seq_len=8192, global_batch=batch), spec(gpu, gpus))
    assert not plan.context_parallel and all(e.layout.cp == 1 for e in plan.estimates)
    assert (len(plan.fitting), len(plan.estimates)) == (fitting, layouts)
    best = plan.fitting[0]
    assert round(best.tokens_per_s_per_gpu) == pytest.approx(tokens, abs=1)
    assert round(best.memory.total / 2**30, 1) == gib
    assert "--parallel.cp" not in config_flags(best, plan.workload)
    # --cp N prices it anyway: cp 2 costs its collectives here.
    forced = make_plan(args, Workload(seq_len=8192, global_batch=batch), spec(gpu, gpus), cp=2)
    assert forced.context_parallel and all(e.layout.cp == 2 for e in forced.estimates)
    assert "--parallel.cp 2" in config_flags(forced.fitting[0], forced.workload)


def test_when_activations_alone_do_not_fit_the_remedy_is_cp_until_it_cannot_grow(capsys):
    code, out, _ = _run(capsys, "--model", "llama3.1_70b", "--gpus", "256", "--gpu", "h100", "--seq-len", str(S),
                        "--global-batch", "16Mtok", "--cp", "1", "--pp", "1")  # (pipeline stages would fit it)
    assert code == 1 and "no layout fits" in out, out
    assert "context parallelism: activations and buffers alone need" in out and "more GPUs will not do" not in out
    # cp 2 on the same 256 GPUs (dp_shard 32 -> 16) is enough: the plan without --cp finds it.
    assert "at cp 1; cp 2 on 256 GPUs cuts each sequence over 2 GPUs" in out, out
    # A sequence 2 x cp never divides (odd): without pipeline stages (whose layers split the activations
    # too, even one micro-batch at a time) nothing cuts it, more GPUs will not do.
    code, out, _ = _run(capsys, "--model", "llama3.1_70b", "--gpus", "256", "--gpu", "h100", "--seq-len", "131071",
                        "--no-sequence-parallel", "--pp", "1")
    assert code == 1 and "more GPUs will not do: activations and buffers alone need" in out, out


def test_a_cp_no_layout_can_take_is_one_line(capsys):
    code, _, err = _run(capsys, "--model", "llama3.1_8b", "--gpus", "8", "--gpu", "h100", "--seq-len", str(S),
                        "--cp", "3")
    assert code == 2 and "cp = 3 fits no layout of 8 GPUs" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _run(capsys, "--model", "llama3.1_8b", "--gpus", "8", "--cp", "-1")
    assert code == 2 and "cp must be 1 or more" in err and len(err.strip().splitlines()) == 1, err


# --- measured: what hybridpar.parallel.context keeps for backward ------------------------------


def _case_saved_attention(cp: int, seq_len: int) -> dict:
    """Bytes autograd keeps from context_attention's forward on this rank, by dtype (unique storages)."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from hybridpar.parallel.context import context_attention
    from tests.distributed import parallel_dims

    group = parallel_dims(mp=cp).mp_group  # cp contiguous ranks stand in for the mesh's cp group
    gen = torch.Generator().manual_seed(0)
    local = seq_len // cp
    q = torch.randn(1, local, 4, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, local, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    saved: dict = {}

    def pack(t):
        # Everything saved: a [c, end] mask of the lower-right causal triangle would show here (SDPA
        # given causal_lower_right on the CPU saves one; context.py's CPU path makes none).
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        context_attention(q, k, v, group).sum()
    by_dtype: dict = {}
    for nbytes, dtype in saved.values():
        by_dtype[str(dtype)] = by_dtype.get(str(dtype), 0) + nbytes
    return by_dtype


@pytest.mark.parametrize("cp", [2, 4])
def test_the_planners_attention_bytes_are_what_context_attention_keeps(workers, cp):
    """q, the gathered K|V, each chunk's output and logsumexp, as the planner counts them for a block's
    attention (4 heads, 2 kv heads of 16, float32), on every rank, and nothing else: no causal mask."""
    seq_len = 64
    args = ModelArgs.from_preset("tiny", n_heads=4, n_kv_heads=2, dim=64)
    assert args.head_dim == 16
    local = seq_len // cp
    planned = 4 * local * 16 * 2 * 4 + gathered_kv_bytes(args, 1, 1, seq_len, 4) + 4 * local * 4
    for measured in workers(4).run(_case_saved_attention, cp, seq_len):
        assert measured == {"torch.float32": planned}, measured
