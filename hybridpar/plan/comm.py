"""Step time: the FLOPs of a step and the bytes and seconds of its collectives."""

from __future__ import annotations

import dataclasses

from hybridpar.models.args import ModelArgs

from ..config.dtypes import dtype_bytes
from ..parallel.cost import collective_seconds
from .inputs import Hardware, Layout, Workload
from .memory import gathered_bytes, gathered_kv_bytes, local_param_shapes, param_counts, sharded_numel

LOSS_CALLS = 2  # vocab_parallel_cross_entropy: the logits' max, then the exp-sum and target logit together
flops_per_token = ModelArgs.flops_per_token  # the trainer's MFU count, as a function of (args, seq_len)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step on every rank."""

    compute: float  # kernels (plan.compute), recomputation, FSDP's copies and the optimizer included
    tp_comm: float  # tensor-parallel collectives (on the critical path)
    dp_comm: float  # FSDP all-gathers, reduce-scatters and replica all-reduces
    dp_exposed: float  # the part of dp_comm that compute does not hide
    # The compute slowed while FSDP's collectives overlap it, on the SMs their NCCL kernels leave (overlapped).
    dp_contention: float = 0.0
    # Context parallelism's K/V all-gathers and dK/dV reduce-scatters, and the part compute does not hide.
    cp_comm: float = 0.0
    cp_exposed: float = 0.0
    # Pipeline parallelism: the stages' activation and gradient sends, and the bubble (idle seconds).
    pp_comm: float = 0.0
    pp_bubble: float = 0.0
    # Expert parallelism's all-to-alls (dispatch and combine), on the critical path (plan.experts).
    ep_comm: float = 0.0

    @property
    def step(self) -> float:
        return (self.compute + self.tp_comm + self.cp_exposed + self.dp_exposed + self.dp_contention + self.pp_comm
                + self.pp_bubble + self.ep_comm)


def overlapped(comm: float, busy: float, share: float) -> tuple[float, float]:
    """(exposed, contention): what `comm` seconds of NCCL collectives issued beside `busy` seconds of
    compute add to it. While they run their kernels hold `share` of the SMs (Hardware.nccl_share) and the
    compute runs on the rest, so the pair takes max(busy + share x comm, comm): the part compute does not
    hide, and where it hides more than that, the compute the held SMs slow."""
    exposed = max(0.0, comm - busy)
    return exposed, max(0.0, share * comm - exposed)


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
    """Bytes one rank hands to collectives, and the calls: tensor-parallel and FSDP per
    micro-batch, gradient reduction per step. Sizes as nccl-tests counts them: the tensor for all-reduce, the gathered
    output for all-gather, the unreduced input for reduce-scatter."""

    tp_all_reduce: float  # over the mp group, per micro-batch
    tp_all_gather: float  # over the mp group, per micro-batch (ParallelEmbedding's output; sequence parallelism)
    tp_reduce_scatter: float  # over the mp group, per micro-batch (sequence parallelism)
    fsdp_all_gather: float  # over dp_shard x cp, per micro-batch (forward, and backward when resharding)
    fsdp_reduce_scatter: float  # over dp_shard x cp, per step
    replica_all_reduce: float  # over dp_replicate, per step (hybrid sharding)
    # How many calls those are: what latency and per-call costs scale with.
    tp_calls: int = 0  # per micro-batch
    fsdp_gather_calls: int = 0  # per micro-batch
    fsdp_reduce_calls: int = 0  # per step (per micro-batch with grad_sync "every")
    replica_calls: int = 0  # per step
    cp_all_gather: float = 0.0  # over the cp group, per micro-batch: each block's K|V (and again when recomputed)
    cp_reduce_scatter: float = 0.0  # over the cp group, per micro-batch: each block's dK|dV
    cp_calls: int = 0  # per micro-batch


def collective_bytes(args: ModelArgs, layout: Layout, workload: Workload) -> CommBytes:
    """What models/llama.py, vocab_parallel_cross_entropy and apply_fsdp issue (tests count them)."""
    mp, ds, dr, L = layout.mp, layout.fsdp_shard, layout.dp_replicate, args.n_layers
    a, r = dtype_bytes(workload.param_dtype), dtype_bytes(workload.reduce_dtype)
    t = workload.micro_batch * workload.seq_len // layout.cp  # this rank's tokens
    counts = param_counts(args, mp, ds)
    tp_ar = tp_ag = tp_rs = 0.0
    n_ar = n_ag = n_rs = 0
    if mp > 1:
        act = t * args.dim * a
        n_ac = layout.checkpointed_blocks(L)
        vocab_split = args.resolved_embedding_split == "vocab"
        if layout.sequence_parallel:
            # Each region's entry (attention, feed-forward, head) all-gathers the sequence in forward
            # and reduce-scatters its gradient; each exit (wo, w2, VocabParallelEmbedding) the
            # reverse. A recomputed block repeats its forward up to w2's input: the two entries and
            # wo's exit. ParallelEmbedding gathers the embedding dim, then its gradient's sequence.
            # The norm weights' gradients are summed over mp (2 per block and the final one).
            n_ag = 2 * L + 2 * L + 1 + 2 * n_ac + (1 if vocab_split else 2)
            n_rs = 2 * L + 2 * L + 1 + n_ac + (1 if vocab_split else 0)
            tp_ag, tp_rs = act * n_ag, act * n_rs
            n_ar = 2 * L + 1 + LOSS_CALLS
            tp_ar = (2 * L + 1) * args.dim * a + 3 * t * 4
        else:
            # Forward: wo and w2 sum their partial outputs (2 per block). Backward: the attention's
            # and the feed-forward's inputs enter the region once each (wq/wk/wv and w1/w3 share
            # it), so 2 gradient all-reduces per block, and 1 for the output head. A recomputed
            # block repeats only wo's: recomputation stops once w2's input is back, before w2's
            # all-reduce. The loss reduces 3 fp32 numbers per token.
            n_ar = 2 * L + 2 * L + 1 + n_ac
            tp_ar = act * n_ar + 3 * t * 4
            n_ar += LOSS_CALLS
            if vocab_split:
                tp_ar += act  # VocabParallelEmbedding sums the shards' lookups
                n_ar += 1
            else:
                tp_ag += act  # ParallelEmbedding gathers the embedding dim
                n_ag += 1
        if args.kv_heads % mp:  # replicated wk/wv: their weight gradients are summed over mp
            tp_ar += L * 2 * args.kv_heads * args.head_dim * args.dim * a
            n_ar += 2 * L
    shapes = local_param_shapes(args, mp)
    padded = {unit: sum(sharded_numel(x, ds) * ds for x in xs) for unit, xs in shapes.items()}
    every_unit = padded["embedding"] + L * padded["block"] + padded["output"] + padded["root"]
    # What the all-gathers carry: the compute dtype, the blocks' float8 linears' weights in 1 byte with
    # float8.fsdp_all_gather (the embedding and the output head are not float8).
    float8 = workload.float8_gathered(ds)
    gathered = {unit: gathered_bytes(xs, a, float8 and unit == "block", ds) for unit, xs in shapes.items()}
    # FSDP units: the blocks, the root, and the embedding and the head, unless tied (apply_fsdp then
    # keeps the shared weight in the root).
    units = L + 1 + (0 if args.tie_embeddings else 2)
    # The embedding, the head and the root stay gathered from forward to backward; the blocks are
    # gathered again in backward unless resharding is off.
    blocks = 2 * L if layout.reshard_after_forward else L
    ag = (gathered["embedding"] + blocks * gathered["block"] + gathered["output"] + gathered["root"]) if ds > 1 else 0.0
    rs = every_unit * r if ds > 1 else 0.0
    ar = counts.sharded * r if dr > 1 else 0.0
    gathers = units + (L if layout.reshard_after_forward else 0) if ds > 1 else 0
    cp_ag = cp_rs = 0.0
    n_cp = 0
    if layout.cp > 1:
        # hybridpar.parallel.context: one all-gather of K|V per block's forward (recomputation repeats
        # it), one reduce-scatter of dK|dV per block's backward.
        kv = gathered_kv_bytes(args, mp, workload.micro_batch, workload.seq_len, a)
        n_gather = L + layout.checkpointed_blocks(L)
        cp_ag, cp_rs, n_cp = kv * n_gather, kv * L, n_gather + L
    return CommBytes(tp_ar, tp_ag, tp_rs, ag, rs, ar, tp_calls=n_ar + n_ag + n_rs, fsdp_gather_calls=gathers,
                     fsdp_reduce_calls=units if ds > 1 else 0, replica_calls=units if dr > 1 else 0,
                     cp_all_gather=cp_ag, cp_reduce_scatter=cp_rs, cp_calls=n_cp)
