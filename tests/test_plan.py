"""`hybridpar plan`: its memory and communication model against the real code on CPU, and its
choices at scale.

The measured side runs models/llama.py as hybridpar.build.build_model builds it, on 4 gloo ranks
and counts, per rank:
  - parameters, gradients and AdamW moments: the bytes of the local shards (as bench/memory.py);
  - activations: the unique storages autograd saves during one forward + loss (a saved-tensors
    hook), parameters excluded, sized at the end of forward, with and without checkpointing;
  - the unsharded gradients FSDP keeps alive between accumulation micro-batches;
  - the bytes handed to every collective in one forward + backward, by mesh group.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import parallel_dims

ROOT = Path(__file__).resolve().parent.parent
# The issue asks for 20%. The estimate is derived from the code and matches to a few bytes, so the
# test holds it to 2%: a change to the model's saved tensors must come with a change to plan.py.
TOLERANCE = 0.02


# --- measured on the real model --------------------------------------------------------------


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _sharded_model(overrides: dict, mp: int, dp_shard: int, dp_replicate: int, ac: str, param_dtype: str,
                   sp: bool = False):
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.build import build_model
    from hybridpar.models.args import ModelArgs

    parallel = parallel_dims(mp=mp, dp_shard=dp_shard, dp_replicate=dp_replicate)
    args = ModelArgs.from_preset("tiny", **overrides)
    torch.manual_seed(0)
    strategy = "hybrid_shard" if dp_replicate > 1 else "full_shard"
    # FSDP's own all-gather and reduce-scatter: the planner models the collectives nccl runs.
    model = build_model(args, parallel, sequence_parallel=sp, fsdp=FSDPConfig(
        sharding_strategy=strategy, param_dtype=param_dtype, activation_checkpointing=ac, gloo_all_to_all=False))
    return args, parallel, model


def _batch(args, parallel, micro_batch: int, seq_len: int):
    tokens = torch.randint(0, args.vocab_size, (micro_batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(1 + parallel.dp_rank))
    return tokens[:, :-1], tokens[:, 1:]


def _case_measure(overrides: dict, mp: int, dp_shard: int, ac: str, micro_batch: int, seq_len: int,
                  param_dtype: str, sp: bool) -> dict:
    from torch.autograd.graph import saved_tensors_hooks
    from torch.distributed.tensor import DTensor

    from hybridpar.parallel import vocab_parallel_cross_entropy

    args, parallel, model = _sharded_model(overrides, mp, dp_shard, 1, ac, param_dtype, sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    inputs, targets = _batch(args, parallel, micro_batch, seq_len)

    def loss_fn():
        return vocab_parallel_cross_entropy(model(inputs), targets, parallel=parallel)

    loss_fn().backward()  # one step, so that AdamW's moments exist
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Parameters in use are the gathered ones registered on their modules at this moment.
        params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                  for p in model.parameters()}
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    # Sized now, when backward would start.
    activations = sum(s.nbytes() for s in saved.values())
    saved.clear()
    loss.backward()
    params = list(model.parameters())
    measured = {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(v) for state in optimizer.state.values()
                         for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")),
        "activations": activations,
    }
    optimizer.zero_grad(set_to_none=True)

    # Gradient accumulation: what a micro-batch without gradient sync leaves alive for the next one.
    model.set_requires_gradient_sync(False)
    loss_fn().backward()
    measured["accumulated_grads"] = sum(_local_bytes(g) for g in _unsharded_grads(model))
    model.set_requires_gradient_sync(True)
    loss_fn().backward()  # the last micro-batch reduces and frees them
    optimizer.zero_grad(set_to_none=True)
    return measured


def _unsharded_grads(model) -> list:
    """The unsharded gradients FSDP2 keeps between micro-batches without gradient sync: per
    parameter, the reduce-dtype accumulator when there is one, else the unsharded parameter's grad."""
    from torch.distributed.fsdp import FSDPModule

    grads = []
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group else []:
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None:
                grad = getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)
            if grad is not None:
                grads.append(grad)
    return grads


def _case_count_collectives(overrides: dict, mp: int, dp_shard: int, dp_replicate: int, ac: str,
                            micro_batch: int, seq_len: int, sp: bool) -> dict:
    """Bytes given to each collective in one forward + backward (gradient sync on), and the calls,
    by mesh group."""
    import torch.distributed as dist

    from hybridpar.parallel import vocab_parallel_cross_entropy

    args, parallel, model = _sharded_model(overrides, mp, dp_shard, dp_replicate, ac, "float32", sp)
    inputs, targets = _batch(args, parallel, micro_batch, seq_len)

    def step():
        vocab_parallel_cross_entropy(model(inputs), targets, parallel=parallel).backward()
        model.zero_grad(set_to_none=True)

    step()  # FSDP's lazy initialisation happens here, uncounted
    groups = {name: tuple(dist.get_process_group_ranks(getattr(parallel, f"{name}_group")))
              for name in ("mp", "dp_shard", "dp_replicate")}
    counted: collections.Counter = collections.Counter()
    # (function, the argument that nccl-tests sizes it by: the tensor, the gathered output, the unreduced input)
    sized_by = {"all_reduce": (0, "tensor"), "all_gather_single": (0, "output_tensor"),
                "reduce_scatter_single": (1, "input")}
    originals = {name: getattr(dist, name) for name in sized_by}

    def counting(name):
        def call(*a, **kw):
            position, keyword = sized_by[name]
            tensor = a[position] if len(a) > position else kw[keyword]
            ranks = tuple(dist.get_process_group_ranks(kw["group"])) if kw.get("group") is not None else None
            if ranks is not None and len(ranks) > 1:
                kind = next((g for g, members in groups.items() if members == ranks), str(ranks))
                counted[f"{name} {kind}"] += tensor.numel() * tensor.element_size()
                counted[f"calls {kind}"] += 1
            return originals[name](*a, **kw)
        return call

    import os

    from hybridpar import fastpaths

    # The collectives nccl runs: on gloo the fast path would send sequence parallelism's as all-to-alls.
    os.environ[fastpaths.ENV] = "0"
    try:
        for name in sized_by:
            setattr(dist, name, counting(name))
        step()
    finally:
        os.environ.pop(fastpaths.ENV)
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return dict(counted)


# --- the planner's side ---------------------------------------------------------------------------


def _workload(layout, micro_batch: int, seq_len: int, param_dtype: str):
    from hybridpar.plan import Workload

    # Two micro-batches per step, so that the accumulated gradients are counted.
    return Workload(seq_len=seq_len, micro_batch=micro_batch, global_batch=2 * layout.dp * micro_batch,
                    param_dtype=param_dtype, reduce_dtype="float32")


CASES = [  # (model overrides, mp, dp_shard, micro_batch, seq_len, FSDP param_dtype, sequence parallel)
    ({}, 2, 2, 2, 128, "float32", False),
    ({"n_kv_heads": 2}, 4, 1, 2, 64, "float32", False),  # mp 4 > 2 kv heads: wk, wv replicated on every mp rank
    ({}, 2, 2, 2, 128, "bfloat16", False),  # the default mixed precision: bf16 compute, fp32 master and reduce
    ({"tie_embeddings": True}, 2, 2, 2, 128, "float32", False),  # no output head parameters; the logits stay
    # Sequence parallelism: norms on T/mp tokens, the linears save the all-gathered input.
    ({}, 2, 2, 2, 128, "bfloat16", True),
    ({"n_kv_heads": 2, "embedding_split": "dim"}, 4, 1, 2, 64, "float32", True),
    # A mixture of experts (plan.experts): 4 experts top-2 and a shared expert on layers 1 and 3, dense 0 and 2.
    ({"n_experts": 4, "experts_per_token": 2, "moe_layers": [1, 3], "expert_hidden_size": 128}, 2, 2, 2, 128,
     "float32", False),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,mp,dp_shard,micro_batch,seq_len,param_dtype,sp", CASES)
@pytest.mark.parametrize("ac", ["none", "full"])
def test_memory_estimate_matches_measured(workers, check_close, overrides, mp, dp_shard, micro_batch, seq_len,
                                         param_dtype, sp, ac):
    from hybridpar.plan import Hardware, Layout, estimate
    from hybridpar.models.args import ModelArgs

    measured_per_rank = workers(4).run(_case_measure, overrides, mp, dp_shard, ac, micro_batch, seq_len, param_dtype,
                                       sp)
    layout = Layout(mp, dp_shard, 4 // (mp * dp_shard), ac, sequence_parallel=sp)
    est = estimate(ModelArgs.from_preset("tiny", **overrides), layout,
                   _workload(layout, micro_batch, seq_len, param_dtype), Hardware(gpus=4, gpu_mem_gib=80))
    assert est.grad_accum == 2
    modelled = {"params": est.memory.params, "grads": est.memory.grads, "optimizer": est.memory.optimizer,
                "activations": est.memory.activations, "accumulated_grads": est.memory.accumulated_grads}
    print(f"\n{layout.describe()}, {param_dtype}, {overrides or 'tiny'}:")
    errors = {}
    for key, value in modelled.items():
        worst = max(m[key] for m in measured_per_rank)
        errors[key] = abs(value - worst) / worst
        print(f"  {key:<17} measured {worst:>12,} B  estimated {value:>12,.0f} B  error {100 * errors[key]:.2f}%")
    check_close("memory estimate vs measured", errors, TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("overrides,mp,dp_shard,dp_replicate,ac,sp", [
    ({}, 2, 2, 1, "full", False),  # tensor parallel + FSDP, with the recomputation's all-reduces
    ({"n_kv_heads": 2}, 4, 1, 1, "none", False),  # replicated kv heads: their weight gradients are all-reduced
    ({}, 1, 2, 2, "none", False),  # hybrid sharding: reduce-scatter, then all-reduce across replicas
    ({"tie_embeddings": True}, 2, 2, 1, "none", False),  # the shared weight in the root unit, the head's all-reduce
    # Sequence parallelism: all-gathers and reduce-scatters along the sequence, the recomputation's,
    # the norm weights' gradient all-reduces; with the embedding split on dim (Llama 2).
    ({}, 2, 2, 1, "full", True),
    ({"n_kv_heads": 2, "embedding_split": "dim"}, 4, 1, 1, "none", True),
])
def test_communication_bytes_match_the_collectives_issued(workers, overrides, mp, dp_shard, dp_replicate, ac, sp):
    from hybridpar.plan import Layout, collective_bytes
    from hybridpar.models.args import ModelArgs

    micro_batch, seq_len = 2, 64
    counted = workers(4).run(_case_count_collectives, overrides, mp, dp_shard, dp_replicate, ac, micro_batch, seq_len,
                             sp)
    assert all(c == counted[0] for c in counted), counted
    layout = Layout(mp, dp_shard, dp_replicate, ac, sequence_parallel=sp)
    comm = collective_bytes(ModelArgs.from_preset("tiny", **overrides), layout,
                            _workload(layout, micro_batch, seq_len, "float32"))
    # One micro-batch with gradient sync: every per-micro-batch and per-step term once.
    modelled = {"all_reduce mp": comm.tp_all_reduce, "all_gather_single mp": comm.tp_all_gather,
                "reduce_scatter_single mp": comm.tp_reduce_scatter, "all_gather_single dp_shard": comm.fsdp_all_gather,
                "reduce_scatter_single dp_shard": comm.fsdp_reduce_scatter,
                "all_reduce dp_replicate": comm.replica_all_reduce, "calls mp": comm.tp_calls,
                "calls dp_shard": comm.fsdp_gather_calls + comm.fsdp_reduce_calls, "calls dp_replicate": comm.replica_calls}
    modelled = {k: v for k, v in modelled.items() if v}
    print(f"\n{layout.describe()}: {counted[0]}")
    assert counted[0] == pytest.approx(modelled, rel=0), (counted[0], modelled)


def _case_count_ops(mp: int, dp_shard: int, sp: bool) -> int:
    """Ops dispatched in one training step of the trainer's pieces: forward, loss, backward, clipping,
    the optimizer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridpar.config import OptimConfig
    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.train.optim import build_optimizer, grad_norm_and_clip

    args, parallel, model = _sharded_model({}, mp, dp_shard, 1, "none", "float32", sp)
    optimizer = build_optimizer(model, OptimConfig(), fused=True)
    params = list(model.parameters())
    inputs, targets = _batch(args, parallel, 2, 64)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def step():
        vocab_parallel_cross_entropy(model(inputs), targets, parallel=parallel).backward()
        grad_norm_and_clip(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # lazy initialisation and AdamW's state, uncounted
    with Count():
        step()
    return Count.ops


@pytest.mark.parametrize("mp,dp_shard,sp", [(1, 2, False), (2, 1, True)])
def test_op_counts_match_the_code(workers, mp, dp_shard, sp):
    """The host's cost per op matters on a CPU: the planner's count of ops against the real step's."""
    from hybridpar.plan import Layout, Workload, collective_bytes
    from hybridpar.plan.compute import micro_batch_work, step_work
    from hybridpar.models.args import ModelArgs

    counted = max(workers(2).run(_case_count_ops, mp, dp_shard, sp))
    args, layout = ModelArgs.from_preset("tiny"), Layout(mp, dp_shard, 1, "none", sequence_parallel=sp)
    workload = Workload(seq_len=64, micro_batch=2, param_dtype="float32")
    comm = collective_bytes(args, layout, workload)
    planned = (micro_batch_work(args, layout, workload, comm.tp_calls).ops
               + step_work(args, layout, workload, 2, 1, comm.fsdp_gather_calls + comm.fsdp_reduce_calls).ops)
    print(f"\n{layout.describe()}: {counted} ops counted, {planned:.0f} planned ({planned / counted - 1:+.1%})")
    assert abs(planned / counted - 1) < 0.15


def test_flops_match_the_trainers_mfu_count():
    from hybridpar.plan import flops_per_token
    from hybridpar.train.metrics import flops_per_token as trainer_flops
    from hybridpar.models.args import ModelArgs

    for preset in ("tiny", "llama2_7b", "llama3_70b"):
        args = ModelArgs.from_preset(preset)
        assert flops_per_token(args, 4096) == trainer_flops(args, 4096)


def test_tied_model_plans_its_parameters_once():
    from hybridpar.plan import MASTER_BYTES, Hardware, Layout, Workload, estimate, param_counts
    from hybridpar.models.args import ModelArgs

    args = ModelArgs.from_preset("llama3.2_1b")  # the output head reads the embedding's weight
    assert args.num_params() == 1_235_814_400
    counts = param_counts(args, 1, 1)
    assert counts.output == 0 and counts.total == counts.sharded == args.num_params()
    est = estimate(args, Layout(1, 1, 1, "none"), Workload(seq_len=2048, micro_batch=1, global_batch=1),
                   Hardware(gpus=1, gpu_mem_gib=80))
    assert est.memory.params == args.num_params() * MASTER_BYTES
    # The logits are still computed: the activations are the untied model's.
    untied = ModelArgs.from_preset("llama3.2_1b", tie_embeddings=False)
    assert est.memory.activations == estimate(untied, est.layout, Workload(seq_len=2048, micro_batch=1, global_batch=1),
                                              Hardware(gpus=1, gpu_mem_gib=80)).memory.activations


# --- choices at scale -----------------------------------------------------------------------------


def _plan(preset: str, gpus: int, gib: float, **workload):
    from hybridpar.plan import Hardware, Workload, make_plan
    from hybridpar.models.args import ModelArgs

    args = ModelArgs.from_preset(preset)
    return make_plan(args, Workload(**{"seq_len": min(args.max_seq_len, 8192), **workload}),
                     Hardware(gpus=gpus, gpu_mem_gib=gib))


def test_llama3_70b_on_128_gpus_fits_and_needs_mp8_at_a_4m_token_batch():
    plan = _plan("llama3_70b", 128, 80, global_batch=512)  # 512 x 8192 = 4M tokens, Llama 3's batch
    best = plan.fitting[0]
    assert best.memory.total <= best.usable_bytes
    # 32 accumulation micro-batches per step: FSDP keeps the unsharded fp32 gradients of the mp slice
    # between them (70.6B x 4 B / mp), which only mp 8 brings under 80 GB.
    assert best.grad_accum == 32 and best.layout.mp == 8 and best.layout.dp == 16
    assert best.memory.accumulated_grads == pytest.approx(70.55e9 * 4 / 8, rel=0.01)
    assert {e.layout.mp for e in plan.fitting} == {8}
    # Without activation checkpointing no layout of it fits: 80 blocks of 8192-token activations.
    assert all(e.layout.ac != "none" for e in plan.fitting)
    # mp 16 would split a tensor-parallel group over two nodes: refused unless asked for.
    assert "spans nodes" in plan.rejected[16]


def test_llama2_7b_on_8_gpus():
    plan = _plan("llama2_7b", 8, 80)
    assert plan.fitting, "a 7B model must fit on 8 GPUs of 80 GB"
    best = plan.fitting[0]
    assert best.memory.total <= best.usable_bytes and best.layout.world == 8
    # Everything inside one node: fast collectives, and nothing is rejected for spanning nodes.
    assert not plan.rejected
    # More memory is never faster to need: each layout without AC needs more than the same with full AC.
    by_key = {(e.layout.mp, e.layout.dp_shard, e.layout.dp_replicate, e.layout.ac): e for e in plan.estimates}
    for (mp, ds, dr, ac), e in by_key.items():
        if ac == "none":
            full = by_key[(mp, ds, dr, "full")]
            assert e.memory.activations > full.memory.activations and e.time.step < full.time.step


def test_step_time_arithmetic_by_hand():
    """mp 8 x dp 16 for Llama 3 70B, one micro-batch, no AC: the terms recomputed from the formulas."""
    from hybridpar.plan import Hardware, Layout, Workload, estimate
    from hybridpar.plan.compute import micro_batch_work, step_work
    from hybridpar.models.args import ModelArgs

    args = ModelArgs.from_preset("llama3_70b")
    hw = Hardware(gpus=128, gpu_mem_gib=80, intra_node_busbw=100e9, inter_node_busbw=10e9, peak_flops=1e15,
                  gemm_efficiency=0.5, attention_efficiency=0.25, memory_bw=2e12, memory_efficiency=0.5)
    layout, workload = Layout(8, 16, 1, "none", sequence_parallel=False), Workload(seq_len=4096)
    e = estimate(args, layout, workload, hw)
    tokens, act = 4096, 4096 * 8192 * 2
    work = micro_batch_work(args, layout, workload)
    # The matmuls: 6 FLOPs per weight and token (forward, input and weight gradients), 1/8 each;
    # the embedding and the norms' weights are not matmuls.
    matmul_weights = args.num_params() - 128256 * 8192 - (2 * 80 + 1) * 8192
    assert work.gemm_flops == pytest.approx(6 * matmul_weights * tokens / 8, rel=1e-12)
    # Flash attention: the causal half of the scores and values, 2 + 2 x 2.5 (backward recomputes them).
    assert work.attention_flops == pytest.approx(80 * 3.5 * 2 * tokens * 4096 * 8192 / 8)
    compute = (work.gemm_flops / 0.5e15 + work.attention_flops / 0.25e15 + work.memory_bytes / 1e12
               + step_work(args, layout, workload, 2, 1, 0).memory_bytes / 1e12)
    assert e.time.compute == pytest.approx(compute)
    # 4 all-reduces per block, the head's and the embedding's, 2(n-1)/n of each over NVLink.
    tp = (act * (4 * 80 + 2) + 3 * tokens * 4) * 2 * 7 / 8 / 100e9
    assert e.time.tp_comm == pytest.approx(tp)
    # dp_shard groups (16 ranks, 8 apart) leave the node: inter-node bandwidth, (n-1)/n of the data.
    # bf16 all-gathers of the mp slice in forward and again in backward (but for the embedding and the
    # output head, kept gathered), then one fp32 reduce-scatter; the slice is ~1/8 of the model.
    local, head = args.num_params() / 8, 128256 * 8192 / 8
    dp = ((2 * local - 2 * head) * 2 + local * 4) * 15 / 16 / 10e9
    assert e.time.dp_comm == pytest.approx(dp, rel=1e-3)
    busy = work.seconds(hw) + tp
    assert e.time.step == pytest.approx(e.time.compute + e.time.tp_comm + max(0.0, e.time.dp_comm - busy))


def test_recomputation_and_compilation_change_the_work_as_they_should():
    """Full AC adds exactly one forward of every block; compile cuts memory traffic, not FLOPs; the
    attention kernels execute 7/12 of what the MFU formula counts (causal half, backward 2.5x)."""
    from hybridpar.plan import Layout, Workload, flops_per_token
    from hybridpar.plan.compute import block_work, micro_batch_work
    from hybridpar.models.args import ModelArgs

    args = ModelArgs.from_preset("llama3.1_8b")
    w = Workload(seq_len=8192, micro_batch=2)
    plain = micro_batch_work(args, Layout(1, 8, 1, "none"), w)
    full = micro_batch_work(args, Layout(1, 8, 1, "full"), w)
    forward, _ = block_work(args, 1, 2 * 8192, 8192, 2, False, False)
    assert full.gemm_flops - plain.gemm_flops == pytest.approx(32 * forward.gemm_flops)
    assert full.attention_flops - plain.attention_flops == pytest.approx(32 * forward.attention_flops)
    counted = (flops_per_token(args, 8192) - 6 * (args.num_params() - args.vocab_size * args.dim)) * 2 * 8192
    assert plain.gemm_flops == pytest.approx(6 * (args.num_params() - args.vocab_size * args.dim - 65 * 4096) * 2 * 8192)
    assert plain.attention_flops == pytest.approx(counted * 7 / 12)
    compiled = micro_batch_work(args, Layout(1, 8, 1, "none"), Workload(seq_len=8192, micro_batch=2, compile=True))
    assert compiled.gemm_flops == plain.gemm_flops and compiled.attention_flops == plain.attention_flops
    print(f"\nmemory-bound bytes per micro-batch: eager {plain.memory_bytes / 1e9:.1f} GB, "
          f"compiled {compiled.memory_bytes / 1e9:.1f} GB")
    assert compiled.memory_bytes < 0.7 * plain.memory_bytes


def test_planner_against_published_runs():
    """torchtitan's H100 and A100 tables and the Llama 3 paper's 405B run: tokens/s per GPU within
    TOLERANCE (15%), every run without float8 or async TP among them; a row beyond it, and only such a
    row, says why, with reasons the run has (float8's on a float8 run, async TP's on an async TP run),
    and lies within 35% (tests/test_plan_float8.py: the float8 rows)."""
    from hybridpar.plan.published import OVER_ASYNC_TP, OVER_FLOAT8, TOLERANCE, compare, format_table

    rows = compare()
    print("\n" + format_table(rows))
    assert {"h100-500w", "h100", "a100"} <= {r.case.gpu for r in rows}
    for row in rows:
        w = row.case.workload
        assert bool(row.case.why) == (abs(row.error) > TOLERANCE) and abs(row.error) <= 0.35, row
        assert w.float8 != "none" or w.async_tp or abs(row.error) <= TOLERANCE, row
        assert (OVER_FLOAT8 not in row.case.why or w.float8 != "none") and (OVER_ASYNC_TP not in row.case.why
                                                                             or w.async_tp), row
    page = (ROOT / "docs" / "planner.md").read_text()  # its table shows today's figures
    stale = [r.case.name for r in rows
             if f"| {r.published:,.0f} | {r.planned:,.0f} | {100 * r.error:+.0f}% |" not in page]
    assert not stale, f"docs/planner.md's planner-versus-published table is out of date for {stale}"


def test_gpu_specs_state_their_figures_and_the_cli_names_them_all(capsys):
    from hybridpar.plan.hardware import GPUS, spec

    with pytest.raises(SystemExit):
        _run(capsys, "--help")
    choices = re.search(r"--gpu \{([^}]*)\}", capsys.readouterr().out)  # the help lists them: --gpu {a100,...}
    assert choices and set(choices[1].split(",")) == {*GPUS, "cpu"}
    for name, (description, fields) in GPUS.items():
        hw = spec(name, 8)
        assert {"peak_flops", "memory_bw", "intra_node_busbw", "inter_node_busbw", "gpu_mem_gib"} <= fields.keys()
        assert 0 < hw.gemm_efficiency <= 1 and 0 < hw.attention_efficiency <= 1 and "TFLOP/s" in description
    assert spec("h100", 8, gpu_mem_gib=94).gpu_mem_gib == 94
    with pytest.raises(ValueError, match="unknown --gpu 'v100'"):
        spec("v100", 8)
    code, out, _ = _run(capsys, "--published")
    assert code == 0 and "Llama 3 405B" in out and "pp16v8 x mp8" in out


def test_global_batch_parsing():
    from hybridpar.plan import parse_global_batch

    assert parse_global_batch("512", 8192) == 512
    assert parse_global_batch("4Mtok", 8192) == 512
    assert parse_global_batch("4M tokens", 4096) == 1024
    assert parse_global_batch("65536t", 4096) == 16
    for bad in ("4 sequences", "1000tok"):
        with pytest.raises(ValueError, match="global-batch"):
            parse_global_batch(bad, 4096)


# --- the command ------------------------------------------------------------------------------


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    """`hybridpar plan ...` in this process (tests/test_cli.py covers the `python -m hybridpar` entry)."""
    from hybridpar.cli import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_70b_plan_with_mp8_dp16(capsys):
    code, out, err = _run(capsys, "--model", "llama3_70b", "--gpus", "128", "--gpu", "h100", "--global-batch", "4Mtok")
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "layout"])
    first = lines[header + 1].split()
    # Sequence parallelism (the default) splits the norms' and residuals' activations by 8: checkpointing
    # every second block fits, where without it only full checkpointing does.
    assert first[:5] == ["1", "mp8_dp16", "8", "16", "1"] and first[5:7] == ["every", "2"], out
    assert any(line.startswith("best: mp 8 x dp_shard 16") for line in lines)
    assert "--parallel.mp 8" in out and "--train.grad_accum 32" in out
    # docs/planner.md shows this plan as its worked example: its table and breakdown must be today's.
    page = (ROOT / "docs" / "planner.md").read_text().splitlines()
    shown = lines[header:header + 3] + [line for line in lines if line.startswith(("best:", "  memory", "  step"))]
    stale = [line for line in shown if line not in page]
    assert not stale, f"docs/planner.md's worked example differs from the output: {stale}"


def test_cli_without_sequence_parallelism_needs_full_checkpointing(capsys):
    code, out, err = _run(capsys, "--model", "llama3_70b", "--gpus", "128", "--gpu-mem-gb", "80",
                          "--global-batch", "4Mtok", "--no-sequence-parallel")
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "layout"])
    assert lines[header + 1].split()[5] == "full", out
    assert "--parallel.sequence_parallel false" in out


def test_cli_says_clearly_when_nothing_fits_and_takes_a_params_json(capsys, tmp_path):
    code, out, _ = _run(capsys, "--model", "llama3.1_405b", "--gpus", "8", "--gpu-mem-gb", "80")
    assert code == 1
    assert "no layout fits: the smallest needs" in out and "Try: more GPUs (about" in out, out

    params = tmp_path / "params.json"  # Llama 2's params.json leaves the vocabulary to the tokenizer
    params.write_text((ROOT / "models" / "presets" / "llama2_7b.json").read_text().replace("32000", "-1"))
    code, _, err = _run(capsys, "--model", str(params), "--gpus", "8", "--gpu-mem-gb", "80")
    assert code == 2 and "vocab_size" in err and "--vocab-size" in err, err
    code, out, _ = _run(capsys, "--model", str(params), "--vocab-size", "32000", "--gpus", "8", "--gpu-mem-gb", "80")
    assert code == 0 and out.startswith("params.json: 6.7"), out
    code, _, err = _run(capsys, "--model", str(params), "--vocab-size", "32000", "--gpus", "8", "--gpu-mem-gb", "80",
                        "--micro-batch", "3", "--global-batch", "1000")
    assert code == 2 and "global batch 1000 is not a multiple" in err, err


@pytest.mark.slow
def test_cli_plans_on_this_cpu_measured(capsys):
    """--gpu cpu measures this machine (kernels here, then 2 gloo processes) and plans with it."""
    code, out, err = _run(capsys, "--model", "tiny", "--gpus", "2", "--gpu", "cpu", "--seq-len", "128",
                          "--micro-batch", "4", "--param-dtype", "float32")
    assert code == 0, err
    assert "measuring this machine" in out and "hardware: cpu, measured: " in out
    assert "GFLOP/s float32 matmul per core" in out and "per synchronising call" in out
    first = out.splitlines()[next(i for i, line in enumerate(out.splitlines()) if line.split()[:2] == ["#", "layout"]) + 1]
    assert 0.01 < float(first.split()[-5]) < 30, first  # a step of the tiny model: tens of ms to seconds
