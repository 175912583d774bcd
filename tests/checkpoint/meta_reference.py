"""A test oracle: Meta's Llama inference model, written from scratch in the style of Meta's
reference code (llama, llama3, llama-models), on fairscale's model-parallel layers.

It shares no code with models/llama.py: its own ModelArgs, RoPE as a precomputed table of complex
rotations (Llama 3.1's frequency scaling as a per-frequency rule), attention as explicit matmuls with
an additive causal mask and an fp32 softmax, grouped-query attention by repeating kv heads, and
RMSNorm in fp32. It loads a checkpoint the way Meta's `Llama.build` does: params.json into
`ModelArgs(max_seq_len=..., max_batch_size=..., **params)` (so a params.json holding those fields
fails here as it would there), the files sorted by name, `len(files) == model-parallel size`, each
rank its own file, `load_state_dict(strict=False)`, where only `rope.freqs` may be left over.

Only the prompt pass is modelled (start_pos 0, no kv cache): what a logits comparison needs.
fairscale's groups come from `hybridpar.parallel.fairscale.use_mesh(parallel)`, which must stay
active around both `build` and the forward.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.initialize import get_model_parallel_rank, get_model_parallel_world_size
from fairscale.nn.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    use_scaled_rope: bool = False
    max_batch_size: int = 32
    max_seq_len: int = 2048


def _keep(w):  # Meta's layers skip initialisation: the checkpoint overwrites every weight
    return w


def scaled_frequencies(freqs: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: keep short wavelengths, slow long ones by 8, interpolate in between (one by one)."""
    factor, low, high, original_context = 8.0, 1.0, 4.0, 8192
    out = []
    for f in freqs.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < original_context / high:
            out.append(f)
        elif wavelength > original_context / low:
            out.append(f / factor)
        else:
            t = (original_context / wavelength - low) / (high - low)
            out.append((1 - t) * f / factor + t * f)
    return torch.tensor(out, dtype=freqs.dtype)


def precompute_freqs_cis(head_dim: int, length: int, theta: float, scaled: bool) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    if scaled:
        freqs = scaled_frequencies(freqs)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # [length, head_dim / 2] complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    def rotate(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotation = freqs_cis.view(1, xc.shape[1], 1, xc.shape[-1])
        return torch.view_as_real(xc * rotation).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d], each kv head repeated for its query group."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        mp = get_model_parallel_world_size()
        n_kv_heads = args.n_kv_heads if args.n_kv_heads is not None else args.n_heads
        self.n_local_heads = args.n_heads // mp
        self.n_local_kv_heads = n_kv_heads // mp
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        column = dict(bias=False, gather_output=False, init_method=_keep)
        self.wq = ColumnParallelLinear(args.dim, args.n_heads * self.head_dim, **column)
        self.wk = ColumnParallelLinear(args.dim, n_kv_heads * self.head_dim, **column)
        self.wv = ColumnParallelLinear(args.dim, n_kv_heads * self.head_dim, **column)
        self.wo = RowParallelLinear(args.n_heads * self.head_dim, args.dim, bias=False, input_is_parallel=True, init_method=_keep)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, self.n_local_heads, self.head_dim)
        xk = self.wk(x).view(b, s, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(x).view(b, s, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, values).transpose(1, 2).contiguous().view(b, s, -1)
        return self.wo(out)


def feed_forward_size(hidden: int, multiple_of: int, multiplier: Optional[float]) -> int:
    """Meta's FeedForward size from hidden = 4 * dim: two thirds, times the multiplier, rounded up."""
    hidden = int(2 * hidden / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, multiple_of: int, multiplier: Optional[float]) -> None:
        super().__init__()
        hidden = feed_forward_size(hidden, multiple_of, multiplier)
        self.w1 = ColumnParallelLinear(dim, hidden, bias=False, gather_output=False, init_method=_keep)
        self.w2 = RowParallelLinear(hidden, dim, bias=False, input_is_parallel=True, init_method=_keep)
        self.w3 = ColumnParallelLinear(dim, hidden, bias=False, gather_output=False, init_method=_keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """`llama_version` 2: ParallelEmbedding (split on dim); 3: VocabParallelEmbedding."""

    def __init__(self, args: ModelArgs, llama_version: int) -> None:
        super().__init__()
        self.args = args
        embedding = ParallelEmbedding if llama_version == 2 else VocabParallelEmbedding
        self.tok_embeddings = embedding(args.vocab_size, args.dim, init_method=_keep)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = ColumnParallelLinear(args.dim, args.vocab_size, bias=False, init_method=_keep)
        self.freqs_cis = precompute_freqs_cis(
            args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta, args.use_scaled_rope
        )

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full logits [B, S, V] (fp32) of a prompt starting at position 0."""
        s = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:s]
        mask = None
        if s > 1:
            mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1).type_as(h)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()


def build(folder, *, llama_version: int, vocab_size: int, max_seq_len: int = 64, max_batch_size: int = 4) -> Transformer:
    """Meta's Llama.build: this model-parallel rank's file into a model (fairscale state must be set).

    vocab_size plays the tokenizer's part: it replaces params.json's -1 (Llama 2), or must equal it.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.pth"))
    mp = get_model_parallel_world_size()
    assert len(files) == mp, f"{len(files)} checkpoint files in {folder}, model-parallel size {mp}"
    checkpoint = torch.load(files[get_model_parallel_rank()], map_location="cpu", weights_only=True)
    params = json.loads((folder / "params.json").read_text())
    args = ModelArgs(max_seq_len=max_seq_len, max_batch_size=max_batch_size, **params)
    if args.vocab_size == -1:
        args.vocab_size = vocab_size
    assert args.vocab_size == vocab_size, f"params.json vocab_size {args.vocab_size}, tokenizer {vocab_size}"
    model = Transformer(args, llama_version)
    result = model.load_state_dict(checkpoint, strict=False)
    assert not result.missing_keys, f"keys missing from the checkpoint: {result.missing_keys}"
    assert set(result.unexpected_keys) <= {"rope.freqs"}, f"unexpected keys: {result.unexpected_keys}"
    return model
