"""Plan a layout before asking for GPUs: per-rank memory and step time of (mp, dp_shard, dp_replicate, AC).

    hybridpar plan --model llama3_70b --gpus 128 --gpu-mem-gb 80 --global-batch 512

Pure arithmetic on the model's shape, derived from what hybridpar's code keeps in memory:

- State (the trainer builds the model in fp32; FSDP2 shards it over dp_shard, each parameter's
  dim 0 padded to a multiple of dp_shard): fp32 master parameters, fp32 gradients and AdamW's two
  fp32 moments, 16 bytes per parameter of the rank's tensor-parallel slice / dp_shard. Norm weights
  are whole on every mp rank; with mp > n_kv_heads every mp rank holds the whole wk and wv
  (kv heads replicated).
- Gathered parameters in the compute dtype (`param_dtype`): the embedding, the output head and the
  final norm stay gathered from forward to backward (hybridpar never reshards them), blocks are
  gathered two at a time (the current one and the prefetched next one); all blocks when not
  resharding (ZeRO-2).
- Gradient buffers in backward: one unit's unsharded gradient in the compute dtype plus its copy in
  the reduce dtype that is reduce-scattered. With gradient accumulation (grad_accum > 1) FSDP2 keeps
  every unit's unsharded gradient, in the reduce dtype, between micro-batches: 4 bytes per parameter
  of the mp slice, not divided by dp_shard, often the largest term.
- Activations saved for backward, per block of models/llama.py with tensor parallelism and no
  sequence parallelism (tokens T = micro_batch x seq_len, compute dtype of a bytes):
      each RMSNorm: its fp32 input copy 4*T*D, rsqrt 4*T, the normalised a*T*D, the output a*T*D
      attention:    rotated q and k, v, the attention output a*T*hd*(2*heads + 2*kv_heads) per rank,
                    logsumexp 4*T*heads (F.scaled_dot_product_attention's flash kernels)
      feed-forward: w1 and w3 outputs, silu(w1 x) and the product, 4*a*T*ffn_hidden/mp
  Norms and the residual stream are not split by mp. A checkpointed block keeps only its input
  (a*T*D); backward recomputes one block at a time. The head keeps the final norm's tensors and the
  vocab-parallel loss's fp32 softmax 4*T*V/mp (the full logits are never gathered); the logits and
  the loss's fp32 working copies are a transient peak.
- Step time: FLOPs (the trainer's MFU count, 6 per parameter per token plus attention, plus the
  recomputed forward under AC) at the assumed fraction `mfu` of the peak; tensor-parallel
  all-reduces of [micro_batch, seq_len, dim] sit on the critical path (per block 2 in forward, 2
  in backward, 1 more when the block is recomputed); FSDP all-gathers (every micro-batch: forward,
  and backward when resharding), the reduce-scatter and the all-reduce across replicas (last
  micro-batch) overlap with compute, only their excess counts. Collective times use nccl-tests'
  bus bandwidth: all-reduce moves 2(n-1)/n of the data, all-gather and reduce-scatter (n-1)/n. A
  group whose ranks are all on one node gets the intra-node bandwidth, else the inter-node one.

tests/test_plan.py checks the state, activation, accumulated-gradient and collective byte counts
against the real model on CPU (they agree to a few bytes); gathered parameters, gradient buffers
and transients follow FSDP2's documented behaviour and are not measured. Not modelled: latency
terms, the optimizer step (memory-bound, milliseconds), duplicated k/v projection FLOPs when kv
heads are replicated, allocator fragmentation (keep a reserve), pipeline parallelism (hybridpar
has none).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Optional

from models.llama import ModelArgs

from .parallel.cost import collective_seconds

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
AC_MODES = ("none", "selective", "full")
MASTER_BYTES = 4  # the trainer builds the model in fp32: master params, grads and AdamW moments are fp32


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPE_BYTES)}") from None


# --- inputs ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh (dp_replicate, dp_shard, mp) plus activation checkpointing and the resharding choice."""

    mp: int
    dp_shard: int
    dp_replicate: int = 1
    ac: str = "none"  # none | selective (every ac_every-th block) | full
    ac_every: int = 2
    reshard_after_forward: bool = True  # False: ZeRO-2 (shard_grad_op / hybrid_shard_zero2)

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def world(self) -> int:
        return self.mp * self.dp

    @property
    def strategy(self) -> str:
        """The fsdp.sharding_strategy to put in the config for this layout."""
        if self.dp_replicate == 1:
            return "full_shard" if self.reshard_after_forward else "shard_grad_op"
        if self.dp_shard == 1:
            return "no_shard"
        return "hybrid_shard" if self.reshard_after_forward else "hybrid_shard_zero2"

    def checkpointed_blocks(self, n_layers: int) -> int:
        """How many blocks apply_activation_checkpointing wraps for this mode."""
        if self.ac == "none":
            return 0
        if self.ac == "full":
            return n_layers
        return len(range(0, n_layers, self.ac_every))

    @property
    def name(self) -> str:
        return f"mp{self.mp}_dp{self.dp}"

    def describe(self) -> str:
        ac = {"none": "no AC", "full": "full AC", "selective": f"AC every {self.ac_every}"}[self.ac]
        return (f"mp {self.mp} x dp_shard {self.dp_shard} x dp_replicate {self.dp_replicate} "
                f"({self.strategy}, {ac})")


@dataclasses.dataclass(frozen=True)
class Workload:
    seq_len: int
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    global_batch: int = 0  # sequences per optimizer step; 0: one micro-batch per dp rank (no accumulation)
    param_dtype: str = "bf16"  # FSDP compute dtype (the gathered parameters and activations)
    reduce_dtype: str = "fp32"  # FSDP gradient reduction dtype
    grad_sync: str = "last"  # train.grad_sync: reduce-scatter after the last micro-batch, or after "every" one

    def grad_accum(self, dp: int) -> int:
        """Micro-batches per step for `dp` data-parallel ranks; ValueError when they do not divide."""
        if not self.global_batch:
            return 1
        per_step = dp * self.micro_batch
        if self.global_batch % per_step:
            raise ValueError(f"global batch {self.global_batch} is not a multiple of dp x micro-batch = {per_step}")
        return self.global_batch // per_step


@dataclasses.dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_mem_gib: float
    gpus_per_node: int = 8
    intra_node_busbw: float = 150e9  # bytes/s, nccl-tests busbw inside a node (NVLink)
    inter_node_busbw: float = 25e9  # bytes/s per GPU between nodes (one 200 Gb/s NIC per GPU)
    peak_flops: float = 312e12  # dense bf16 per GPU (A100; 989e12 for H100 SXM)
    mfu: float = 0.4  # fraction of the peak the math reaches while computing (communication excluded)
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_mem_gib - self.reserve_gib) * GIB


# --- parameters ---------------------------------------------------------------------------------


def kv_heads_per_rank(args: ModelArgs, mp: int) -> int:
    """kv heads each mp rank computes: split when mp divides them, else one (replicated)."""
    return args.kv_heads // mp if args.kv_heads % mp == 0 else 1


def local_param_shapes(args: ModelArgs, mp: int) -> dict[str, list[tuple[int, ...]]]:
    """Each FSDP unit's parameters as this mp rank holds them (before FSDP), as in models/llama.py."""
    d, hd, v, f = args.dim, args.head_dim, args.vocab_size, args.ffn_hidden_dim
    q = args.n_heads * hd // mp
    # wk/wv: ColumnParallelLinear slices when mp divides the kv heads, else every rank has them all.
    kv = args.kv_heads * hd // mp if args.kv_heads % mp == 0 else args.kv_heads * hd
    embedding = (v // mp, d) if args.resolved_embedding_split == "vocab" else (v, d // mp)
    block = [(q, d), (kv, d), (kv, d), (d, q), (f // mp, d), (f // mp, d), (d, f // mp), (d,), (d,)]
    return {"embedding": [embedding], "block": block, "output": [(v // mp, d)], "root": [(d,)]}


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _sharded_numel(shape: tuple[int, ...], dp_shard: int) -> int:
    """Elements of the largest FSDP2 shard: dim 0 chunked over dp_shard (the first ranks get ceil)."""
    return math.ceil(shape[0] / dp_shard) * _numel(shape[1:])


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter elements per rank: the mp slice of each unit, and the largest FSDP shard of it all."""

    embedding: int
    block: int  # one transformer block
    output: int
    root: int
    n_layers: int
    sharded: int  # this rank's FSDP shard of everything (max over ranks, with padding)

    @property
    def total(self) -> int:  # the whole mp slice, unsharded
        return self.embedding + self.n_layers * self.block + self.output + self.root


def param_counts(args: ModelArgs, mp: int, dp_shard: int) -> ParamCounts:
    shapes = local_param_shapes(args, mp)
    count = {unit: sum(_numel(s) for s in ss) for unit, ss in shapes.items()}
    sharded = {unit: sum(_sharded_numel(s, dp_shard) for s in ss) for unit, ss in shapes.items()}
    return ParamCounts(
        embedding=count["embedding"], block=count["block"], output=count["output"], root=count["root"],
        n_layers=args.n_layers,
        sharded=sharded["embedding"] + args.n_layers * sharded["block"] + sharded["output"] + sharded["root"],
    )


# --- activations --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for backward on one rank, by part (one micro-batch)."""

    per_block: float  # a block that is not checkpointed
    block_input: float  # a checkpointed block: only its input
    embedding: float  # token ids (and the vocab-split mask)
    rope: float  # the complex RoPE rotations, shared by every block
    head: float  # final norm + the loss's softmax and targets
    n_layers: int
    n_checkpointed: int
    loss_transient: float  # the logits and the loss's fp32 working copies (end of forward / start of backward)

    @property
    def saved(self) -> float:
        """Everything saved at the end of forward (what backward starts from)."""
        plain = self.n_layers - self.n_checkpointed
        return self.embedding + self.rope + self.head + plain * self.per_block + self.n_checkpointed * self.block_input

    @property
    def recompute(self) -> float:
        """One checkpointed block re-run in backward holds a plain block's activations."""
        return self.per_block if self.n_checkpointed else 0.0


def activation_bytes(args: ModelArgs, mp: int, micro_batch: int, seq_len: int, compute_bytes: int,
                     n_checkpointed: int = 0) -> Activations:
    """Saved tensors of models.llama.Transformer + vocab_parallel_cross_entropy, derived from the code."""
    a, t = compute_bytes, micro_batch * seq_len
    d, hd = args.dim, args.head_dim
    heads, kv = args.n_heads // mp, kv_heads_per_rank(args, mp)
    ffn, vocab = args.ffn_hidden_dim // mp, args.vocab_size // mp
    # RMSNorm: x.float() (x itself in fp32) for pow and mul, rsqrt [T, 1], normed.type_as(x) for
    # the weight's gradient, and the output, which the following linears save.
    norm = 4 * t * d + 4 * t + 2 * a * t * d
    # wq/wk/wv outputs are not saved (RoPE's complex mul saves only the rotations); SDPA saves the
    # rotated q, k, the v projection, its output (also wo's input) and the fp32 logsumexp.
    attention = a * t * hd * (2 * heads + 2 * kv) + 4 * t * heads
    # SwiGLU: w1 x (silu's input), silu(w1 x) and w3 x (the product's inputs), the product (w2's input).
    feed_forward = 4 * a * t * ffn
    per_block = 2 * norm + attention + feed_forward
    vocab_split = args.resolved_embedding_split == "vocab"
    embedding = 8 * t + (t if vocab_split else 0)  # int64 ids; the bool mask of out-of-shard ids
    rope = seq_len * (hd // 2) * 8  # complex64
    cast = 0 if a == 4 else a  # .float() of fp32 logits and .to(fp32) of an fp32 gradient copy nothing
    if mp > 1:
        # Saved: the fp32 softmax, int64 local targets, two bool masks. Forward also holds the
        # logits, their fp32 copy and the shifted logits; backward turns the softmax into the
        # gradient in place and casts it to the compute dtype.
        loss = 4 * t * vocab + 10 * t
        transient = max(a + (4 if cast else 0) + 4, cast) * t * vocab
    else:
        # F.cross_entropy: log_softmax saves its fp32 output, nll_loss the int64 targets; backward
        # makes a new fp32 gradient, then its cast.
        loss = 4 * t * vocab + 8 * t
        transient = max(a + (4 if cast else 0), 4 + cast) * t * vocab
    return Activations(
        per_block=per_block, block_input=a * t * d, embedding=embedding, rope=rope, head=norm + loss,
        n_layers=args.n_layers, n_checkpointed=n_checkpointed, loss_transient=transient,
    )


# --- the estimate ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Memory:
    """Peak bytes per rank by kind; everything is counted as alive at once (a little pessimistic)."""

    params: float  # fp32 master shard
    grads: float  # fp32 gradient shard
    optimizer: float  # AdamW exp_avg + exp_avg_sq
    accumulated_grads: float  # unsharded gradients kept between micro-batches (grad_accum > 1)
    gathered_params: float  # compute-dtype parameters of gathered units
    grad_buffers: float  # one unit's unsharded gradient + its reduce-dtype copy
    activations: float  # saved for backward at the end of forward
    transient: float  # on top: the loss's logits peak, or a recomputed block + backward temporaries

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on every rank."""

    compute: float  # FLOPs / (peak x mfu), recomputation included
    tp_comm: float  # tensor-parallel collectives (on the critical path)
    dp_comm: float  # FSDP all-gathers, reduce-scatters and replica all-reduces
    dp_exposed: float  # the part of dp_comm that compute does not hide

    @property
    def step(self) -> float:
        return self.compute + self.tp_comm + self.dp_exposed


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    grad_accum: int
    global_batch: int  # sequences per step
    memory: Memory
    time: StepTime
    tokens_per_step: int
    model_flops_per_step: float  # the trainer's MFU numerator (no recomputation)
    usable_bytes: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.time.step / self.layout.world

    def mfu(self, peak_flops: float) -> float:
        return self.model_flops_per_step / (self.time.step * peak_flops * self.layout.world)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """hybridpar.train.metrics.flops_per_token's count (tests keep them equal); repeated here so
    planning does not import the trainer."""
    return 6.0 * (args.num_params() - args.vocab_size * args.dim) + 12.0 * args.n_layers * args.dim * seq_len


def _block_params(args: ModelArgs) -> int:
    d, kv = args.dim, args.kv_heads * args.head_dim
    return 2 * d * d + 2 * d * kv + 3 * d * args.ffn_hidden_dim + 2 * d


def group_busbw(stride: int, size: int, hw: Hardware) -> float:
    """Bus bandwidth of a group of `size` ranks `stride` apart: intra-node when they share a node."""
    span = stride * size
    per_node = min(hw.gpus_per_node, hw.gpus)
    inside = span <= per_node and per_node % span == 0
    return hw.intra_node_busbw if inside else hw.inter_node_busbw


def all_reduce_seconds(nbytes: float, n: int, busbw: float) -> float:
    return collective_seconds("all_reduce", nbytes, n, busbw)


def all_gather_seconds(nbytes: float, n: int, busbw: float) -> float:
    """Also reduce-scatter; nbytes is the unsharded (gathered / reduced) size."""
    return collective_seconds("all_gather", nbytes, n, busbw)


@dataclasses.dataclass(frozen=True)
class CommBytes:
    """Bytes one rank hands to collectives: tensor-parallel and FSDP per micro-batch, gradient
    reduction per step. Sizes as nccl-tests counts them: the tensor for all-reduce, the gathered
    output for all-gather, the unreduced input for reduce-scatter."""

    tp_all_reduce: float  # over the mp group, per micro-batch
    tp_all_gather: float  # over the mp group, per micro-batch (ParallelEmbedding's output)
    fsdp_all_gather: float  # over dp_shard, per micro-batch (forward, and backward when resharding)
    fsdp_reduce_scatter: float  # over dp_shard, per step
    replica_all_reduce: float  # over dp_replicate, per step (hybrid sharding)


def collective_bytes(args: ModelArgs, layout: Layout, workload: Workload) -> CommBytes:
    """What models/llama.py, vocab_parallel_cross_entropy and apply_fsdp issue (tests count them)."""
    mp, ds, dr, L = layout.mp, layout.dp_shard, layout.dp_replicate, args.n_layers
    a, r = dtype_bytes(workload.param_dtype), dtype_bytes(workload.reduce_dtype)
    t = workload.micro_batch * workload.seq_len
    counts = param_counts(args, mp, ds)
    tp_ar = tp_ag = 0.0
    if mp > 1:
        act = t * args.dim * a
        # Forward: wo and w2 sum their partial outputs (2 per block). Backward: the attention's and
        # the feed-forward's inputs enter the region once each (wq/wk/wv and w1/w3 share it), so 2
        # gradient all-reduces per block, and 1 for the output head. A recomputed block repeats only
        # wo's: recomputation stops once w2's input is back, before w2's all-reduce. The loss
        # reduces 3 fp32 numbers per token.
        n_ac = layout.checkpointed_blocks(L)
        tp_ar = act * (2 * L + 2 * L + 1 + n_ac) + 3 * t * 4
        if args.resolved_embedding_split == "vocab":
            tp_ar += act  # VocabParallelEmbedding sums the shards' lookups
        else:
            tp_ag += act  # ParallelEmbedding gathers the embedding dim
        if args.kv_heads % mp:  # replicated wk/wv: their weight gradients are summed over mp
            tp_ar += L * 2 * args.kv_heads * args.head_dim * args.dim * a
    shapes = local_param_shapes(args, mp)
    padded = {unit: sum(_sharded_numel(x, ds) * ds for x in xs) for unit, xs in shapes.items()}
    every_unit = padded["embedding"] + L * padded["block"] + padded["output"] + padded["root"]
    # The embedding, the head and the root stay gathered from forward to backward; the blocks are
    # gathered again in backward unless resharding is off.
    again = L * padded["block"] if layout.reshard_after_forward else 0
    ag = (every_unit + again) * a if ds > 1 else 0.0
    rs = every_unit * r if ds > 1 else 0.0
    ar = counts.sharded * r if dr > 1 else 0.0
    return CommBytes(tp_ar, tp_ag, ag, rs, ar)


def estimate(args: ModelArgs, layout: Layout, workload: Workload, hw: Hardware) -> Estimate:
    """Memory per rank and time per step of one layout. ValueError if the batch does not divide."""
    if layout.ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}, got {layout.ac!r}")
    mp, ds, dr = layout.mp, layout.dp_shard, layout.dp_replicate
    a, r = dtype_bytes(workload.param_dtype), dtype_bytes(workload.reduce_dtype)
    grad_accum = workload.grad_accum(layout.dp)
    global_batch = layout.dp * workload.micro_batch * grad_accum
    b, s, L = workload.micro_batch, workload.seq_len, args.n_layers

    counts = param_counts(args, mp, ds)
    n_ac = layout.checkpointed_blocks(L)
    acts = activation_bytes(args, mp, b, s, a, n_ac)

    kept_blocks = L if not layout.reshard_after_forward else min(2, L)  # current + prefetched
    gathered = (counts.embedding + counts.output + counts.root + kept_blocks * counts.block) * a
    grad_buffers = max(counts.block, counts.output) * (a + r)
    sync_every = workload.grad_sync == "every"
    accumulated = counts.total * r if grad_accum > 1 and not sync_every else 0.0
    # Backward of a block: its recomputation (AC) plus gradient temporaries of a few [T, D] and
    # [T, ffn/mp] tensors (dL/dh, and the three SwiGLU input gradients).
    t = b * s
    backward_work = acts.recompute + a * t * (2 * args.dim + 3 * args.ffn_hidden_dim // mp)
    memory = Memory(
        params=counts.sharded * MASTER_BYTES, grads=counts.sharded * MASTER_BYTES,
        optimizer=2 * counts.sharded * MASTER_BYTES, accumulated_grads=accumulated,
        gathered_params=gathered, grad_buffers=grad_buffers, activations=acts.saved,
        transient=max(acts.loss_transient, backward_work),
    )

    # Compute: this rank's 1/mp share of the micro-batch's FLOPs, plus the recomputed forwards.
    per_token = flops_per_token(args, s)
    recompute_per_token = n_ac * (2 * _block_params(args) + 4 * args.dim * s)
    compute_mb = (per_token + recompute_per_token) * t / mp / (hw.peak_flops * hw.mfu)

    comm = collective_bytes(args, layout, workload)
    mp_bw, ds_bw, dr_bw = group_busbw(1, mp, hw), group_busbw(mp, ds, hw), group_busbw(mp * ds, dr, hw)
    tp_mb = all_reduce_seconds(comm.tp_all_reduce, mp, mp_bw) + all_gather_seconds(comm.tp_all_gather, mp, mp_bw)
    ag = all_gather_seconds(comm.fsdp_all_gather, ds, ds_bw)
    rs = all_gather_seconds(comm.fsdp_reduce_scatter, ds, ds_bw)
    ar = all_reduce_seconds(comm.replica_all_reduce, dr, dr_bw)
    busy = compute_mb + tp_mb
    if sync_every:  # every micro-batch gathers and reduces: sharded accumulation, more traffic
        exposed = grad_accum * max(0.0, ag + rs + ar - busy)
        dp_comm = grad_accum * (ag + rs + ar)
    else:
        exposed = (grad_accum - 1) * max(0.0, ag - busy) + max(0.0, ag + rs + ar - busy)
        dp_comm = grad_accum * ag + rs + ar
    time = StepTime(compute=grad_accum * compute_mb, tp_comm=grad_accum * tp_mb, dp_comm=dp_comm, dp_exposed=exposed)
    tokens = global_batch * s
    return Estimate(
        layout=layout, grad_accum=grad_accum, global_batch=global_batch, memory=memory, time=time,
        tokens_per_step=tokens, model_flops_per_step=per_token * tokens, usable_bytes=hw.usable_bytes,
    )


# --- the search ---------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(args: ModelArgs, hw: Hardware, *, allow_cross_node_mp: bool = False,
                      ac_modes: Iterable[str] = AC_MODES, zero2: bool = False,
                      ac_every: int = 2) -> tuple[list[Layout], dict[int, str]]:
    """Every layout of hw.gpus ranks the model can run; and the rejected mp sizes with the reason."""
    layouts: list[Layout] = []
    rejected: dict[int, str] = {}
    for mp in divisors(hw.gpus):
        try:
            args.check(mp)
        except ValueError as err:
            rejected[mp] = str(err)
            continue
        if mp > hw.gpus_per_node and not allow_cross_node_mp:
            rejected[mp] = (f"mp = {mp} spans nodes of {hw.gpus_per_node} GPUs: tensor-parallel all-reduces would "
                            "leave the node (--allow-cross-node-mp to consider it)")
            continue
        dp = hw.gpus // mp
        for ds in divisors(dp):
            for ac in ac_modes:
                for reshard in (True, False) if zero2 else (True,):
                    if not reshard and ds == 1:
                        continue  # nothing is sharded: ZeRO-2 is the same layout
                    layouts.append(Layout(mp, ds, dp // ds, ac, ac_every, reshard))
    return layouts, rejected


@dataclasses.dataclass
class Plan:
    args: ModelArgs
    workload: Workload
    hardware: Hardware
    estimates: list[Estimate]  # fitting ones first, fastest first; then the rest by memory
    rejected: dict[int, str]  # mp -> why no layout with it was considered
    skipped: list[tuple[Layout, str]]  # layouts the global batch does not divide

    @property
    def fitting(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]

    def find(self, mp: int, dp_shard: int, dp_replicate: int, ac: Optional[str] = None) -> list[Estimate]:
        return [e for e in self.estimates if (e.layout.mp, e.layout.dp_shard, e.layout.dp_replicate) ==
                (mp, dp_shard, dp_replicate) and (ac is None or e.layout.ac == ac)]


def make_plan(args: ModelArgs, workload: Workload, hw: Hardware, **candidate_options) -> Plan:
    """Estimate every candidate layout and rank them: layouts that fit, by tokens/s per GPU."""
    if workload.seq_len > args.max_seq_len:
        raise ValueError(f"seq_len = {workload.seq_len} is larger than the model's max_seq_len = {args.max_seq_len}")
    for name, value in (("gpus", hw.gpus), ("gpus_per_node", hw.gpus_per_node), ("seq_len", workload.seq_len),
                        ("micro_batch", workload.micro_batch)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not 0 < hw.mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {hw.mfu}")
    if hw.usable_bytes <= 0:
        raise ValueError(f"gpu memory {hw.gpu_mem_gib} GiB leaves nothing after the {hw.reserve_gib} GiB reserve")
    layouts, rejected = candidate_layouts(args, hw, **candidate_options)
    estimates, skipped = [], []
    for layout in layouts:
        try:
            estimates.append(estimate(args, layout, workload, hw))
        except ValueError as err:
            skipped.append((layout, str(err)))
    if skipped and not estimates:
        dps = sorted({lay.dp for lay, _ in skipped})
        raise ValueError(f"global batch {workload.global_batch} is not a multiple of dp x micro-batch "
                         f"({workload.micro_batch}) for any data-parallel size of {hw.gpus} GPUs ({dps}): "
                         "choose a global batch divisible by one of them")
    estimates.sort(key=lambda e: (not e.fits, -e.tokens_per_s_per_gpu if e.fits else e.memory.total, e.memory.total))
    return Plan(args, workload, hw, estimates, rejected, skipped)


# --- input parsing and the report ---------------------------------------------------------------

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


def breakdown(e: Estimate, hw: Hardware) -> list[str]:
    m, t = e.memory, e.time
    lines = [
        f"{e.layout.describe()}: {e.grad_accum} micro-batch(es) per step",
        f"  memory per GPU {_gib(m.total)} GiB of {_gib(e.usable_bytes)} usable: "
        f"params {_gib(m.params)} + grads {_gib(m.grads)} + AdamW {_gib(m.optimizer)}"
        f" + accumulated grads {_gib(m.accumulated_grads)} + gathered params {_gib(m.gathered_params)}"
        f" + grad buffers {_gib(m.grad_buffers)} + activations {_gib(m.activations)} + transient {_gib(m.transient)}",
        f"  step {_seconds(t.step)} s: compute {_seconds(t.compute)} + tensor-parallel {_seconds(t.tp_comm)}"
        f" + exposed FSDP {_seconds(t.dp_exposed)} (of {_seconds(t.dp_comm)}); "
        f"{e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * e.mfu(hw.peak_flops):.0f}%",
    ]
    return lines


def format_plan(plan: Plan, top: int = 10, model_name: str = "") -> str:
    args, w, hw = plan.args, plan.workload, plan.hardware
    nodes = math.ceil(hw.gpus / hw.gpus_per_node)
    batch = (f"global batch {w.global_batch} sequences ({w.global_batch * w.seq_len / 2**20:.2f}M tokens)"
             if w.global_batch else "global batch = dp x micro-batch (no accumulation; --global-batch to fix it)")
    out = [
        f"{model_name or 'model'}: {args.num_params() / 1e9:.2f}B parameters, {args.n_layers} layers, dim {args.dim}, "
        f"{args.n_heads} heads / {args.kv_heads} kv heads, vocab {args.vocab_size}",
        f"{hw.gpus} GPUs ({nodes} node(s) x {hw.gpus_per_node}) of {hw.gpu_mem_gib:g} GiB, "
        f"{hw.reserve_gib:g} GiB reserved; seq_len {w.seq_len}, micro-batch {w.micro_batch}, {batch}",
        f"assumed: {hw.peak_flops / 1e12:g} TFLOP/s peak at {hw.mfu:g} of it; busbw {hw.intra_node_busbw / 1e9:g} GB/s "
        f"inside a node, {hw.inter_node_busbw / 1e9:g} GB/s per GPU between nodes; fp32 master weights, "
        f"{w.param_dtype} compute, {w.reduce_dtype} gradient reduction",
        "",
    ]
    fitting = plan.fitting
    header = (f"{'#':>3} {'layout':<10} {'mp':>3} {'shard':>5} {'repl':>5} {'AC':<9} {'micro':>5} "
              f"{'state':>6} {'accum':>6} {'act':>6} {'other':>6} {'total':>6} {'step s':>7} {'tok/s/GPU':>10} "
              f"{'MFU':>5} {'tp s':>6} {'fsdp s':>7}")

    def row(i: int, e: Estimate) -> str:
        lay, m, t = e.layout, e.memory, e.time
        ac = {"none": "none", "full": "full", "selective": f"every {lay.ac_every}"}[lay.ac]
        ac += "" if lay.reshard_after_forward else " z2"
        other = m.total - m.state - m.accumulated_grads - m.activations
        return (f"{i:>3} {lay.name:<10} {lay.mp:>3} {lay.dp_shard:>5} {lay.dp_replicate:>5} {ac:<9} {e.grad_accum:>5} "
                f"{_gib(m.state):>6} {_gib(m.accumulated_grads):>6} {_gib(m.activations):>6} {_gib(other):>6} "
                f"{_gib(m.total):>6} "
                f"{_seconds(t.step):>7} {e.tokens_per_s_per_gpu:>10,.0f} {100 * e.mfu(hw.peak_flops):>4.0f}% "
                f"{_seconds(t.tp_comm):>6} {_seconds(t.dp_exposed):>7}")

    if fitting:
        out.append(f"{len(fitting)} of {len(plan.estimates)} layouts fit, the best first. GiB per GPU: state = fp32 "
                   "params + grads + AdamW, accum = unsharded grads kept between micro-batches,")
        out.append("act = saved activations, other = gathered params, buffers, peaks; "
                   "fsdp s = FSDP time compute does not hide; micro = micro-batches per step.")
        out.append(header)
        out.extend(row(i + 1, e) for i, e in enumerate(fitting[:top]))
        if len(fitting) > top:
            out.append(f"    ... {len(fitting) - top} more (--top N)")
        out.append("")
        out.append("best: " + "\n".join(breakdown(fitting[0], hw)))
        best = fitting[0].layout
        out.append(f"  config: --parallel.mp {best.mp} --parallel.dp_shard {best.dp_shard} "
                   f"--parallel.dp_replicate {best.dp_replicate} --fsdp.sharding_strategy {best.strategy} "
                   f"--fsdp.activation_checkpointing {best.ac}"
                   + (f" --fsdp.ac_every {best.ac_every}" if best.ac == "selective" else "")
                   + f" --data.micro_batch_size {w.micro_batch} --train.grad_accum {fitting[0].grad_accum}"
                   + (f" --train.grad_sync {w.grad_sync}" if w.grad_sync != "last" else ""))
    else:
        out.append(no_fit_message(plan))
    too_big = [e for e in plan.estimates if not e.fits]
    if too_big and fitting:
        smallest = min(too_big, key=lambda e: e.memory.total)
        out.append(f"{len(too_big)} layouts need more than {_gib(hw.usable_bytes)} GiB (smallest of them: "
                   f"{smallest.layout.describe()}, {_gib(smallest.memory.total)} GiB)")
    for mp, reason in sorted(plan.rejected.items()):
        out.append(f"mp {mp} not considered: {reason}")
    if plan.skipped:
        dps = sorted({lay.dp for lay, _ in plan.skipped})
        out.append(f"{len(plan.skipped)} layouts skipped: the global batch of {w.global_batch} sequences is not a "
                   f"multiple of dp x micro-batch for dp in {dps}")
    return "\n".join(out)


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
        hints.append(f"more GPUs will not do: activations and buffers alone need {_gib(other)} GiB")
    if least.grad_accum > 1:
        hints.append(f"fewer accumulation steps ({least.grad_accum} keep {_gib(m.accumulated_grads)} GiB of unsharded "
                     "gradients: a smaller --global-batch or a larger --micro-batch)")
    if plan.workload.micro_batch > 1:
        hints.append("--micro-batch 1")
    hints.append(f"a shorter --seq-len (activations {_gib(m.activations)} GiB)")
    return (f"no layout fits: the smallest needs {_gib(m.total)} GiB per GPU ({least.layout.name}, "
            f"{least.layout.describe()}), but {hw.gpu_mem_gib:g} GiB less the {hw.reserve_gib:g} GiB reserve "
            f"leaves {_gib(hw.usable_bytes)} GiB. Try: " + "; ".join(hints))
