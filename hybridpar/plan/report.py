"""The plan as text: the table of layouts, the best one's breakdown and config, what to change
when nothing fits; and the --global-batch syntax."""

from __future__ import annotations

import dataclasses
import math
import re

from ..config.dtypes import dtype_bytes
from .comm import group_busbw
from .compute import micro_batch_work
from .inputs import GIB, MASTER_BYTES, Hardware, Workload
from .memory import gathered_kv_bytes
from .search import Estimate, Plan, estimate, larger_cp, larger_mp

# The one line the report states when it considered context parallelism (plan.search prices it so).
CP_ASSUMED = ("context parallelism: each block's K|V all-gather and dK|dV reduce-scatter wait for their result "
              "(hybridpar.parallel.context gathers before the attention that needs it): compute hides none of them")

# The line a mixture of experts' plan states (plan.experts prices it so).
EXPERTS_ASSUMED = ("balanced routing (each GPU's experts get as many token slots as it sends); the all-to-alls wait "
                   "for their result (compute hides none); the experts' FSDP over the dp_shard / ep GPUs holding "
                   "them; the layers' other parts priced as a dense block of their mean feed-forward size")

_BATCH = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*(tok|tokens|t)?\s*$")


def parse_global_batch(text: str, seq_len: int) -> int:
    """'512' -> 512 sequences; '4Mtok' (or '4M tokens', '4194304t') -> tokens / seq_len sequences.
    K and M are 1024 and 1024**2."""
    m = _BATCH.match(str(text))
    if not m:
        raise ValueError(f"--global-batch {text!r}: write a number of sequences (512) or of tokens (4Mtok)")
    value = float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"--global-batch {text!r} is not a whole number")
    value = int(value)
    if m.group(3):
        if value % seq_len:
            raise ValueError(f"--global-batch {text!r} = {value} tokens is not a multiple of seq_len {seq_len}")
        value //= seq_len
    return value


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def _seconds(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def breakdown(e: Estimate, hw: Hardware, plan: "Plan | None" = None) -> list[str]:
    m, t = e.memory, e.time
    cp = f" + context-parallel {_seconds(t.cp_exposed)}" if e.layout.cp > 1 else ""
    if e.layout.pp > 1:
        cp += f" + pipeline sends {_seconds(t.pp_comm)} + bubble {_seconds(t.pp_bubble)}"
    if e.layout.ep > 1:
        cp += f" + all-to-all {_seconds(t.ep_comm)}"
    lines = [
        f"{e.layout.describe()}: {e.grad_accum} micro-batch(es) per step",
        f"  memory per GPU {_gib(m.total)} GiB of {_gib(e.usable_bytes)} usable: "
        f"params {_gib(m.params)} + grads {_gib(m.grads)} + AdamW {_gib(m.optimizer)}"
        f" + accumulated grads {_gib(m.accumulated_grads)} + gathered params {_gib(m.gathered_params)}"
        f" + grad buffers {_gib(m.grad_buffers)} + activations {_gib(m.activations)} + transient {_gib(m.transient)}"
        + (f" + allocator {_gib(m.allocator)}" if m.allocator else ""),
        f"  step {_seconds(t.step)} s: compute {_seconds(t.compute)} + tensor-parallel {_seconds(t.tp_comm)}{cp}"
        f" + exposed FSDP {_seconds(t.dp_exposed)} (of {_seconds(t.dp_comm)})"
        + (f" + compute on the SMs NCCL leaves {_seconds(t.dp_contention)}" if t.dp_contention else "") + "; "
        f"{e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * e.mfu(hw.peak_flops):.0f}%",
    ]
    if e.experts.expert_unit:
        lines.append("  " + experts_line(e, hw))
    if e.layout.cp > 1 and plan is not None:
        lay, w = e.layout, plan.workload
        kv = gathered_kv_bytes(plan.args, lay.mp, w.micro_batch, w.seq_len, dtype_bytes(w.param_dtype))
        link = "inside a node" if group_busbw(lay.mp, lay.cp, hw) == hw.intra_node_busbw else "between nodes"
        attention = e.grad_accum * micro_batch_work(plan.args, lay, w).attention_flops / (
            hw.peak_flops * hw.attention_efficiency)
        lines.append(f"  context parallelism: each GPU holds {w.seq_len // lay.cp} tokens of every sequence "
                     f"(2 chunks of {w.seq_len // (2 * lay.cp)}); per block {kv / 2**20:,.1f} MiB of K|V all-gathered "
                     f"over {lay.cp} GPUs {link}, and dK|dV reduce-scattered: {_seconds(t.cp_comm)} s per step, "
                     f"{100 * t.cp_comm / attention:.0f}% of the attention's {_seconds(attention)} s")
    return lines


def experts_line(e: Estimate, hw: Hardware) -> str:
    """A mixture of experts' share of e (plan.experts): the experts per rank, their state, the all-to-alls."""
    x, lay = e.experts, e.layout
    state = x.sharded * 4 * MASTER_BYTES  # fp32 parameters, gradients and AdamW's two moments
    line = (f"experts: {x.experts_per_rank} of each MoE layer's on a GPU (ep {lay.ep}), FSDP-sharded over "
            f"{x.expert_fsdp} GPU(s) holding the same ones, the rest over dp_shard {lay.fsdp_shard}: "
            f"{_gib(state)} GiB of the state")
    if lay.ep == 1:
        return line + "; no all-to-all at ep 1"
    sent = x.all_to_all_mb * e.grad_accum
    return (line + f"; all-to-all {sent / GIB:,.2f} GiB per step (dispatch and combine, forward and backward, "
            f"tokens x top-k x dim), {100 * x.leaving_share:.0f}% of it leaving the GPU "
            f"({(x.leaving_share * sent) / GIB:,.2f} GiB): {_seconds(e.time.ep_comm)} s")


def _header(width: int, cp: bool, ep: bool = False) -> str:
    return (f"{'#':>3} {'layout':<{width}} {'mp':>3} {'shard':>5} {'repl':>5} {'AC':<9} {'micro':>5} "
            f"{'state':>6} {'accum':>6} {'act':>6} {'other':>6} {'total':>6} {'step s':>7} {'tok/s/GPU':>10} "
            f"{'MFU':>5} {'tp s':>6}" + (f" {'cp s':>6}" if cp else "") + (f" {'a2a s':>6}" if ep else "")
            + f" {'fsdp s':>7}")


def _row(i: int, e: Estimate, hw: Hardware, width: int = 10, cp: bool = False, ep: bool = False) -> str:
    lay, m, t = e.layout, e.memory, e.time
    ac = {"none": "none", "full": "full", "selective": f"every {lay.ac_every}"}[lay.ac]
    ac += "" if lay.reshard_after_forward else " z2"
    other = m.total - m.state - m.accumulated_grads - m.activations
    return (f"{i:>3} {lay.name:<{width}} {lay.mp:>3} {lay.dp_shard:>5} {lay.dp_replicate:>5} {ac:<9} {e.grad_accum:>5} "
            f"{_gib(m.state):>6} {_gib(m.accumulated_grads):>6} {_gib(m.activations):>6} {_gib(other):>6} "
            f"{_gib(m.total):>6} "
            f"{_seconds(t.step):>7} {e.tokens_per_s_per_gpu:>10,.0f} {100 * e.mfu(hw.peak_flops):>4.0f}% "
            f"{_seconds(t.tp_comm):>6}" + (f" {_seconds(t.cp_exposed):>6}" if cp else "")
            + (f" {_seconds(t.ep_comm):>6}" if ep else "")
            + f" {_seconds(t.dp_exposed + t.dp_contention):>7}")


def format_plan(plan: Plan, top: int = 10, model_name: str = "", model_flags: str = "") -> str:
    """The report; `model_flags` (e.g. "--model.preset llama3_70b") starts the best layout's config line."""
    args, w, hw = plan.args, plan.workload, plan.hardware
    nodes = math.ceil(hw.gpus / hw.gpus_per_node)
    batch = (f"global batch {w.global_batch} sequences ({w.global_batch * w.seq_len / 2**20:.2f}M tokens)"
             if w.global_batch else "global batch = dp x micro-batch (no accumulation; --global-batch to fix it)")
    out = [
        f"{model_name or 'model'}: {args.num_params() / 1e9:.2f}B parameters{active_text(args, w.seq_len)}, {args.n_layers} "
        f"layers, dim {args.dim}, {args.n_heads} heads / {args.kv_heads} kv heads, vocab {args.vocab_size}",
        f"{hw.gpus} GPUs ({nodes} node(s) x {hw.gpus_per_node}) of {hw.gpu_mem_gib:g} GiB, "
        f"{hw.reserve_gib:g} GiB reserved; seq_len {w.seq_len}, micro-batch {w.micro_batch}, {batch}",
        f"hardware: {hw.name or 'custom'}",
        f"assumed: {hw.describe()}; busbw {hw.intra_node_busbw / 1e9:.3g} GB/s inside a node, "
        f"{hw.inter_node_busbw / 1e9:.3g} GB/s per GPU between nodes; float32 master weights, "
        f"{w.param_dtype} compute, {w.reduce_dtype} gradient reduction" + (", compiled blocks" if w.compile else ""),
        *([f"assumed: {allocator_assumed(hw)}"] if hw.allocator_overhead else []),
        *([f"assumed: {float8_assumed(w, hw)}"] if w.float8 != "none" else []),
        *([f"assumed: {CP_ASSUMED}"] if plan.context_parallel else []),
        *([f"assumed: {EXPERTS_ASSUMED}"] if args.n_experts else []),
        "",
    ]
    fitting = plan.fitting
    if fitting:
        out.append(f"{len(fitting)} of {len(plan.estimates)} layouts fit, the best first. GiB per GPU: state = float32 "
                   "params + grads + AdamW, accum = unsharded grads kept between micro-batches,")
        out.append("act = saved activations, other = gathered params, buffers, peaks, the allocator's reserve; "
                   "fsdp s = FSDP's time in the step (what compute does not hide, and the compute its NCCL kernels' "
                   "SMs slow); micro = micro-batches per step" + ("; a2a s = expert parallelism's all-to-alls." if args.n_experts else "."))
        shown = fitting[:top]
        width, cp = max(10, *(len(e.layout.name) for e in shown)), any(e.layout.cp > 1 for e in shown)
        ep = bool(args.n_experts)  # a2a s: expert parallelism's all-to-alls
        out.append(_header(width, cp, ep))
        out.extend(_row(i + 1, e, hw, width, cp, ep) for i, e in enumerate(shown))
        if len(fitting) > top:
            out.append(f"    ... {len(fitting) - top} more (--top N)")
        out.append("")
        out.append("best: " + "\n".join(breakdown(fitting[0], hw, plan)))
        if w.float8 != "none":
            out.append("  " + float8_gain(plan, fitting[0]))
        out.append("  config: " + config_flags(fitting[0], w, model_flags))
    else:
        out.append(no_fit_message(plan))
    too_big = [e for e in plan.estimates if not e.fits]
    if too_big and fitting:
        smallest = min(too_big, key=lambda e: e.memory.total)
        out.append(f"{len(too_big)} layouts need more than {_gib(hw.usable_bytes)} GiB (smallest of them: "
                   f"{smallest.layout.describe()}, {_gib(smallest.memory.total)} GiB)")
    if fitting and not plan.pipeline:
        out.append(f"pipeline parallelism not needed: {len(fitting)} layouts fit without it (--pp N prices one)")
    elif plan.pipeline:
        out.append(f"pipeline parallelism considered (pp {', '.join(map(str, plan.pipeline))}): "
                   "the bubble (p - 1) / (v m + p - 1) is in each step time")
    if plan.pipeline_left:
        why = (f"ep {plan.expert_parallel} must divide their dp_shard" if plan.expert_parallel > 1
               else "the --cp given must divide their GPUs / mp")
        out.append(f"pp {', '.join(map(str, plan.pipeline_left))} not considered: stages of "
                   f"{', '.join(str(hw.gpus // n) for n in plan.pipeline_left)} GPUs take no layout ({why})")
    if plan.expert_parallel and args.n_experts:
        out.append(f"expert parallelism: ep {plan.expert_parallel} only (--ep {plan.expert_parallel}); without --ep "
                   "the planner searches every ep dividing the experts and dp_shard")
    for mp, reason in sorted(plan.rejected.items()):
        out.append(f"mp {mp} not considered: {reason}")
    if plan.skipped:
        dps = sorted({lay.dp for lay, _ in plan.skipped})
        out.append(f"{len(plan.skipped)} layouts skipped: the global batch of {w.global_batch} sequences is not a "
                   f"multiple of dp x micro-batch for dp in {dps}")
    return "\n".join(out)


def active_text(args, seq_len: int) -> str:
    """' (17.17B active per token: ...)' for a mixture of experts; '' for a dense model."""
    if not args.n_experts:
        return ""
    moe = len([i for i in range(args.n_layers) if args.is_moe_layer(i)])
    return (f" ({args.num_params(active=True) / 1e9:.2f}B active per token: {args.experts_per_token} of "
            f"{args.n_experts} experts and the shared expert in {moe} MoE layers, the dense ones whole; "
            f"{args.flops_per_token(seq_len) / 1e9:,.1f} GFLOP per token trained: 6 x the active matmul "
            "parameters, and the attention's)")


def allocator_assumed(hw: Hardware) -> str:
    """The one line of what the memory assumes of the caching allocator (Hardware.allocator_overhead)."""
    return (f"the caching allocator reserves {100 * hw.allocator_overhead:.1f}% more than the tensors counted "
            "(blocks a step frees stay cached for what it makes next; measured on an H200, docs/planner.md)")


def float8_assumed(w: Workload, hw: Hardware) -> str:
    """The one line of what a float8 plan assumes (plan.compute prices it)."""
    gathered = ", their weights all-gathered in float8 (1 byte)" if w.float8_all_gather else ""
    return (f"float8 {w.float8}: the blocks' linears at {hw.gemm_efficiency:.2f} of {hw.float8_peak_flops / 1e12:,.0f} "
            f"float8 TFLOP/s, their casts (amax and conversion passes{'' if w.compile else ', op by op: no --compile'}) "
            f"at the memory rate{gathered}; the output head and attention in bf16; MFU against the bf16 peak")


def float8_gain(plan: Plan, e: Estimate) -> str:
    """The same layout in bf16, against e: what float8 buys (or costs) on this hardware."""
    w = dataclasses.replace(plan.workload, float8="none", float8_all_gather=False)
    bf16 = estimate(plan.args, e.layout, w, plan.hardware)
    gain = e.tokens_per_s_per_gpu / bf16.tokens_per_s_per_gpu
    line = (f"float8: this layout in bf16 would train {bf16.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; "
            f"float8 is {gain:.2f}x")
    if gain < 1 and not plan.workload.compile:
        line += " (its casts run op by op without --compile, which fuses them)"
    return line


def config_flags(e: Estimate, w: Workload, model_flags: str = "") -> str:
    """Every `hybridpar train` key the estimate assumed, as flags: pasted after `hybridpar train`
    (with the data and output keys) it trains the layout that was planned."""
    lay = e.layout
    # Under pp the step's micro-batches are the pipeline's: one batch of m x micro-batch sequences.
    batch, accum = (w.micro_batch, e.grad_accum) if lay.pp == 1 else (w.micro_batch * e.grad_accum, 1)
    flags = [model_flags, f"--data.seq_len {w.seq_len}",
             f"--data.micro_batch_size {batch} --train.grad_accum {accum}",
             f"--parallel.mp {lay.mp} --parallel.dp_shard {lay.dp_shard} --parallel.dp_replicate {lay.dp_replicate}",
             f"--parallel.cp {lay.cp}" if lay.cp > 1 else "",
             f"--parallel.ep {lay.ep}" if lay.ep > 1 else "",
             f"--parallel.pp {lay.pp} --parallel.pp_schedule {lay.pp_schedule} --parallel.pp_microbatches "
             f"{e.grad_accum}" if lay.pp > 1 else "",
             f"--parallel.sequence_parallel {'true' if lay.sequence_parallel else 'false'}",
             f"--fsdp.sharding_strategy {lay.strategy} --fsdp.activation_checkpointing {lay.ac}",
             f"--fsdp.ac_every {lay.ac_every}" if lay.ac == "selective" else "",
             f"--fsdp.param_dtype {w.param_dtype} --fsdp.reduce_dtype {w.reduce_dtype}",
             f"--train.grad_sync {w.grad_sync} --train.compile {'true' if w.compile else 'false'}",
             f"--float8.recipe {w.float8}" if w.float8 != "none" else "",
             "--float8.fsdp_all_gather true" if w.float8_all_gather else ""]
    return " ".join(f for f in flags if f)


def plan_json(plan: Plan, model_name: str = "", model_flags: str = "") -> dict:
    """The plan as data (`hybridpar plan --json`): the inputs, every layout estimated, and the config
    line of the best one that fits."""
    def layout(e: Estimate) -> dict:
        m, t = e.memory, e.time
        return {**dataclasses.asdict(e.layout), "strategy": e.layout.strategy, "grad_accum": e.grad_accum,
                "global_batch": e.global_batch, "fits": e.fits,
                "memory_gib": {k: getattr(m, k) / GIB for k in ("state", "accumulated_grads", "activations", "allocator",
                                                                "total")},
                "step_s": t.step, "tp_comm_s": t.tp_comm, "cp_comm_s": t.cp_exposed, "all_to_all_s": t.ep_comm,
                "all_to_all_bytes": e.experts.all_to_all_mb * e.grad_accum,
                "pp_comm_s": t.pp_comm, "pp_bubble_s": t.pp_bubble, "fsdp_exposed_s": t.dp_exposed,
                "fsdp_contention_s": t.dp_contention,
                "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu, "mfu": e.mfu(plan.hardware.peak_flops),
                "config": config_flags(e, plan.workload, model_flags)}

    return {"model": model_name, "parameters": plan.args.num_params(),
            "active_parameters": plan.args.num_params(active=True), "workload": dataclasses.asdict(plan.workload),
            "hardware": dataclasses.asdict(plan.hardware), "layouts": [layout(e) for e in plan.estimates],
            "best": config_flags(plan.fitting[0], plan.workload, model_flags) if plan.fitting else None,
            "rejected": {str(mp): why for mp, why in plan.rejected.items()}}


def no_fit_message(plan: Plan) -> str:
    hw = plan.hardware
    if not plan.estimates:
        return (f"no layout of {hw.gpus} GPUs can run this model (reasons below); "
                "choose a GPU count with a divisor that is a valid mp")
    least = min(plan.estimates, key=lambda e: e.memory.total)
    m = least.memory
    other = m.total - m.state  # what more data-parallel ranks do not shrink
    hints = []
    if other < hw.usable_bytes:
        # The sharded state divides by mp x dp_shard, which grows with the GPU count.
        gpus = hw.gpus * m.state / (hw.usable_bytes - other)
        gpus = hw.gpus_per_node * math.ceil(gpus / hw.gpus_per_node)
        hints.append(f"more GPUs (about {gpus}: the sharded state, {_gib(m.state)} GiB here, divides by mp x dp_shard)")
    else:
        bigger = larger_cp(plan, least)
        wider = larger_mp(plan, least) if plan.expert_parallel > 1 and not bigger else None
        if bigger:
            hints.append(f"context parallelism: activations and buffers alone need {_gib(other)} GiB at cp "
                         f"{least.layout.cp}; cp {bigger.layout.cp} on {bigger.layout.world} GPUs cuts each sequence "
                         f"over {bigger.layout.cp} GPUs ({_gib(bigger.memory.total - bigger.memory.state)} GiB of "
                         "them)")
        elif wider:  # a fixed ep took the ranks a larger mp needs
            hints.append(f"more GPUs: activations and buffers alone need {_gib(other)} GiB at mp {least.layout.mp}, "
                         f"all that ep {plan.expert_parallel} leaves of {hw.gpus} GPUs; mp {wider.layout.mp} on "
                         f"{wider.layout.world} GPUs needs {_gib(wider.memory.total - wider.memory.state)} GiB of them")
        else:
            hints.append(f"more GPUs will not do: activations and buffers alone need {_gib(other)} GiB")
    if least.grad_accum > 1:
        hints.append(f"fewer accumulation steps ({least.grad_accum} keep {_gib(m.accumulated_grads)} GiB of unsharded "
                     "gradients: a smaller --global-batch or a larger --micro-batch)")
    if plan.workload.micro_batch > 1:
        hints.append("--micro-batch 1")
    if not plan.pipeline and not plan.pipeline_left:
        hints.append("pipeline parallelism (--pp N: N stages each hold 1/N of the layers' state)")
    if plan.expert_parallel and plan.args.n_experts:
        hints.append(f"another --ep, or none (the planner searches every ep; ep {plan.expert_parallel} sets how many "
                     "experts a GPU gathers and which pipeline stages have room)")
    hints.append(f"a shorter --seq-len (activations {_gib(m.activations)} GiB)")
    return (f"no layout fits: the smallest needs {_gib(m.total)} GiB per GPU ({least.layout.name}, "
            f"{least.layout.describe()}), but {hw.gpu_mem_gib:g} GiB less the {hw.reserve_gib:g} GiB reserve "
            f"leaves {_gib(hw.usable_bytes)} GiB. Try: " + "; ".join(hints))
