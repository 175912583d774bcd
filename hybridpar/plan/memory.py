"""What one rank holds: its parameters (the mp slice, the FSDP shard), the activations autograd
saves for backward, and the peak memory by kind."""

from __future__ import annotations

import dataclasses
import math

from hybridpar.models.args import ModelArgs, local_param_shapes

from ..config.low_precision import MULTIPLE


def kv_heads_per_rank(args: ModelArgs, mp: int) -> int:
    """kv heads each mp rank computes: split when mp divides them, else one (replicated)."""
    return args.kv_heads // mp if args.kv_heads % mp == 0 else 1


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def sharded_numel(shape: tuple[int, ...], dp_shard: int) -> int:
    """Elements of the largest FSDP2 shard: dim 0 chunked over dp_shard (the first ranks get ceil)."""
    return math.ceil(shape[0] / dp_shard) * _numel(shape[1:])


FLOAT8_ALIGN = MULTIPLE  # a linear with another dimension stays bf16 (torchtitan's filter; _scaled_mm needs it)


def float8_linear(shape: tuple[int, ...]) -> bool:
    """Whether a block's parameter of this (local) shape is a linear that runs in float8 when float8 is on
    (the norms' weights are 1-D; the output head is not a block's and stays bf16)."""
    return len(shape) == 2 and all(n % FLOAT8_ALIGN == 0 for n in shape)


def gathered_bytes(shapes: list[tuple[int, ...]], a: int, float8_gathered: bool = False, dp_shard: int = 0) -> int:
    """Bytes of these parameters gathered in the compute dtype of `a` bytes, a float8 linear's in one
    with float8.fsdp_all_gather; dp_shard > 0: padded to dp_shard equal shards, as FSDP2 gathers them."""
    return sum((sharded_numel(x, dp_shard) * dp_shard if dp_shard else _numel(x))
               * (1 if float8_gathered and float8_linear(x) else a) for x in shapes)


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


def param_counts(args: ModelArgs, mp: int, dp_shard: int, n_layers: int = -1, embedding: bool = True,
                 head: bool = True) -> ParamCounts:
    """The whole model's, or a pipeline stage's: `n_layers` blocks, with or without the embedding and
    the head (the output projection and the final norm)."""
    shapes = local_param_shapes(args, mp)
    count = {unit: sum(_numel(s) for s in ss) for unit, ss in shapes.items()}
    sharded = {unit: sum(sharded_numel(s, dp_shard) for s in ss) for unit, ss in shapes.items()}
    kept = {"embedding": embedding, "output": head, "root": head, "block": True}
    count = {unit: n if kept[unit] else 0 for unit, n in count.items()}
    sharded = {unit: n if kept[unit] else 0 for unit, n in sharded.items()}
    n_layers = args.n_layers if n_layers < 0 else n_layers
    return ParamCounts(
        embedding=count["embedding"], block=count["block"], output=count["output"], root=count["root"],
        n_layers=n_layers,
        sharded=sharded["embedding"] + n_layers * sharded["block"] + sharded["output"] + sharded["root"],
    )


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


def gathered_kv_bytes(args: ModelArgs, mp: int, micro_batch: int, seq_len: int, compute_bytes: int) -> int:
    """One layer's K and V of the whole sequence (this mp rank's kv heads), as context parallelism's
    all-gather delivers them (hybridpar.parallel.context): what its attention keeps, and the size of
    its all-gather and of the dK/dV reduce-scatter."""
    return compute_bytes * micro_batch * seq_len * kv_heads_per_rank(args, mp) * 2 * args.head_dim


def activation_bytes(args: ModelArgs, mp: int, micro_batch: int, seq_len: int, compute_bytes: int,
                     n_checkpointed: int = 0, sequence_parallel: bool = False, cp: int = 1) -> Activations:
    """Saved tensors of hybridpar.models.llama.Transformer + vocab_parallel_cross_entropy, derived from
    the code; with context parallelism each rank holds seq_len / cp tokens of every sequence."""
    a, t = compute_bytes, micro_batch * seq_len // cp
    d, hd = args.dim, args.head_dim
    heads, kv = args.n_heads // mp, kv_heads_per_rank(args, mp)
    ffn, vocab = args.ffn_hidden_dim // mp, args.vocab_size // mp
    # RMSNorm: x.float() (x itself in fp32) for pow and mul, rsqrt [T, 1], normed.type_as(x) for
    # the weight's gradient, and the output, which the following linears save. With sequence
    # parallelism the norm sees T/mp tokens and the linears save its all-gathered output.
    ts = t // mp if sequence_parallel and mp > 1 else t
    norm = 4 * ts * d + 4 * ts + a * ts * d + a * t * d
    # wq/wk/wv outputs are not saved (RoPE's complex mul saves only the rotations); SDPA saves the
    # rotated q, k, the v projection, its output (also wo's input) and the fp32 logsumexp.
    attention = a * t * hd * (2 * heads + 2 * kv) + 4 * t * heads
    if cp > 1:
        # Its SDPA calls keep views of the all-gathered K|V of the whole sequence instead of the local k, v.
        attention += gathered_kv_bytes(args, mp, micro_batch, seq_len, a) - a * t * hd * 2 * kv
    # SwiGLU: w1 x (silu's input), silu(w1 x) and w3 x (the product's inputs), the product (w2's input).
    feed_forward = 4 * a * t * ffn
    per_block = 2 * norm + attention + feed_forward
    vocab_split = args.resolved_embedding_split == "vocab"
    embedding = 8 * t + (t if vocab_split else 0)  # int64 ids; the bool mask of out-of-shard ids
    # complex64: the table's first seq_len rows (a view), or the rows of this cp rank's positions (a copy).
    rope = (seq_len // cp) * (hd // 2) * 8
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
        per_block=per_block, block_input=a * ts * d, embedding=embedding, rope=rope, head=norm + loss,
        n_layers=args.n_layers, n_checkpointed=n_checkpointed, loss_transient=transient,
    )


@dataclasses.dataclass(frozen=True)
class Memory:
    """Peak bytes per rank by kind; everything is counted as alive at once (a little pessimistic
    for the tensors, about what a caching allocator keeps), and `allocator` its reserve on top."""

    params: float  # fp32 master shard
    grads: float  # fp32 gradient shard
    optimizer: float  # AdamW exp_avg + exp_avg_sq
    accumulated_grads: float  # unsharded gradients kept between micro-batches (grad_accum > 1)
    gathered_params: float  # compute-dtype parameters of gathered units
    grad_buffers: float  # one unit's unsharded gradient + its reduce-dtype copy
    activations: float  # saved for backward at the end of forward
    transient: float  # on top: the loss's logits peak, or a recomputed block + backward temporaries
    allocator: float = 0.0  # what the caching allocator reserves beyond the tensors (Hardware.allocator_overhead)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))
