"""Small Hugging Face Llama folders made by transformers itself (random weights, save_pretrained),
sharded into several safetensors files with an index: what a download from the Hub looks like.
Llama 1-3 (LlamaForCausalLM) and Llama 4 (Llama4ForCausalLM, Llama4ForConditionalGeneration)."""

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


def folder_tensors(folder: Path) -> dict:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    from safetensors import safe_open

    tensors = {}
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def transformers_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own fp32 logits for `tokens` from the folder."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


# A tiny Llama 4 with every feature in use: 4 experts, top-2, on layers 1 and 3 (0 and 2 dense); layer 3
# without RoPE (temperature tuning strong enough to show from position 1: floor_scale 2, attn_scale 2);
# chunks of 8 positions on the RoPE layers, shorter than the sequences; qk norm; Scout's llama3 RoPE
# with equal low and high factors. Each expert's hidden size (32, 16 per rank at mp 2) keeps the rows
# 16-byte aligned, so the experts run as torch._grouped_mm.
LLAMA4 = dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=64,
              num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0],
              attention_chunk_size=8, attn_temperature_tuning=True, floor_scale=2, attn_scale=2.0, use_qk_norm=True,
              rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                                  "original_max_position_embeddings": 16},
              bos_token_id=1, eos_token_id=2)
# The smallest vision tower transformers builds, beside the text model of a Llama4ForConditionalGeneration.
LLAMA4_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                     patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16,
                     pixel_shuffle_ratio=0.5)


def make_llama4_folder(out: Path, *, multimodal: bool = False, seed: int = 0, shard_kb: int = 64, **config) -> Path:
    """A random Llama4ForCausalLM (or, multimodal, a Llama4ForConditionalGeneration around it) saved by
    save_pretrained into `out`, in several shards. Returns out."""
    import transformers

    text = transformers.Llama4TextConfig(**{**LLAMA4, **config})
    torch.manual_seed(seed)
    if multimodal:
        model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
            text_config=text.to_dict(), vision_config=LLAMA4_VISION))
    else:
        model = transformers.Llama4ForCausalLM(text)
    with torch.no_grad():  # norms away from 1, so a norm loaded wrong shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out), max_shard_size=f"{shard_kb}KB")
    return out


def transformers_llama4_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own fp32 logits for `tokens` from a Llama 4 folder (text only for a multimodal one)."""
    import json

    import transformers

    multimodal = json.loads((Path(folder) / "config.json").read_text())["model_type"] == "llama4"
    kind = transformers.Llama4ForConditionalGeneration if multimodal else transformers.Llama4ForCausalLM
    model = kind.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    model.eval()
    # A multimodal model's forward on text alone runs its language_model on the token embeddings; called
    # directly here, as transformers 5.24's own forward fails building its output (no image_outputs).
    with torch.no_grad():
        return (model.language_model if multimodal else model)(input_ids=tokens).logits
