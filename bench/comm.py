"""Bytes moved by collectives: the counter of what a step issues (hybridpar.diagnostics.collectives)
and the analytic minimum.

    with CollectiveCounter() as counter:
        train_step()
    counter.wire_bytes()      # per rank, ring-algorithm bytes sent (the nccl-tests bus formulas)
    analytic_bytes(args, mp=..., ...)
"""

from __future__ import annotations

from hybridpar.diagnostics.collectives import CollectiveCounter, Record, wire_factor  # noqa: F401 (re-exported)


# --- the analytic minimum ------------------------------------------------------------------------


def mp_local_units(args, mp: int) -> dict[str, int]:
    """Elements per model-parallel rank of each FSDP unit of hybridpar.models.llama.Transformer.

    Split weights count 1/mp; norms (and k/v weights replicated when mp > n_kv_heads) count whole.
    """
    d, hd, hidden = args.dim, args.head_dim, args.ffn_hidden_dim
    kv = args.kv_heads * hd
    kv_local = kv // mp if args.kv_heads % mp == 0 else kv
    block = (d * d) // mp * 2 + 2 * d * kv_local + 3 * d * hidden // mp + 2 * d
    embedding = args.vocab_size * d // mp  # vocab- or dim-split: the same count
    return {"tok_embeddings": embedding, "block": block, "output": args.vocab_size * d // mp, "norm": d}


def analytic_bytes(args, *, mp: int, dp_shard: int, dp_replicate: int, micro_batch: int, seq_len: int,
                   param_bytes: int = 4, reduce_bytes: int = 4, act_bytes: int = 4) -> dict[str, float]:
    """Per-rank wire bytes one optimizer step (one micro-batch) needs at least, by part.

    fsdp: every unit's parameters all-gathered once in forward; blocks again in backward (ZeRO-3:
      one block unsharded at a time; the embedding's backward needs no weights, and the head and
      final norm are used again at once, so they need not be re-gathered); gradients reduce-
      scattered over dp_shard, then the 1/dp_shard shard all-reduced over dp_replicate.
    tp: Megatron's minimum for a Llama block, per micro-batch: the attention and feed-forward
      outputs all-reduced in forward and their inputs' gradients in backward (4 x [b, s, dim] per
      block); the vocab-parallel embedding's output (all-reduce; an all-gather for the dim split);
      the head input's gradient; the vocab-parallel loss's 3 floats per token (max, target logit,
      sum of exponentials).
    scalars: target count, loss and gradient norm, one float each.
    """
    units = mp_local_units(args, mp)
    s, r, m = dp_shard, dp_replicate, mp
    per_unit = [("tok_embeddings", units["tok_embeddings"], 1), ("output", units["output"], 1),
                ("norm", units["norm"], 1)] + [("block", units["block"], 2)] * args.n_layers
    fsdp = 0.0
    for _, numel, gathers in per_unit:  # no padding: the minimum, not what FSDP's layout adds
        fsdp += gathers * wire_factor("all_gather", s) * numel * param_bytes
        fsdp += wire_factor("reduce_scatter", s) * numel * reduce_bytes
        fsdp += wire_factor("all_reduce", r) * numel / s * reduce_bytes
    activation = micro_batch * seq_len * args.dim * act_bytes
    tokens = micro_batch * seq_len
    tp = wire_factor("all_reduce", m) * activation * (4 * args.n_layers + 1)  # blocks + head input grad
    if args.resolved_embedding_split == "vocab":
        tp += wire_factor("all_reduce", m) * activation
    else:
        tp += wire_factor("all_gather", m) * activation
    tp += wire_factor("all_reduce", m) * 3 * tokens * 4
    dp = s * r
    scalars = 2 * wire_factor("all_reduce", dp) * 4 + wire_factor("all_reduce", dp * m) * 4
    return {"fsdp": fsdp, "tp": tp, "scalars": scalars, "total": fsdp + tp + scalars}
