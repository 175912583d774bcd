"""Llama 4's attention, as transformers' Llama4TextAttention computes it; models.llama.Attention applies
these per layer (ModelArgs' fields, hybridpar.models.args):

- RoPE layers (not in nope_layers): q and k rotated as in Llama 3 (Meta's interleaved pairs, which
  Llama 4's Hugging Face weights keep too), then RMS-normalised without a weight when use_qk_norm;
  they attend only to the keys of their own chunk of attention_chunk_size positions (chunks start
  at position 0, multiples of the size), causally.
- RoPE-less layers: no rotation and no qk norm; with attn_temperature_tuning the query at position
  p is scaled by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) (longer contexts, sharper
  attention); they see the whole sequence, causally.
"""

from __future__ import annotations

from typing import Optional

import torch

from .args import ModelArgs


class LayerAttention:
    """What Llama 4 changes in one layer's attention (none of it for a Llama 3 layer)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        self.rope = args.uses_rope(layer)
        self.qk_norm_eps: Optional[float] = args.norm_eps if args.use_qk_norm and self.rope else None
        self.temperature = (args.floor_scale, args.attn_scale) if args.attn_temperature_tuning and not self.rope else None
        self.chunk: Optional[int] = args.attention_chunk_size if self.rope else None

    def queries_and_keys(self, q: torch.Tensor, k: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [batch, seq, heads, head_dim] after RoPE (or in its place): normed, or scaled."""
        if self.qk_norm_eps is not None:
            q, k = rms_normalise(q, self.qk_norm_eps), rms_normalise(k, self.qk_norm_eps)
        if self.temperature is not None:
            q = scale_queries(q, start_pos, *self.temperature)
        return q, k

    def local_mask(self, seq: int, start_pos: int, device: torch.device) -> Optional[torch.Tensor]:
        """The chunked causal mask [seq, start_pos + seq] when the positions cross a chunk's end, else None."""
        if self.chunk is None or start_pos + seq <= self.chunk:
            return None
        queries = torch.arange(start_pos, start_pos + seq, device=device)[:, None]
        keys = torch.arange(start_pos + seq, device=device)[None, :]
        return (keys <= queries) & (keys // self.chunk == queries // self.chunk)


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 and cast back (Llama 4's qk norm: no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def scale_queries(q: torch.Tensor, start_pos: int, floor_scale: int, attn_scale: float) -> torch.Tensor:
    """q [batch, seq, heads, head_dim] at positions start_pos.. scaled by Llama 4's attention temperature."""
    positions = torch.arange(start_pos, start_pos + q.shape[1], device=q.device).float()
    scales = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * scales[None, :, None, None]).to(q.dtype)
