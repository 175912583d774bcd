"""Llama 2, 3, 3.1 and 4 (text) on hybridpar's tensor-parallel layers, laid out as Meta's reference code.

Parameter names, shard layouts and the RoPE convention (interleaved pairs rotated as complex
numbers) are Meta's, so `consolidated.NN.pth` checkpoints map onto this model one to one:

    tok_embeddings  ParallelEmbedding (Llama 2, split on dim) or VocabParallelEmbedding (Llama 3)
    attention.wq/wk/wv  ColumnParallelLinear      attention.wo  RowParallelLinear
    feed_forward.w1/w3  ColumnParallelLinear      feed_forward.w2  RowParallelLinear
    output  ColumnParallelLinear (logits stay split along the vocabulary)

Llama 4 (ModelArgs' n_experts, nope_layers, ...): the feed-forward of its MoE layers is models.moe's
(router, stacked experts, shared expert), the others dense; its attention's RoPE-less layers,
temperature tuning, qk norm and chunked local attention are models.llama4's.

`sequence_parallel=True` (mp > 1) keeps the hidden states between the tensor-parallel regions split
over the mp group: [batch * seq / mp, dim], each rank a contiguous part of the tokens (for one
sequence, of its positions); norms and residual adds run on 1/mp of them. The parameters are the
same, so any checkpoint loads either way. Generation runs without it.

Context parallelism (parallel.cp > 1): each cp rank feeds its two chunks of every sequence
(parallel/context.py's layout), RoPE at their global positions, attention against the whole
sequence's keys and values (`context_attention`, all-gathered over the cp group). Sequence
parallelism then splits each rank's chunks over mp. The parameters do not depend on cp.

Differences from Meta's code, invisible in the numbers: F.scaled_dot_product_attention (causal),
RoPE frequencies computed per call, kv heads replicated across ranks when mp > n_kv_heads.
Generation: `cache = model.new_cache(batch, max_len)`, then `model(tokens, start_pos=p, cache=cache)`
feeds positions p .. p + seq - 1, attending to the keys and values cached before them.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from hybridpar.config.llama4 import context_parallel_gaps
from hybridpar.mesh.device import ParallelDims
from hybridpar.parallel import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_region,
    enter_region,
    gather_from_region,
)
from hybridpar.parallel.context import context_attention, local_positions
from hybridpar.parallel.layers import ReplicatedHeadLinear, local_tensor, mp_parameter

from .args import ModelArgs, ModelArgsError, RopeScaling
from .llama4 import LayerAttention
from .moe import MoE

# --- rotary position embedding, Meta's convention --------------------------------------------


def _scale_llama3(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3's long-context rescaling: wavelengths beyond the original context slowed by `factor`."""
    scale, low_factor, high_factor, old_context = scaling
    wavelen = 2 * math.pi / freqs
    # Long wavelengths are slowed down by `scale`, short ones kept, the band between blended.
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * freqs / scale + smooth * freqs
    out = torch.where(wavelen > old_context / low_factor, freqs / scale, blended)
    return torch.where(wavelen < old_context / high_factor, freqs, out)


def rope_frequencies(head_dim: int, positions: torch.Tensor, theta: float,
                     scaled: Union[bool, RopeScaling, None]) -> torch.Tensor:
    """Complex rotations [len(positions), head_dim / 2]: pair i of position p turns by p * theta^(-2i/d).
    scaled: a RopeScaling, True for Llama 3.1's, False or None for none."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device)[: head_dim // 2].float() / head_dim))
    if scaled:
        freqs = _scale_llama3(freqs, RopeScaling() if scaled is True else scaled)
    angles = torch.outer(positions.float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim], taking (x[2i], x[2i+1]) as one complex number (Meta's layout)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * freqs_cis[None, :, None, :]).flatten(3)
    return rotated.type_as(x)


# --- key/value cache for generation -------------------------------------------------------------


class KVCache:
    """Keys and values of the positions seen so far, per layer, for this rank's kv heads.

    keys[i] and values[i] are [batch, max_len, n_local_kv_heads, head_dim]; position p of a sequence
    is written when a forward pass covers p, so the caller decides (through start_pos) what is valid.
    """

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.batch, self.max_len = batch, max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]


def _chunk_mask(seq: int, start_pos: int, device: torch.device) -> torch.Tensor:
    """[seq, start_pos + seq] True where query start_pos + i may see key j, i.e. j <= start_pos + i."""
    # SDPA's is_causal aligns the triangle to the top-left corner, wrong once keys precede the queries.
    return torch.ones(seq, start_pos + seq, dtype=torch.bool, device=device).tril(diagonal=start_pos)


# --- the network -------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Meta's RMSNorm: normalise in fp32, cast back, then scale. The weight is replicated over mp.
    With sequence parallelism each rank sees part of the positions, so the weight's gradient is
    summed over the mp group (the weight enters through copy_to_region)."""

    def __init__(self, dim: int, eps: float, parallel: ParallelDims, dtype=None, device=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.group = parallel.mp_group
        self.sequence_parallel = sequence_parallel
        self.weight = mp_parameter((dim,), Replicate(), parallel, nn.init.ones_, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = local_tensor(self.weight)
        return normed.type_as(x) * (copy_to_region(weight, self.group) if self.sequence_parallel else weight)


def _normal(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, parallel: ParallelDims, init_std: float, out_std: float, layer_id: int = 0,
                 **factory) -> None:
        super().__init__()
        mp, hd = parallel.mp, args.head_dim
        self.llama4 = LayerAttention(args, layer_id)  # RoPE or not, qk norm, temperature, chunks
        self.group = parallel.mp_group
        self.cp_group = parallel.cp_group  # None without context parallelism
        self.sequence_parallel = factory.get("sequence_parallel", False)
        self.head_dim = hd
        self.n_local_heads = args.n_heads // mp
        column = dict(bias=False, gather_output=False, init_method=_normal(init_std), parallel=parallel, **factory)
        self.wq = ColumnParallelLinear(args.dim, args.n_heads * hd, **column)
        if args.kv_heads % mp == 0:
            self.n_local_kv_heads = args.kv_heads // mp
            self.wk = ColumnParallelLinear(args.dim, args.kv_heads * hd, **column)
            self.wv = ColumnParallelLinear(args.dim, args.kv_heads * hd, **column)
        else:  # mp is a multiple of n_kv_heads: each rank computes the one kv head its q heads use
            self.n_local_kv_heads = 1
            replicated = dict(init_method=_normal(init_std), parallel=parallel, **factory)
            self.wk = ReplicatedHeadLinear(args.dim, args.kv_heads, hd, **replicated)
            self.wv = ReplicatedHeadLinear(args.dim, args.kv_heads, hd, **replicated)
        self.wo = RowParallelLinear(
            args.n_heads * hd, args.dim, bias=False, input_is_parallel=True,
            init_method=_normal(out_std), parallel=parallel, **factory,
        )

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        kv_cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        # One entry into the model-parallel region for the three projections: one reduction of the
        # input's gradient in backward instead of three.
        x = enter_region(x, self.group, self.sequence_parallel)
        if x.dim() == 2:  # sequence parallel: all the tokens, [batch * seq, dim]
            x = x.view(-1, freqs_cis.shape[0], x.shape[-1])
        batch, seq, _ = x.shape
        q = self.wq(x, copy_input=False).view(batch, seq, self.n_local_heads, self.head_dim)
        k = self.wk(x, copy_input=False).view(batch, seq, self.n_local_kv_heads, self.head_dim)
        v = self.wv(x, copy_input=False).view(batch, seq, self.n_local_kv_heads, self.head_dim)
        if self.llama4.rope:
            q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        q, k = self.llama4.queries_and_keys(q, k, start_pos)
        if self.cp_group is not None:  # this rank's two chunks against the whole sequence's keys
            return self.wo(context_attention(q, k, v, self.cp_group).reshape(batch, seq, -1))
        mask, causal = None, True
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            end = start_pos + seq
            cache_k[:batch, start_pos:end] = k
            cache_v[:batch, start_pos:end] = v
            k, v = cache_k[:batch, :end], cache_v[:batch, :end]
            if start_pos > 0:
                # One new token sees every cached key; a longer chunk needs the shifted triangle.
                causal = False
                mask = _chunk_mask(seq, start_pos, x.device) if seq > 1 else None
        local = self.llama4.local_mask(seq, start_pos, x.device)
        if local is not None:  # a chunked layer whose positions cross a chunk's end
            mask, causal = local, False
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=causal, enable_gqa=self.n_local_heads != self.n_local_kv_heads,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), the hidden size (ffn_hidden_dim unless given) split across
    model-parallel ranks."""

    def __init__(self, args: ModelArgs, parallel: ParallelDims, init_std: float, out_std: float,
                 hidden: Optional[int] = None, **factory) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim if hidden is None else hidden
        self.group = parallel.mp_group
        self.sequence_parallel = factory.get("sequence_parallel", False)
        column = dict(bias=False, gather_output=False, init_method=_normal(init_std), parallel=parallel, **factory)
        self.w1 = ColumnParallelLinear(args.dim, hidden, **column)
        self.w3 = ColumnParallelLinear(args.dim, hidden, **column)
        self.w2 = RowParallelLinear(
            hidden, args.dim, bias=False, input_is_parallel=True,
            init_method=_normal(out_std), parallel=parallel, **factory,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_region(x, self.group, self.sequence_parallel)  # w1 and w3 share one reduction of its gradient
        return self.w2(self._gated(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x already in the region -> this rank's partial sums, not reduced (a shared expert's)."""
        return self.w2(self._gated(x), reduce=False)

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.w1(x, copy_input=False)) * self.w3(x, copy_input=False)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs, parallel: ParallelDims, **factory) -> None:
        super().__init__()
        self.layer_id = layer_id
        # GPT-2 style: the projections that write into the residual stream start smaller with depth.
        init_std, out_std = 0.02, 0.02 / math.sqrt(2 * args.n_layers)
        self.attention = Attention(args, parallel, init_std, out_std, layer_id, **factory)
        if args.is_moe_layer(layer_id):
            shared = FeedForward(args, parallel, init_std, out_std, args.expert_hidden_dim, **factory)
            self.feed_forward = MoE(args, parallel, shared, init_std, out_std, **factory)
        else:
            self.feed_forward = FeedForward(args, parallel, init_std, out_std, **factory)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, parallel, **factory)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, parallel, **factory)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        kv_cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, kv_cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class TiedOutput(nn.Module):
    """The output head of a model with tied embeddings: logits from the token embedding's weight,
    which VocabParallelEmbedding splits on the vocabulary just as the untied head's. It holds no
    parameter: the weight is registered (and saved, and sharded) once, under tok_embeddings."""

    def __init__(self, embedding: nn.Module, parallel: ParallelDims, sequence_parallel: bool = False) -> None:
        super().__init__()
        self._embedding = (embedding,)  # a tuple, so that nn.Module does not register it a second time
        self.group = parallel.mp_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, *, copy_input: bool = True) -> torch.Tensor:
        """copy_input as in ColumnParallelLinear."""
        # Looked up per call: FSDP swaps the registered parameter between its sharded and full forms.
        weight = local_tensor(self._embedding[0].weight)
        return F.linear(enter_region(x, self.group, self.sequence_parallel) if copy_input else x, weight)


class Transformer(nn.Module):
    """Llama decoder. `model(tokens)` -> this rank's vocabulary shard of the logits [B, S, V/mp];
    `model(tokens, gather_logits=True)` -> the full logits [B, S, V] on every rank.

    With context parallelism (parallel.cp > 1) `tokens` is this cp rank's part of each sequence,
    [B, S / cp], its two chunks as `parallel.context.shard_sequence` cuts them; RoPE turns them by
    their global positions, attention sees the whole sequence's keys (context_attention) and the
    logits are those of this rank's tokens. Generation (a cache) runs at cp = 1.

    Weights are drawn from the global RNG as full tensors (each rank keeps its slice), so the same
    seed gives the same model at any (mp, dp) layout. Build under `torch.device("meta")` to skip
    allocation when weights will be loaded.
    """

    def __init__(
        self,
        args: ModelArgs,
        parallel: ParallelDims,
        *,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        sequence_parallel: bool = False,
        layers: Optional[Sequence[int]] = None,
        embedding: bool = True,
        head: bool = True,
    ) -> None:
        super().__init__()
        args.check(parallel.mp, parallel.ep)
        if parallel.cp > 1 and context_parallel_gaps(args):
            raise ModelArgsError(f"{context_parallel_gaps(args)}: set parallel.cp = 1")
        self.args = args
        self.group = parallel.mp_group
        # Context parallelism: this rank holds 2 of the 2 x cp chunks of every sequence (parallel.context).
        self.cp, self.cp_rank = parallel.cp, parallel.cp_rank
        self.sequence_parallel = sequence_parallel = sequence_parallel and parallel.mp > 1
        factory = dict(dtype=dtype, device=device, sequence_parallel=sequence_parallel)
        # A pipeline stage (layers, embedding, head: the pieces it keeps) draws the pieces it drops too,
        # in the whole model's order, so its weights are the whole model's; one dropped piece at a
        # time is alive. On meta nothing is drawn: a dropped piece is not built.
        kept = set(range(args.n_layers)) if layers is None else {int(i) for i in layers}
        drawn = device is None or torch.device(device).type != "meta"

        def piece(make, keep: bool):
            if keep:
                return make()
            if drawn:
                make()  # its weights drawn, then dropped
            return None

        split = VocabParallelEmbedding if args.resolved_embedding_split == "vocab" else ParallelEmbedding
        self.tok_embeddings = piece(lambda: split(args.vocab_size, args.dim, init_method=_normal(0.02),
                                                  parallel=parallel, **factory), embedding)
        # Keyed by index, as a ModuleList's state-dict keys: a pipeline stage keeps only its layers, names kept.
        blocks = {str(i): piece(lambda i=i: TransformerBlock(i, args, parallel, **factory), i in kept)
                  for i in range(args.n_layers)}
        self.layers = nn.ModuleDict({name: block for name, block in blocks.items() if block is not None})
        self.norm = RMSNorm(args.dim, args.norm_eps, parallel, **factory) if head else None
        if not head:
            self.output = None
        elif args.tie_embeddings:
            self.output = TiedOutput(self.tok_embeddings, parallel, sequence_parallel)
        else:
            self.output = ColumnParallelLinear(
                args.dim, args.vocab_size, bias=False, gather_output=False,
                init_method=_normal(0.02), parallel=parallel, **factory,
            )

    def new_cache(self, batch: int, max_len: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> KVCache:
        """An empty KVCache for `batch` sequences of up to `max_len` positions (default max_seq_len)."""
        max_len = self.args.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= self.args.max_seq_len:
            raise ValueError(f"cache max_len = {max_len} must be between 1 and max_seq_len = {self.args.max_seq_len}")
        attention = next(iter(self.layers.values())).attention
        weight = local_tensor(attention.wq.weight)
        return KVCache(self.args.n_layers, batch, max_len, attention.n_local_kv_heads, attention.head_dim,
                       dtype or weight.dtype, weight.device)

    def forward(
        self,
        tokens: torch.Tensor,
        gather_logits: bool = False,
        *,
        start_pos: int = 0,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """Logits for `tokens` [B, S] at positions start_pos .. start_pos + S - 1.

        Without a cache start_pos must be 0. With one, the keys and values of these positions are
        written into it and attention also sees the cached positions before start_pos.
        """
        # A pipeline stage after the first takes hidden states [B, S, dim]; with sequence parallelism
        # this rank's 1/mp of the tokens, [B, S / mp, dim] (as the stage before returns them).
        batch, seq = tokens.shape[:2]
        hidden = self.tok_embeddings is None
        if hidden and self.sequence_parallel:
            seq *= dist.get_world_size(self.group)
        end = start_pos + seq * self.cp  # the whole sequence's length
        if end > self.args.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len = {self.args.max_seq_len}")
        if cache is None and start_pos != 0:
            raise ValueError(f"start_pos = {start_pos} needs a cache holding the earlier positions (model.new_cache)")
        if cache is not None and self.sequence_parallel:
            raise ValueError("generation runs without sequence parallelism: set_sequence_parallel(model, False) first")
        if cache is not None and (end > cache.max_len or batch > cache.batch):
            raise ValueError(
                f"positions up to {end} for {batch} sequences do not fit a cache of max_len {cache.max_len} "
                f"and batch {cache.batch}; create it with model.new_cache(batch, max_len) large enough"
            )
        mp = dist.get_world_size(self.group)
        if self.sequence_parallel and seq % mp:
            what, fix = (f"sequence length {seq}", f"a multiple of {mp}") if self.cp == 1 else (
                f"this cp rank's part of the sequence, {seq} tokens,",
                f"a seq_len that is a multiple of {2 * self.cp * mp}")
            raise ValueError(f"{what} is not divisible by mp = {mp}: sequence parallelism gives each "
                             f"rank 1/mp of the positions; use {fix} or set parallel.sequence_parallel = false")
        if self.cp > 1:  # this rank's chunks, at their places in the whole sequence
            positions = local_positions(end, self.cp, self.cp_rank, device=tokens.device)
        else:
            positions = torch.arange(start_pos, end, device=tokens.device)
        freqs_cis = rope_frequencies(self.args.head_dim, positions, self.args.rope_theta, self.args.rope_scaling)
        if not hidden:
            h = self.tok_embeddings(tokens)
        else:  # sequence parallel: the layers take [B * S / mp, dim]
            h = tokens.reshape(-1, tokens.shape[-1]) if self.sequence_parallel else tokens
        for name, layer in self.layers.items():
            h = layer(h, freqs_cis) if cache is None else layer(h, freqs_cis, cache.layer(int(name)), start_pos)
        if self.output is None:  # a pipeline stage before the last: [B, S (/ mp), dim] to the next
            # A copy, not a view: FSDP's backward hook on a stage's output does not survive a view.
            return h if h.dim() == 3 else h.view(batch, -1, h.shape[-1]).clone()
        # Into the head's region; sequence parallel: all the tokens, laid out [batch, seq, dim] again.
        h = enter_region(self.norm(h), self.group, self.sequence_parallel).view(batch, seq, -1)
        logits = self.output(h, copy_input=False)
        return gather_from_region(logits, self.group) if gather_logits else logits
