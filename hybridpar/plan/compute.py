"""The compute side of a step: what one rank's kernels do for one micro-batch, and how long that
takes on a Hardware. Three kinds of kernel, each at its own rate:

- matrix multiplies (the linears, the output head) at hw.gemm_efficiency of the peak;
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
from .memory import kv_heads_per_rank, param_counts

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

    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    memory_bytes: float = 0.0
    ops: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(*(x + y for x, y in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, k: float) -> "Work":
        return Work(*(k * x for x in dataclasses.astuple(self)))

    __rmul__ = __mul__

    def seconds(self, hw: Hardware) -> float:
        """On one device of hw, each kind at its sustained rate, one after another."""
        return (self.gemm_flops / (hw.peak_flops * hw.gemm_efficiency)
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


def block_work(args: ModelArgs, mp: int, tokens: int, seq_len: int, a: int, sequence_parallel: bool,
               compiled: bool) -> tuple[Work, Work]:
    """(forward, backward) of one transformer block on one mp rank, for `tokens` = micro-batch x seq_len."""
    d, hd = args.dim, args.head_dim
    q, kv, f = args.n_heads * hd // mp, kv_heads_per_rank(args, mp) * hd, args.ffn_hidden_dim // mp
    gemm = 2.0 * tokens * (d * q + 2 * d * kv + q * d + 3 * d * f)
    # Scores and weighted values, 2 FLOPs per multiply-add each, over the causal half.
    attention = 2.0 * tokens * seq_len * q
    t_norm = tokens // mp if sequence_parallel and mp > 1 else tokens
    per = elementwise_bytes(a, compiled)
    elements = {"norm": 2 * t_norm * d, "add": 2 * t_norm * d, "rope": tokens * (q + kv),
                "swiglu": tokens * f, "transpose": tokens * q}
    fwd_bytes = sum(per[k][0] * n for k, n in elements.items())
    bwd_bytes = sum(per[k][1] * n for k, n in elements.items())
    ops = COMPILED_BLOCK_OPS if compiled else BLOCK_OPS
    forward = Work(gemm, attention, fwd_bytes, ops[0])
    backward = Work(2 * gemm, 2.5 * attention, bwd_bytes, ops[1])
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
    forward, backward = block_work(args, mp, t, s, a, layout.sequence_parallel, workload.compile)
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
    counts = param_counts(args, layout.mp, layout.fsdp_shard)
    # A gather casts the shard to `a` bytes and copies the gathered buffer out into the parameters; a
    # reduction casts the gradient to the reduce dtype and copies it into the collective's buffer.
    copies = counts.total * (gathers * 2 * a + reductions * (a + 2 * r)) if layout.fsdp_shard > 1 else 0.0
    fsdp = Work(memory_bytes=copies, ops=fsdp_calls * FSDP_OPS_PER_CALL)
    tensors = 9 * args.n_layers + 3 - (1 if args.tie_embeddings else 0)
    optimizer = Work(memory_bytes=counts.sharded * OPTIMIZER_BYTES, ops=OPTIMIZER_OPS[0] + OPTIMIZER_OPS[1] * tensors)
    return fsdp + optimizer
