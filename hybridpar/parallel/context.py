"""Context parallelism's attention, as Meta trained Llama 3's long-context stage ("The Llama 3 Herd
of Models", 3.3.2): each rank holds part of every sequence, keys and values are all-gathered.

The layout. A sequence of S tokens is cut into 2 x cp chunks of c = S / (2 cp) tokens; cp rank i
holds chunks i and 2cp-1-i, concatenated ([b, 2c, ...]). Under a causal mask chunk j costs about
j + 1/2 chunk-squares, so every rank does the same work, (2cp - 1) c^2 + c(c+1) query-key pairs
(contiguous parts would leave the last rank 2cp - 1 times the first one's work).

The attention. K and V (kv heads only: GQA keeps them small) are all-gathered over the cp group in
one collective and put in global order; each local query chunk j attends to the keys up to its own
end, (j + 1) c of them, under a lower-right causal mask: no score matrix of the whole sequence.
The backward of the all-gather reduce-scatters dK/dV (summed over ranks, each rank keeps its own
chunks'). At cp = 1 it is the model's plain causal SDPA call, no collective. Per chunk:
- off the CPU, one SDPA call with `torch.nn.attention.bias.causal_lower_right`, which CUDA's flash
  or efficient kernel takes without a mask where SDPA's checks allow them (not yet run on a GPU);
- on the CPU, where SDPA would materialise that bias as an fp32 c x (j + 1) c mask and save it for
  backward (more than the rest at long sequences), no mask at all: the keys before the chunk (all
  visible) and its own c keys (the kernel's causal triangle) in two calls to SDPA's CPU flash
  kernel, merged by their log-sum-exps; backward keeps q, k, v, out and log-sum-exp, as SDPA's
  causal call does (`_LowerRightCausalCPU`).
torch's own ring attention (torchtitan's CP) has no CPU strategy; this runs and is tested on gloo.

Where it is used:
- the mesh's cp dimension, (pp, dp_replicate, dp_shard, cp, mp), mp innermost and cp next to it; the
  cp ranks of a data-parallel coordinate hold the same parameters, so FSDP shards over
  dp_shard x cp and gradients are reduced over every rank holding a copy (torchtitan's dp_shard_cp);
- the data loader gives every cp rank of a dp coordinate the same sequences, keyed by the dp rank;
  the step (train/step.py context_parts, after the data guard hashed the whole sequences) takes
  this rank's part of inputs and targets with `shard_sequence`; preflight checks seq_len % (2 cp);
- models/llama.py: the Transformer feeds RoPE the global positions (`local_positions`) and
  Attention calls `context_attention(q, k, v, parallel.cp_group)` where it calls SDPA at cp = 1
  (generation with a kv cache runs at cp = 1);
- the loss is the mean over every token of the global batch: each cp rank sums its tokens' losses
  and the sum and the token count are reduced over dp x cp before dividing (train/step.py).
Under torch.compile the whole function traces into one graph (the CPU's autograd Function as it
is; off the CPU the mask as a boolean tensor: `_lower_right`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.nn.attention.bias import causal_lower_right

from ..compat.torch import cpu_flash_attention, cpu_flash_attention_backward, is_fake
from .mappings import gather_from_sequence_region


class ContextParallelError(ValueError):
    """A sequence the context-parallel layout cannot cut."""


def chunk_size(seq_len: int, cp: int) -> int:
    """Tokens per chunk, seq_len / (2 cp); one line saying what to change if it does not divide."""
    if cp < 1:
        raise ContextParallelError(f"context parallelism cp = {cp}: it must be 1 or more")
    if seq_len <= 0 or seq_len % (2 * cp):
        raise ContextParallelError(
            f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}: context parallelism cuts each "
            f"sequence into 2 x cp chunks; use a seq_len that is a multiple of {2 * cp} or a smaller cp")
    return seq_len // (2 * cp)


def _local_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The global indices of the two chunks cp rank `cp_rank` holds, in the order it holds them."""
    if not 0 <= cp_rank < cp:
        raise ContextParallelError(f"cp rank {cp_rank} is outside 0..{cp - 1} (cp = {cp})")
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp: int, cp_rank: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The global positions of the tokens cp rank `cp_rank` holds, [seq_len / cp] int64: for RoPE
    (global positions) and for slicing data."""
    c = chunk_size(seq_len, cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in _local_chunks(cp, cp_rank)])


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of a whole-sequence tensor ([batch, seq, ...] by default): its two chunks
    along `dim`, concatenated (a copy when cp > 1)."""
    c = chunk_size(x.shape[dim], cp)
    if cp == 1:
        return x
    return torch.cat([x.narrow(dim, j * c, c) for j in _local_chunks(cp, cp_rank)], dim=dim)


def _to_global_order(parts: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp * 2c, ...], every rank's part in rank order -> the sequence in global order (dim 0)."""
    chunks = parts.chunk(2 * cp, dim=0)  # rank r's chunks r and 2cp-1-r are chunks[2r], chunks[2r + 1]
    first = [chunks[2 * r] for r in range(cp)]
    second = [chunks[2 * r + 1] for r in reversed(range(cp))]
    return torch.cat(first + second, dim=0)


def _cp_size(group: Optional[ProcessGroup]) -> int:
    # None: no context parallelism (a model built without a cp group); never the default group.
    return 1 if group is None else dist.get_world_size(group)


def _local_length(n: int, what: str) -> int:
    if n % 2:
        raise ContextParallelError(
            f"{what} has {n} tokens along the sequence, an odd number: a cp rank holds two equal chunks; cut the "
            "sequence with shard_sequence (seq_len a multiple of 2 x cp)")
    return n // 2


def gather_sequence(x: torch.Tensor, group: Optional[ProcessGroup], dim: int = 1) -> torch.Tensor:
    """Every cp rank's part of the sequence -> the whole sequence in global order along `dim` (the
    inverse of shard_sequence). Differentiable: the backward reduce-scatters, so each rank gets the
    gradient of its own chunks summed over the ranks' uses of them."""
    cp = _cp_size(group)
    if cp == 1:
        return x
    _local_length(x.shape[dim], "this rank's part")
    # The sequence dim first: all-gather and reduce-scatter along dim 0 move contiguous blocks.
    parts = gather_from_sequence_region(x.movedim(dim, 0), group)
    return _to_global_order(parts, cp).movedim(0, dim)


def _lower_right(queries: int, keys: int, like: torch.Tensor):
    """The causal mask of the last `queries` of `keys` positions. torch.compile cannot trace the
    CausalBias subclass (a graph break that drops the whole attention loop to eager) and fake
    tensors (the dry run's) cannot make one: there the same triangle as a boolean tensor."""
    if torch.compiler.is_compiling() or is_fake(like):
        return torch.ones(queries, keys, dtype=torch.bool, device=like.device).tril(diagonal=keys - queries)
    return causal_lower_right(queries, keys)


class _LowerRightCausalCPU(torch.autograd.Function):
    """Causal attention of the last Lq of Lk positions on the CPU, without a mask: the Lk - Lq keys
    before the queries (all visible, no mask) and the Lq keys beside them (the kernel's own causal
    triangle, which skips the blocks above it) in two calls to SDPA's CPU flash kernel, merged by
    their log-sum-exps. Saved for backward: q, k, v, the output and its log-sum-exp, as SDPA's
    causal call saves. (SDPA given causal_lower_right on the CPU materialises an fp32 Lq x Lk mask
    and saves it: 4 c^2 (2 cp + 1) bytes per layer and rank, at long sequences more than the rest.)
    q [b, heads, Lq, d], k and v [b, kv_heads, Lk, d] (GQA: the kernel takes kv heads as they are)."""

    @staticmethod
    def forward(ctx, q, k, v):
        prefix = k.shape[2] - q.shape[2]
        out, lse = cpu_flash_attention(q, k[:, :, prefix:], v[:, :, prefix:], True)
        if prefix:
            seen, seen_lse = cpu_flash_attention(q, k[:, :, :prefix], v[:, :, :prefix], False)
            # softmax over both key sets = each part's softmax weighted by its share of the total mass
            merged = torch.logaddexp(seen_lse, lse)
            out = (seen.float() * (seen_lse - merged).exp().unsqueeze(-1)
                   + out.float() * (lse - merged).exp().unsqueeze(-1)).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Given the whole attention's output and log-sum-exp, each part's backward gives that part's
        # keys their gradients and its share of dq.
        q, k, v, out, lse = ctx.saved_tensors
        prefix = k.shape[2] - q.shape[2]
        grad = grad.contiguous()
        dq, dk, dv = cpu_flash_attention_backward(grad, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, True)
        if prefix:
            dq_seen, dk_seen, dv_seen = cpu_flash_attention_backward(
                grad, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, False)
            dq, dk, dv = dq + dq_seen, torch.cat([dk_seen, dk], dim=2), torch.cat([dv_seen, dv], dim=2)
        return dq, dk, dv


def _lower_right_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last query.shape[2] of keys.shape[2] positions ([b, heads, L, d])."""
    if query.device.type == "cpu":
        return _LowerRightCausalCPU.apply(query, keys, values)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=_lower_right(query.shape[2], keys.shape[2], query),
                                          enable_gqa=query.shape[1] != keys.shape[1])


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Causal attention of this cp rank's tokens against the whole sequence's keys.

    q [batch, 2c, heads, head_dim], k and v [batch, 2c, kv_heads, head_dim]: the model's layout
    (models/llama.py's Attention, before its transpose), this rank's two chunks (shard_sequence),
    RoPE applied at global positions; heads a multiple of kv_heads (GQA, SDPA's enable_gqa: kv
    heads are never repeated). Returns [batch, 2c, heads, head_dim], this rank's tokens. `group`
    is the cp group (None or one rank: plain causal attention, no collective).
    """
    gqa = q.shape[2] != k.shape[2]
    cp = _cp_size(group)
    if cp == 1:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2)
    c = _local_length(q.shape[1], "this rank's part of the queries")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ContextParallelError(f"q, k and v hold {q.shape[1]}, {k.shape[1]} and {v.shape[1]} tokens: "
                                   "they must hold the same chunks")
    # K and V in one all-gather: one collective, one reduce-scatter of dK|dV in the backward.
    kv = gather_sequence(torch.cat([k, v], dim=-1), group, dim=1).transpose(1, 2)  # [b, kv_heads, S, dk + dv]
    keys, values = kv[..., :k.shape[-1]], kv[..., k.shape[-1]:]
    outs = []
    for slot, chunk in enumerate(_local_chunks(cp, dist.get_rank(group))):
        end = (chunk + 1) * c  # the keys up to this chunk's end; the last c of them under the triangle
        query = q[:, slot * c:(slot + 1) * c].transpose(1, 2)
        outs.append(_lower_right_attention(query, keys[:, :, :end], values[:, :, :end]))
    return torch.cat(outs, dim=2).transpose(1, 2)
