"""Small Hugging Face Llama folders made by transformers itself (random weights, save_pretrained),
sharded into several safetensors files with an index: what a download from the Hub looks like."""

from __future__ import annotations

from pathlib import Path

import torch

# head_dim 32 and theta 500000 put RoPE bands on both sides of the llama3 thresholds
# (original context 64 / low 1 = 64, 64 / high 4 = 16), so the rescaling shows in 64 positions.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

SHAPES = {
    # GQA (4 heads, 2 kv heads), llama3 rope, a feed-forward size no Meta rule is asked for.
    "gqa_llama3": dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rope_theta=500000.0,
                       rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5),
    # Llama 2 style: no GQA, plain RoPE at theta 10000.
    "plain": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=128, max_position_embeddings=64, rope_theta=10000.0,
                  rms_norm_eps=1e-6),
}


def make_hf_folder(out: Path, shape: str = "gqa_llama3", *, tied: bool = False, dtype: torch.dtype = torch.float32,
                   seed: int = 0, shard_kb: int = 64, **config) -> Path:
    """A random LlamaForCausalLM saved by save_pretrained into `out` (several shards + index unless
    shard_kb is large). Returns out."""
    import transformers

    fields = {**SHAPES[shape], "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2, **config}
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    with torch.no_grad():  # norms away from 1, so a norm loaded wrong shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(str(out), max_shard_size=f"{shard_kb}KB")
    return out


def transformers_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own fp32 logits for `tokens` from the folder."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits
