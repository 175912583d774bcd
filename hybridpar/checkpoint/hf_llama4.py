"""Hugging Face's Llama 4 text layout (transformers' Llama4ForCausalLM), for hf.py's export and
hf_read's import of a model with Llama 4's architecture (ModelArgs.llama4):

    tok_embeddings / norm / output       model.embed_tokens / model.norm / lm_head
    layers.N.attention.wq/wk/wv/wo       model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj
    layers.N.attention_norm / ffn_norm   model.layers.N.input_layernorm / post_attention_layernorm
    dense layer: feed_forward.w1/w3/w2   model.layers.N.feed_forward.gate_proj/up_proj/down_proj
    MoE layer:   feed_forward.router     model.layers.N.feed_forward.router
      feed_forward.experts.w1, w3 [E, F, D]  ->  feed_forward.experts.gate_up_proj [E, D, 2F] (w1ᵀ, then w3ᵀ)
      feed_forward.experts.w2 [E, D, F]      ->  feed_forward.experts.down_proj [E, F, D] (w2ᵀ)
      feed_forward.shared_expert.w1/w3/w2    ->  feed_forward.shared_expert.gate_proj/up_proj/down_proj

No RoPE permutation: transformers' Llama 4 rotates Meta's interleaved pairs, as hybridpar does. A
Llama4ForConditionalGeneration folder holds the same under `language_model.` (TEXT_PREFIX), beside
its vision tower's tensors; its config.json has the text model's fields in "text_config".
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from hybridpar.models.args import ModelArgs

from .foreign import model_shapes

TEXT_PREFIX = "language_model."  # a Llama4ForConditionalGeneration's text model
_ATTENTION = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
              "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight"}
_DENSE = {"feed_forward.w1.weight": "feed_forward.gate_proj.weight",
          "feed_forward.w3.weight": "feed_forward.up_proj.weight",
          "feed_forward.w2.weight": "feed_forward.down_proj.weight"}
_SHARED = {"feed_forward.shared_expert.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
           "feed_forward.shared_expert.w3.weight": "feed_forward.shared_expert.up_proj.weight",
           "feed_forward.shared_expert.w2.weight": "feed_forward.shared_expert.down_proj.weight"}
_NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_GATE_UP, _DOWN = "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"


class HFTensor(NamedTuple):
    """One tensor of a Hugging Face folder: its name and shape there, and the hybridpar parameters
    (hybridpar.models.llama's names) it is made of, in order."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[str, ...]


def llama4_tensors(args: ModelArgs) -> list[HFTensor]:
    """Every tensor of the Llama4ForCausalLM of `args`, in transformers' state_dict order."""
    shapes = model_shapes(args)
    d, e, f = args.dim, args.n_experts, args.expert_hidden_dim
    tensors = [HFTensor("model.embed_tokens.weight", shapes["tok_embeddings.weight"], ("tok_embeddings.weight",))]
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        named = lambda names: [HFTensor(theirs + t, shapes[ours + o], (ours + o,)) for o, t in names.items()]  # noqa: E731
        tensors += named(_ATTENTION)
        if args.is_moe_layer(i):
            tensors += [HFTensor(theirs + _GATE_UP, (e, d, 2 * f), (ours + "feed_forward.experts.w1",
                                                                   ours + "feed_forward.experts.w3")),
                        HFTensor(theirs + _DOWN, (e, f, d), (ours + "feed_forward.experts.w2",)),
                        *named({"feed_forward.router.weight": "feed_forward.router.weight"}), *named(_SHARED)]
        else:
            tensors += named(_DENSE)
        tensors += named(_NORMS)
    tensors.append(HFTensor("model.norm.weight", shapes["norm.weight"], ("norm.weight",)))
    if not args.tie_embeddings:
        tensors.append(HFTensor("lm_head.weight", shapes["output.weight"], ("output.weight",)))
    return tensors


def to_llama4(tensor: HFTensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The Hugging Face tensor from its parts (full tensors, in tensor.parts' order)."""
    if tensor.name.endswith((_GATE_UP, _DOWN)):  # x @ W layout: each expert's weights transposed
        return torch.cat([p.transpose(1, 2) for p in parts], dim=-1)
    return parts[0]


def llama4_block(name: str, offset: Sequence[int], shape: Sequence[int], hidden: int) -> tuple[str, tuple, bool]:
    """Where block [offset, offset + shape) of hybridpar parameter `name` lies in the folder: (the
    suffix after "model.layers.N." or the top-level name, its index there, transposed or not).
    hidden: the experts' full hidden size (w3's columns of gate_up_proj start there)."""
    box = [slice(o, o + n) for o, n in zip(offset, shape)]
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name], tuple(box), False
    layer, own = name.split(".", 2)[1:]
    prefix = f"model.layers.{layer}."
    if own in ("feed_forward.experts.w1", "feed_forward.experts.w3"):  # [e, f, d] from [e, d, 2f]
        shift = hidden if own.endswith("w3") else 0
        return prefix + _GATE_UP, (box[0], box[2], slice(box[1].start + shift, box[1].stop + shift)), True
    if own == "feed_forward.experts.w2":  # [e, d, f] from [e, f, d]
        return prefix + _DOWN, (box[0], box[2], box[1]), True
    names = {**_ATTENTION, **_DENSE, **_SHARED, **_NORMS, "feed_forward.router.weight": "feed_forward.router.weight"}
    return prefix + names[own], tuple(box), False


def llama4_config(args: ModelArgs) -> dict[str, Any]:
    """config.json's Llama 4 fields (hf.hf_config adds the ones every Llama has), as Llama4TextConfig
    writes them: the lists explicit (transformers derives no default from them then)."""
    moe_layers = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "intermediate_size": args.expert_hidden_dim,
        "intermediate_size_mlp": args.ffn_hidden_dim,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.experts_per_token,
        "moe_layers": moe_layers,
        "interleave_moe_layer_step": _step(moe_layers, args.n_layers),
        "no_rope_layers": [int(args.uses_rope(i)) for i in range(args.n_layers)],
        "layer_types": layer_types(args),
        "use_qk_norm": args.use_qk_norm,
        "attention_chunk_size": args.attention_chunk_size,
        "attn_temperature_tuning": args.attn_temperature_tuning,
        "floor_scale": args.floor_scale,
        "attn_scale": args.attn_scale,
    }


def layer_types(args: ModelArgs) -> list[str]:
    """Each layer's attention as transformers names it: the RoPE layers chunked when a chunk size is set."""
    chunked = args.attention_chunk_size is not None
    return ["chunked_attention" if chunked and args.uses_rope(i) else "full_attention" for i in range(args.n_layers)]


def _step(moe_layers: list[int], n_layers: int) -> int:
    """interleave_moe_layer_step giving these layers, 1 when none does (transformers reads moe_layers first)."""
    for step in range(1, n_layers + 1):
        if moe_layers == list(range(step - 1, n_layers, step)):
            return step
    return 1


def moe_layers_from(layers: Optional[list], step: int, n_layers: int) -> Optional[list]:
    """ModelArgs.moe_layers of a Llama4TextConfig's moe_layers, else of every step-th layer (transformers'
    rule); None when that is every layer."""
    layers = list(range(step - 1, n_layers, step)) if layers is None else layers
    return None if layers == list(range(n_layers)) else layers


def nope_layers_from(flags: Optional[list], interval: int, n_layers: int) -> Optional[list]:
    """ModelArgs.nope_layers of a Llama4TextConfig: the zeros of no_rope_layers (1: RoPE), else every
    interval-th layer (transformers' rule when the list is missing or empty); None when there are none."""
    if not flags:
        return [i for i in range(n_layers) if (i + 1) % interval == 0] or None
    return [i for i, flag in enumerate(flags[:n_layers]) if not flag] or None
