"""The compute side of a step: what one rank's kernels do for one micro-batch, and how long that
takes on a Hardware. Three kinds of kernel, each at its own rate:

- matrix multiplies (the linears, the output head) at hw.gemm_efficiency of the peak; with float8
  (Workload.float8) the blocks' linears at the same fraction of the card's float8 peak (torchao's
  roofline assumes one achievable fraction for both), plus the casts they need (float8_cast_work);
  the output head and attention stay bf16;
- flash attention at hw.attention_efficiency, counting the FLOPs it executes: causal, so half of
  the score matrix, and a backward that recomputes the scores (2.5 times the forward's);
- memory-bound kernels (norms, RoPE, SwiGLU's product, residual adds, the loss, FSDP's copies,
  AdamW) at hw.memory_efficiency of the memory bandwidth, counting the bytes each eager op of
  models/llama.py reads and writes; `compile` fuses a block's chains of them into one pass each;
plus a host cost per op where the host cannot run ahead of the device (a CPU).
"""

from __future__ import annotations

import dataclasses

from hybridpar.models.args import ModelArgs

from ..config.dtypes import dtype_bytes
from .inputs import Hardware, Layout, Workload
from .memory import (float8_linear, gathered_bytes, kv_heads_per_rank, local_param_shapes, param_counts,
                     sharded_numel)

# Ops dispatched per step by the real code, counted at mp 1 (tests/test_plan.py counts them again):
# per block forward and backward; the embedding, final norm, head and loss; FSDP2 per unit and
# collective (copy-in, the collective, copy-out, views); the optimizer and clipping, fixed and per
# parameter tensor. A compiled block runs its graph's few kernels instead.
BLOCK_OPS = (97, 175)
COMPILED_BLOCK_OPS = (12, 20)
HEAD_OPS = (70, 93)
FSDP_OPS_PER_CALL = 11
TP_OPS_PER_CALL = 7  # a tensor-parallel region's split, copies and collective
OPTIMIZER_OPS = (31, 1)
OPTIMIZER_BYTES = 40  # per sharded element: AdamW reads p, g, m, v and writes p, m, v (28); clipping reads g, scales it (12)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one rank's kernels do: FLOPs by kind, bytes of memory-bound traffic, and op count."""

    gemm_flops: float = 0.0  # bf16 (the compute dtype's) matmuls
    attention_flops: float = 0.0
    memory_bytes: float = 0.0
    ops: float = 0.0
    float8_flops: float = 0.0  # matmuls of float8 operands (Workload.float8)

    def __add__(self, other: "Work") -> "Work":
        return Work(*(x + y for x, y in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, k: float) -> "Work":
        return Work(*(k * x for x in dataclasses.astuple(self)))

    __rmul__ = __mul__

    def seconds(self, hw: Hardware) -> float:
        """On one device of hw, each kind at its sustained rate, one after another."""
        if self.float8_flops and not hw.float8_peak_flops:
            raise ValueError(f"{hw.name or 'this hardware'} has no float8 matmuls (Hardware.float8_peak_flops is 0)")
        float8 = self.float8_flops / (hw.float8_peak_flops * hw.gemm_efficiency) if self.float8_flops else 0.0
        return (self.gemm_flops / (hw.peak_flops * hw.gemm_efficiency) + float8
                + self.attention_flops / (hw.peak_flops * hw.attention_efficiency)
                + self.memory_bytes / (hw.memory_bw * hw.memory_efficiency)
                + self.ops * hw.op_overhead)


def elementwise_bytes(a: int, compiled: bool) -> dict[str, tuple[float, float]]:
    """(forward, backward) bytes per element of each memory-bound piece of a block, in compute dtype
    of `a` bytes. Eager, fp32 upcasts are copies unless the dtype is already fp32."""
    up = 0 if a == 4 else 1  # .float() and .type_as() copy only from a narrower dtype
    if compiled:  # one fused kernel per chain: read the inputs once, write the outputs once
        return {"norm": (2 * a, 4 * a), "rope": (2 * a, 2 * a), "add": (3 * a, 3 * a),
                "swiglu": (3 * a, 5 * a), "transpose": (2 * a, 2 * a)}
    # RMSNorm: x.float(), pow, mean, the scaling mul, type_as, the weight's mul.
    norm = 28 + up * 4 * a
    # RoPE: x.float(), the complex multiply, type_as.
    rope = 8 + up * (2 * a + 8)
    return {"norm": (norm, 2 * norm), "rope": (rope, 2 * rope), "add": (3 * a, 3 * a),
            "swiglu": (5 * a, 10 * a), "transpose": (2 * a, 2 * a)}


def loss_bytes(a: int) -> int:
    """Bytes per logit of the loss, forward and backward: upcast, log-softmax (max, exp-sum, write),
    its gradient, the downcast; the casts copy only from a narrower dtype."""
    return 28 + (0 if a == 4 else 2 * a + 8)


def float8_cast_work(linears: list[tuple[int, int]], tokens: int, a: int, recipe: str, gathered: bool,
                     compiled: bool, shared_input: bool = False) -> tuple[Work, Work]:
    """(forward, backward) memory traffic of casting the float8 `linears`' operands ((in, out) on this
    rank, `tokens` of `a`-byte activations) to float8 with dynamic scales: memory-bound passes at the
    card's bandwidth. Eager, torchao's matmul_with_hp_or_float8_args casts both operands of each of
    a linear's three matmuls itself: forward the input and the weight; backward the output's gradient
    and the weight (input gradient), the output's gradient and the input (weight gradient), each one
    op after another: abs (read, write), max (read), the fp32 upcast (read a, write 4), the scale's
    multiply and the clamp (read 4, write 4 each), the float8 conversion (read 4, write 1). Compiled,
    a cast is an amax pass (read) and one kernel reading the tensor and writing float8; a tensorwise
    cast is done once and written in both layouts for the backward (torchao's own roofline), a
    rowwise one once per scaling direction, and the linears that read one input (`shared_input`:
    wq/wk/wv, w1/w3) cast it once. rowwise_with_gw_hp keeps the weight gradient's matmul in bf16;
    `gathered` (float8.fsdp_all_gather): the weight arrives in float8, scaled, and is never cast."""
    grad_weight = recipe != "rowwise_with_gw_hp"
    if compiled:
        once = recipe == "tensorwise"
        per = 2 * a + (2 if once else 1)
        casts = {"input": 1 if once or not grad_weight else 2, "weight": 1 if once else 2,
                 "output": 1 if once or not grad_weight else 2}
    else:
        per = 4 * a + 25
        casts = {"input": 1 + grad_weight, "weight": 2, "output": 1 + grad_weight}
    if gathered:
        casts["weight"] = 0
    inputs = tokens * (linears[0][0] if compiled and shared_input else sum(i for i, _ in linears))
    outputs, params = tokens * sum(o for _, o in linears), sum(i * o for i, o in linears)
    forward = inputs + min(casts["weight"], 1) * params
    backward = (casts["input"] - 1) * inputs + max(casts["weight"] - 1, 0) * params + casts["output"] * outputs
    return Work(memory_bytes=per * forward), Work(memory_bytes=per * backward)


# A block's regions by its linears (block_linears): the linears of one read the same input. Under
# tensor parallelism each is entered or left by a collective (plan.async_tp pairs them).
REGIONS = {"attention entry": slice(0, 3), "attention exit": slice(3, 4), "feed-forward entry": slice(4, 6),
           "feed-forward exit": slice(6, 7)}


def block_linears(args: ModelArgs, mp: int) -> list[tuple[int, int]]:
    """(in, out) of a block's linears on one mp rank, in the order wq, wk, wv, wo, w1, w3, w2."""
    d, hd = args.dim, args.head_dim
    q, kv, f = args.n_heads * hd // mp, kv_heads_per_rank(args, mp) * hd, args.ffn_hidden_dim // mp
    return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


def linear_work(linears: list[tuple[int, int]], tokens: int, a: int, float8: str = "none", gathered: bool = False,
                compiled: bool = False, shared_input: bool = False) -> tuple[Work, Work]:
    """(forward, backward) of these linears for `tokens`: the forward's matmul, and the backward's two
    (the input's gradient, the weight's), each as many FLOPs. With a float8 recipe every linear with
    aligned dimensions multiplies in float8 and casts its operands (rowwise_with_gw_hp: the weight's
    gradient in bf16); `gathered`: its weight came from FSDP in float8; `shared_input`: they read one input."""
    eight = [(i, o) for i, o in linears if float8 != "none" and float8_linear((o, i))]
    gemm = 2.0 * tokens * sum(i * o for i, o in linears)
    f8 = 2.0 * tokens * sum(i * o for i, o in eight)
    bwd_f8 = f8 if float8 == "rowwise_with_gw_hp" else 2 * f8
    forward = Work(gemm_flops=gemm - f8, float8_flops=f8)
    backward = Work(gemm_flops=2 * gemm - bwd_f8, float8_flops=bwd_f8)
    if eight:
        casts = float8_cast_work(eight, tokens, a, float8, gathered, compiled, shared_input)
        forward, backward = forward + casts[0], backward + casts[1]
    return forward, backward


def block_work(args: ModelArgs, mp: int, tokens: int, seq_len: int, a: int, sequence_parallel: bool,
               compiled: bool, float8: str = "none", float8_gathered: bool = False) -> tuple[Work, Work]:
    """(forward, backward) of one transformer block on one mp rank, for `tokens` = micro-batch x seq_len;
    with a float8 recipe, its linears in float8 (float8_gathered: their weights gathered in float8)."""
    d, linears = args.dim, block_linears(args, mp)
    q, kv, f = linears[0][1], linears[1][1], linears[4][1]  # wq's, wk's and w1's outputs
    # Scores and weighted values, 2 FLOPs per multiply-add each, over the causal half.
    attention = 2.0 * tokens * seq_len * q
    t_norm = tokens // mp if sequence_parallel and mp > 1 else tokens
    per = elementwise_bytes(a, compiled)
    elements = {"norm": 2 * t_norm * d, "add": 2 * t_norm * d, "rope": tokens * (q + kv),
                "swiglu": tokens * f, "transpose": tokens * q}
    fwd_bytes = sum(per[k][0] * n for k, n in elements.items())
    bwd_bytes = sum(per[k][1] * n for k, n in elements.items())
    ops = COMPILED_BLOCK_OPS if compiled else BLOCK_OPS
    forward, backward = Work(0.0, attention, fwd_bytes, ops[0]), Work(0.0, 2.5 * attention, bwd_bytes, ops[1])
    for region in REGIONS.values():
        linear_forward, linear_backward = linear_work(linears[region], tokens, a, float8, float8_gathered, compiled,
                                                      shared_input=True)
        forward, backward = forward + linear_forward, backward + linear_backward
    return forward, backward


def context_parallel_work(args: ModelArgs, mp: int, cp: int, micro_batch: int, seq_len: int, a: int) -> tuple[Work, Work]:
    """(forward, backward) copies context parallelism adds to a block (hybridpar.parallel.context): K|V
    concatenated for the all-gather, the gathered parts put in global order, the chunks' outputs
    concatenated; the backward's copies mirror them. Its attention FLOPs are block_work's at seq_len / cp
    tokens: the chunks balance the causal work."""
    if cp == 1:
        return Work(), Work()
    t = micro_batch * seq_len // cp
    kv = kv_heads_per_rank(args, mp) * args.head_dim * 2
    copies = 2 * a * (t * kv + micro_batch * seq_len * kv + t * args.n_heads // mp * args.head_dim)
    return Work(memory_bytes=copies), Work(memory_bytes=copies)


def micro_batch_work(args: ModelArgs, layout: Layout, workload: Workload, tp_calls: int = 0) -> Work:
    """One rank's forward and backward of one micro-batch, recomputation included; of its `tp_calls`
    tensor-parallel and context-parallel collectives only the ops around them (their time is the planner's comm)."""
    mp, cp, a = layout.mp, layout.cp, dtype_bytes(workload.param_dtype)
    s = workload.seq_len
    t = workload.micro_batch * s // cp  # this rank's tokens; attention still reaches back over all s
    forward, backward = block_work(args, mp, t, s, a, layout.sequence_parallel, workload.compile, workload.float8,
                                   workload.float8_gathered(layout.fsdp_shard))
    cp_forward, cp_backward = context_parallel_work(args, mp, cp, workload.micro_batch, s, a)
    forward, backward = forward + cp_forward, backward + cp_backward
    recomputed = layout.checkpointed_blocks(args.n_layers)
    blocks = args.n_layers * (forward + backward) + recomputed * forward
    return blocks + head_work(args, mp, t, a) + Work(ops=tp_calls * TP_OPS_PER_CALL)


def head_work(args: ModelArgs, mp: int, tokens: int, a: int) -> Work:
    """The output head's matmul and the loss, forward and backward, for `tokens` on one mp rank."""
    vocab = args.vocab_size // mp
    return Work(gemm_flops=6.0 * tokens * args.dim * vocab, memory_bytes=tokens * vocab * loss_bytes(a),
                ops=sum(HEAD_OPS))


def step_work(args: ModelArgs, layout: Layout, workload: Workload, gathers: int, reductions: int,
              fsdp_calls: int) -> Work:
    """Per step, besides the micro-batches' kernels: FSDP's copies into and out of `gathers`
    all-gathers and `reductions` reduce-scatters of the mp slice (`fsdp_calls` collectives in all),
    and the optimizer with gradient clipping on the shard."""
    a, r = dtype_bytes(workload.param_dtype), dtype_bytes(workload.reduce_dtype)
    counts, ds = param_counts(args, layout.mp, layout.fsdp_shard), layout.fsdp_shard
    block = local_param_shapes(args, layout.mp)["block"]
    # A gather casts the shard to `a` bytes (a float8 linear's to 1 with float8.fsdp_all_gather) and
    # copies the gathered buffer out into the parameters; a reduction casts the gradient to the reduce
    # dtype and copies it into the collective's buffer.
    float8 = workload.float8_gathered(ds)
    gathered = counts.total * a - counts.n_layers * (counts.block * a - gathered_bytes(block, a, float8))
    copies = gathers * 2 * gathered + reductions * counts.total * (a + 2 * r) if ds > 1 else 0.0
    if float8:
        # torchao's precompute_float8_dynamic_scale_for_fsdp: once a step, the amax of every float8
        # weight's fp32 shard; each gather casts the shard (read 4 bytes, write 1).
        shards = counts.n_layers * sum(sharded_numel(x, ds) for x in block if float8_linear(x))
        copies += shards * (4 + gathers * 5)
    fsdp = Work(memory_bytes=copies, ops=fsdp_calls * FSDP_OPS_PER_CALL)
    tensors = 9 * args.n_layers + 3 - (1 if args.tie_embeddings else 0)
    optimizer = Work(memory_bytes=counts.sharded * OPTIMIZER_BYTES, ops=OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * tensors)
    return fsdp + optimizer
