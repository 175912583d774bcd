"""Export to a Hugging Face Llama folder that transformers' LlamaForCausalLM loads: `config.json`
(LlamaConfig fields), `generation_config.json` and the weights in safetensors shards with their
index (hf_shards: transformers' layout, bfloat16 and 5GB shards by default), under HF's names
(a Llama 4 model: Llama4ForCausalLM's, hf_llama4):

    tok_embeddings / norm / output    model.embed_tokens / model.norm / lm_head
    layers.N.attention.wq/wk/wv/wo    model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj
    layers.N.feed_forward.w1/w3/w2    model.layers.N.mlp.gate_proj/up_proj/down_proj
    layers.N.attention_norm/ffn_norm  model.layers.N.input_layernorm/post_attention_layernorm

RoPE: Meta rotates the interleaved pairs (x[2i], x[2i+1]) of each head by angle theta_i, HF's
rotate-half (y[i], y[i + d/2]). With y = x[perm], perm = [0, 2, 4, ..., 1, 3, 5, ...] per head,
HF's rotation of y is Meta's rotation of x, permuted the same way: so the rows of wq and wk are
reordered by perm within each head, and q.k (so attention), wv and wo are unchanged.

API: export_hf (collective, through foreign.export_foreign), write_hf_folder (one process), hf_state_dict,
hf_config; import: hf_read.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from hybridpar.models.args import ModelArgs

from ..config.dtypes import CANONICAL_NAMES as _DTYPE_NAMES
from ..files import human_bytes, staged_folder, write_text_atomic
from ..progress import note
from .foreign import (ForeignCheckpointError, ForeignTarget, export_foreign, model_args, model_shapes, refuse_target,
                      write_files)
from .hf_llama4 import HFTensor, llama4_config, llama4_tensors, to_llama4
from .hf_shards import DEFAULT_MAX_SHARD_SIZE, parse_shard_size, plan_shards, write_index, write_shard

CONFIG_JSON = "config.json"
GENERATION_CONFIG_JSON = "generation_config.json"

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LLAMA3_VOCAB_SIZE = 128256


class HFExportError(ForeignCheckpointError):
    """A model or folder that cannot be exported to the Hugging Face format."""


def rope_permutation(n_heads: int, head_dim: int) -> torch.Tensor:
    """Row order [n_heads * head_dim] taking Meta's interleaved RoPE pairs to HF's rotate-half halves."""
    if head_dim % 2:
        raise HFExportError(f"head_dim = {head_dim} must be even for RoPE")
    # Within a head: the even rows (first of each pair) become the first half, the odd rows the second.
    per_head = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return (torch.arange(n_heads)[:, None] * head_dim + per_head).flatten()


def hf_name(name: str) -> str:
    """HF's name for one of Meta's (= hybridpar.models.llama's) parameter names."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise HFExportError(f"{name} is not a parameter of Meta's Llama format; no Hugging Face name for it")


def _to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    if name.endswith("attention.wq.weight"):
        return tensor[rope_permutation(args.n_heads, args.head_dim)]
    if name.endswith("attention.wk.weight"):
        return tensor[rope_permutation(args.kv_heads, args.head_dim)]
    return tensor


def hf_state_dict(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Full tensors under Meta's names -> HF's names, wq/wk rows permuted for rotate-half RoPE; a Llama 4
    model's every tensor (hf_llama4's layout, the experts fused)."""
    if args.llama4:
        return {t.name: to_hf(t, [state[p] for p in t.parts], args) for t in hf_tensors(args)}
    return {hf_name(name): _to_hf_tensor(name, tensor, args) for name, tensor in state.items()}


def hf_tensors(args: ModelArgs) -> list[HFTensor]:
    """Every tensor of the folder of `args`' model, in transformers' order, with the parameters it holds."""
    if args.llama4:
        return llama4_tensors(args)
    shapes = model_shapes(args)
    return [HFTensor(hf_name(name), shapes[name], (name,)) for name in hf_order(args)]


def to_hf(tensor: HFTensor, parts: list[torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """The folder's tensor from its parts (full tensors in hybridpar's layout)."""
    return to_llama4(tensor, parts) if args.llama4 else _to_hf_tensor(tensor.parts[0], parts[0], args)


def default_token_ids(vocab_size: int) -> tuple[int, int]:
    """(bos, eos): Llama 3's (128000, 128001) for its 128256-token vocabulary, else Llama 2's (1, 2)."""
    return (128000, 128001) if vocab_size == LLAMA3_VOCAB_SIZE else (1, 2)


def _rope_scaling(args: ModelArgs) -> Optional[dict[str, Any]]:
    """Llama 3's RoPE rescaling in transformers' vocabulary (rope_type "llama3"), or None."""
    scaling = args.rope_scaling
    if scaling is None:
        return None
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_context}


def hf_config(args: ModelArgs, *, dtype: torch.dtype = torch.float32, bos_token_id: Optional[int] = None,
              eos_token_id: Optional[Union[int, list[int]]] = None) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM (Llama4ForCausalLM) with this shape; token ids left None:
    default_token_ids; several eos ids as a list, as Llama 3.1 and 4 list theirs."""
    if dtype not in _DTYPE_NAMES:
        raise HFExportError(f"dtype {dtype} cannot be exported; use one of {', '.join(_DTYPE_NAMES.values())}")
    default_bos, default_eos = default_token_ids(args.vocab_size)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_scaling(args),
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": default_bos if bos_token_id is None else bos_token_id,
        "eos_token_id": default_eos if eos_token_id is None else eos_token_id,
        # transformers 5 writes and reads "dtype"; 4.x read "torch_dtype" (5 still accepts it)
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    if args.llama4:  # Llama4TextConfig's fields; it has neither of LlamaConfig's two below
        config.update(llama4_config(args))
        del config["mlp_bias"], config["pretraining_tp"]
    return config


def _check_target(out_dir: Path, overwrite: bool) -> None:
    refuse_target(out_dir, overwrite)


def hf_order(args: ModelArgs) -> list[str]:
    """hybridpar.models.llama's parameter names in the order of transformers' state_dict (so of its shards):
    embeddings, each layer's q k v o, gate up down and norms, the final norm, the head."""
    shapes = model_shapes(args)
    layers = [f"layers.{i}.{key}" for i in range(args.n_layers) for key in _LAYER_NAMES]  # _LAYER_NAMES: HF's order
    return [name for name in ["tok_embeddings.weight", *layers, "norm.weight", "output.weight"] if name in shapes]


def generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json as transformers' GenerationConfig.from_model_config writes it for a Llama."""
    return {"_from_model_config": True, "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"], "use_cache": True}


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied only if it is a view into a larger storage: safetensors refuses those, and a
    copy of every tensor would hold the model twice."""
    if tensor.untyped_storage().nbytes() != tensor.nbytes or tensor.storage_offset():
        return tensor.clone()
    return tensor


class _HFTarget(ForeignTarget):
    """Shards of at most max_shard_size in transformers' order and names (hf_shards), file j by rank
    j % world; then tokenizer files, generation_config.json, the index and config.json, last."""

    error = HFExportError

    def __init__(self, args: ModelArgs, dtype: torch.dtype, max_shard_size: Union[int, str],
                 bos_token_id: Optional[int], eos_token_id: Optional[int],
                 extra_files: Optional[Mapping[str, Path]]) -> None:
        self.config = hf_config(args, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        try:
            max_bytes = parse_shard_size(max_shard_size)
        except ValueError as err:
            raise HFExportError(str(err)) from None
        tensors = hf_tensors(args)
        self._order = [part for t in tensors for part in t.parts]
        self.plan = plan_shards([(t.name, t.shape) for t in tensors], dtype, max_bytes)
        super().__init__(args, len(self.plan.files), dtype, extra_files)
        file_of = self.plan.file_of()
        self._tensor_of = {part: t for t in tensors for part in t.parts}
        self._file_of = {part: file_of[t.name] for part, t in self._tensor_of.items()}
        self._last_part = {t.name: t.parts[-1] for t in tensors}
        self._waiting: dict[str, torch.Tensor] = {}  # parts of a tensor whose other parts are still to come

    def begin(self, folder: Path, overwrite: bool) -> None:
        try:
            _check_target(folder, overwrite)
        except OSError as err:  # an occupied folder, or one that cannot be looked at: a refusal all the same
            raise HFExportError(f"{type(err).__name__}: {err}") from err
        if importlib.util.find_spec("safetensors") is None:
            raise HFExportError("export_hf needs the safetensors package: pip install safetensors")

    def order(self) -> list[str]:
        return self._order

    def last_piece(self, j: int) -> str:
        return self._last_part[self.plan.last_of(j)]

    def owner(self, name: str) -> int:
        return self._file_of[name]

    def pieces(self, name: str, full: torch.Tensor, j: int) -> dict[str, torch.Tensor]:
        if self._file_of[name] != j:
            return {}
        target = self._tensor_of[name]
        self._waiting[name] = full.detach().to("cpu", self.dtype)
        if name != target.parts[-1]:  # a Llama 4 expert's w1: gate_up_proj waits for its w3
            return {}
        tensor = to_hf(target, [self._waiting.pop(part) for part in target.parts], self.args)
        return {target.name: _owning(tensor.contiguous())}

    def write_file(self, staged: Path, j: int, tensors: dict[str, torch.Tensor]) -> None:
        write_shard(staged / self.plan.file_names[j], tensors)
        note(f"wrote {self.plan.file_names[j]} ({human_bytes(sum(t.nbytes for t in tensors.values()))})")

    def finish(self, staged: Path) -> None:
        """The index and config.json last, once every shard is in: a folder holding them is complete."""
        self.copy_extra_files(staged)
        write_text_atomic(staged / GENERATION_CONFIG_JSON, json.dumps(generation_config(self.config), indent=2) + "\n")
        write_index(staged, self.plan)
        write_text_atomic(staged / CONFIG_JSON, json.dumps(self.config, indent=2) + "\n")


def write_hf_folder(
    state: Mapping[str, torch.Tensor],
    args: ModelArgs,
    out_dir: Union[str, Path],
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
    extra_files: Optional[Mapping[str, Path]] = None,
) -> Path:
    """Write every parameter of `args`' model, as full tensors under Meta's names, as an HF folder
    (one process; the same shards and files as export_hf). Atomic: everything goes into
    `<out_dir>.partial`, renamed to out_dir once complete. An existing out_dir is refused
    (FileExistsError) unless overwrite=True. extra_files: {name: file} copied in too (the tokenizer's)."""
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)
    target = _HFTarget(args, dtype, max_shard_size, bos_token_id, eos_token_id, extra_files)
    with staged_folder(out_dir) as staged:  # overwrite: the old folder goes only once the new one is in place
        write_files(target, state, staged, range(target.n_files))
        target.finish(staged)
    return out_dir


def export_hf(
    model: nn.Module,
    out_dir: Union[str, Path],
    parallel: Any = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
    extra_files: Optional[Mapping[str, Path]] = None,
) -> Path:
    """Write `model` (a hybridpar.models.llama.Transformer at any mp, plain or FSDP2-wrapped) as an HF Llama
    folder. Collective: every rank calls it. The weights go in `dtype` (bfloat16 by default, as Meta
    and Hugging Face publish Llama) into shards of at most max_shard_size (5GB = 5 * 10^9 bytes, or
    500MB, 2GiB, a byte count; a larger tensor alone gets its own shard), named and indexed as
    transformers' save_pretrained does; shard j is written by rank j % world as soon as its last
    tensor is gathered, so a rank holds one shard and one gathered tensor at a time.

    bos/eos ids default to default_token_ids(vocab_size): Llama 3's (128000, 128001) for a
    128256-token vocabulary, else Llama 2's (1, 2); pass others for another tokenizer. `parallel` is
    accepted for symmetry with the other checkpoint functions (the layout comes from the DTensors).
    Every rank returns out_dir or raises (foreign.export_foreign: a refusal reads the same on every
    rank; a rank's failure to write is re-raised there and named on the others).
    """
    args = model_args(model, HFExportError, "export_hf")
    # A dtype or size it cannot write: refused here, on every rank alike.
    target = _HFTarget(args, dtype, max_shard_size, bos_token_id, eos_token_id, extra_files)
    return export_foreign(target, model, Path(out_dir), overwrite)
