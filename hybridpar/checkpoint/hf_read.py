"""Import from a Hugging Face Llama folder: config.json plus model.safetensors, or sharded
model-0000K-of-0000N.safetensors files with model.safetensors.index.json (bf16, fp16 or fp32). Llama
1 to 3 (LlamaForCausalLM), Llama 4's text model (Llama4ForCausalLM, and the text part of a
Llama4ForConditionalGeneration folder: hf_llama4's layout).

read_hf_config turns config.json into ModelArgs, refusing (with the field named) what hybridpar's
Llama cannot represent. load_hf_checkpoint fills a model at any mp, before FSDP: every rank opens
the files memory-mapped and reads only its own block of each tensor (safetensors' get_slice), so
a rank's extra memory is one block at a time. Rows of wq and wk are put back from HF's rotate-half
order into Meta's interleaved pairs (the inverse of hf.rope_permutation, within each head).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from hybridpar.models.fields import check_field, read_json_object
from hybridpar.models.args import ModelArgs

from ..mesh.ranks import mark_every_rank
from .foreign import ForeignCheckpointError, ForeignSource, load_foreign
from .hf import CONFIG_JSON, hf_name, hf_tensors, rope_permutation
from .hf_llama4 import TEXT_PREFIX, layer_types, llama4_block, moe_layers_from, nope_layers_from
from .hf_shards import INDEX_FILE, WEIGHTS_FILE

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Buffers some older exports saved alongside the weights: recomputed by the model, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFImportError(ForeignCheckpointError):
    """A Hugging Face folder (or a model meant to receive it) that cannot be imported."""


def is_hf_folder(path: Union[str, Path]) -> bool:
    path = Path(path)
    return (path / CONFIG_JSON).is_file() and ((path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file())


# --- config.json -> ModelArgs -------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise HFImportError(f"{path} does not exist: a Hugging Face folder needs config.json next to its weights")
    return read_json_object(path, HFImportError, "download it again")


def _field(config: dict, name: str, kind: type, where: Path, default: Any = ...) -> Any:
    """config[name], of JSON type `kind`; `default` when absent or null (no default: required)."""
    if config.get(name) is None:
        if default is ...:
            raise HFImportError(f'{where}: "{name}" is missing; a LlamaConfig always has it')
        return default
    return check_field(where, name, config[name], kind, error=HFImportError)


def _refuse_unsupported(config: dict, where: Path) -> None:
    model_type = config.get("model_type")
    if model_type not in ("llama", "llama4_text"):
        raise HFImportError(
            f"{where}: model_type = {model_type!r}; hybridpar imports Llama models only (model_type 'llama', "
            "'llama4_text', or 'llama4' for its text model)"
        )
    for name in ("attention_bias", "mlp_bias"):
        if _field(config, name, bool, where, default=False):
            raise HFImportError(f"{where}: {name} = true; hybridpar's Llama has no biases, so it cannot hold this model")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise HFImportError(f"{where}: hidden_act = {act!r}; hybridpar's feed-forward is SwiGLU (hidden_act 'silu')")


def _rope_fields(config: dict, where: Path, default_theta: float = 10000.0) -> dict:
    """rope_theta and the llama3 rescaling from either spelling: transformers 4's rope_theta +
    rope_scaling, or transformers 5's rope_parameters (which holds rope_theta too)."""
    key = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = _field(config, key, dict, where, default={})
    theta = rope.get("rope_theta", config.get("rope_theta", default_theta))
    fields: dict[str, Any] = {"rope_theta": float(_field({"rope_theta": theta}, "rope_theta", float, where))}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return fields
    if kind != "llama3":
        raise HFImportError(
            f"{where}: {key}.rope_type = {kind!r}; hybridpar implements plain RoPE and Llama 3's rescaling "
            "('llama3') only"
        )
    sub = f"{where} {key}"
    fields.update(
        use_scaled_rope=True,
        rope_scaling_factor=float(_field(rope, "factor", float, sub)),
        rope_low_freq_factor=float(_field(rope, "low_freq_factor", float, sub)),
        rope_high_freq_factor=float(_field(rope, "high_freq_factor", float, sub)),
        rope_original_context=_field(rope, "original_max_position_embeddings", int, sub),
    )
    return fields


# ModelArgs' names of config.json's fields, for the errors ModelArgs' checks raise.
_HF_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
             "n_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size", "norm_eps": "rms_norm_eps",
             "max_seq_len": "max_position_embeddings"}


# Llama 4's names where they differ, and Llama4TextConfig's defaults for the fields a config.json leaves out.
_LLAMA4_NAMES = {**_HF_NAMES, "ffn_hidden_size": "intermediate_size_mlp", "expert_hidden_size": "intermediate_size",
                 "n_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok",
                 "nope_layers": "no_rope_layers"}
_LLAMA4_DEFAULTS = {"intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
                    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "no_rope_layer_interval": 4,
                    "use_qk_norm": True, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
                    "floor_scale": 8192, "attn_scale": 0.1}


def text_config(config: dict, where: Path) -> tuple[dict, str]:
    """(the text model's config, where it is named in errors): a Llama4ForConditionalGeneration's
    "text_config", else config.json itself."""
    if config.get("model_type") != "llama4":
        return config, str(where)
    text = _field(config, "text_config", dict, where)
    return {"model_type": "llama4_text", **text}, f"{where} text_config"


def _llama4_fields(config: dict, where: str, n_layers: int) -> dict[str, Any]:
    """ModelArgs' Llama 4 fields from a Llama4TextConfig's (its defaults where one is left out)."""
    def get(name: str, kind: type) -> Any:
        return _field(config, name, kind, where, default=_LLAMA4_DEFAULTS.get(name))

    def positive(name: str) -> int:
        value = get(name, int)
        if value < 1:
            raise HFImportError(f'{where}: "{name}" = {value} must be positive')
        return value

    flags = _field(config, "no_rope_layers", list, where, default=None)
    if flags and (len(flags) < n_layers or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
        raise HFImportError(f'{where}: "no_rope_layers" must hold a 0 or 1 for each of the {n_layers} layers '
                            f"(1: the layer uses RoPE), got {flags}")
    nope = nope_layers_from(flags, positive("no_rope_layer_interval"), n_layers)
    tuning = config.get("attn_temperature_tuning", True)  # a number in Meta's configs (4): true when not 0
    if isinstance(tuning, float) or not isinstance(tuning, int):
        raise HFImportError(f'{where}: "attn_temperature_tuning" must be true or false, got {tuning!r}')
    floor = float(get("floor_scale", float))
    if not floor.is_integer():
        raise HFImportError(f'{where}: "floor_scale" must be a whole number of positions, got {floor}')
    chunk = config["attention_chunk_size"] if "attention_chunk_size" in config else 8192  # null: no chunks
    fields = dict(
        ffn_hidden_size=get("intermediate_size_mlp", int), expert_hidden_size=get("intermediate_size", int),
        n_experts=get("num_local_experts", int), experts_per_token=get("num_experts_per_tok", int),
        moe_layers=moe_layers_from(_field(config, "moe_layers", list, where, default=None),
                                   positive("interleave_moe_layer_step"), n_layers),
        nope_layers=nope, use_qk_norm=get("use_qk_norm", bool), attn_temperature_tuning=bool(tuning),
        floor_scale=int(floor), attn_scale=float(get("attn_scale", float)),
        attention_chunk_size=None if chunk is None else _field(config, "attention_chunk_size", int, where),
    )
    given = _field(config, "layer_types", list, where, default=None)
    expected = layer_types(ModelArgs(n_layers=n_layers, nope_layers=nope, attention_chunk_size=fields[
        "attention_chunk_size"]))
    if given is not None and given != expected:
        raise HFImportError(f'{where}: "layer_types" = {given}, but hybridpar chunks the attention of exactly the '
                            f"RoPE layers (no_rope_layers' ones) when attention_chunk_size is set: {expected}")
    return fields


def _hf_fields(config: dict, where: Path) -> dict[str, Any]:
    """ModelArgs' fields from config.json's, each of its type; what hybridpar cannot hold refused."""
    config, where = text_config(config, where)
    _refuse_unsupported(config, where)
    llama4 = config["model_type"] == "llama4_text"
    dim = _field(config, "hidden_size", int, where)
    n_heads = _field(config, "num_attention_heads", int, where)
    head_dim = _field(config, "head_dim", int, where, default=None)
    if head_dim is not None and n_heads and head_dim * n_heads != dim:
        raise HFImportError(
            f"{where}: head_dim = {head_dim} but hidden_size / num_attention_heads = {dim} / {n_heads}; "
            "hybridpar's Llama needs head_dim = hidden_size / num_attention_heads"
        )
    tied = _field(config, "tie_word_embeddings", bool, where, default=False)
    n_layers = _field(config, "num_hidden_layers", int, where)
    fields = dict(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=_field(config, "num_key_value_heads", int, where, default=n_heads),
        vocab_size=_field(config, "vocab_size", int, where),
        norm_eps=float(_field(config, "rms_norm_eps", float, where)),
        max_seq_len=_field(config, "max_position_embeddings", int, where),
        tie_embeddings=tied,
        # The output head and a tied embedding are both split on the vocabulary.
        embedding_split="vocab" if tied else "auto",
        **_rope_fields(config, where, 500000.0 if llama4 else 10000.0),  # Llama4TextConfig's default theta
    )
    if llama4:
        return {**fields, **_llama4_fields(config, where, n_layers)}
    return {**fields, "ffn_hidden_size": _field(config, "intermediate_size", int, where)}


def args_from_hf_config(config: dict, where: Path = Path(CONFIG_JSON), **overrides: Any) -> ModelArgs:
    """ModelArgs of a LlamaForCausalLM config (a dict as in config.json); `overrides` win. Raises
    HFImportError naming the field, marked as every rank's (each reads the same config.json)."""
    try:
        args = ModelArgs.from_dict({**_hf_fields(config, where), **overrides})
        args.check(1)
    except HFImportError as err:
        raise mark_every_rank(err)
    except ValueError as err:  # ModelArgs' checks, which use ModelArgs' names
        name = str(err).split(" ", 1)[0]
        names = _LLAMA4_NAMES if text_config(config, where)[0].get("model_type") == "llama4_text" else _HF_NAMES
        hint = f" ({names[name]} in {CONFIG_JSON})" if name in names else ""
        raise mark_every_rank(HFImportError(f"{where}: {err}{hint}")) from err
    return args


def read_hf_config(folder: Union[str, Path], **overrides: Any) -> ModelArgs:
    """The ModelArgs of a Hugging Face Llama folder's config.json (its weights are checked on load)."""
    folder = Path(folder)
    return args_from_hf_config(read_hf_json(folder), folder / CONFIG_JSON, **overrides)


def read_hf_json(folder: Path) -> dict:
    """config.json of a Hugging Face folder, as a dict (args_from_hf_config reads it)."""
    return _read_json(Path(folder) / CONFIG_JSON)


# --- the weights ----------------------------------------------------------------------------------


def _weight_map(folder: Path) -> dict[str, Path]:
    """{HF tensor name: the file holding it}, from the index or the single file."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFImportError(f"{index} has no weight_map: download it again")
        files = {name: folder / file for name, file in weight_map.items()}
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            raise HFImportError(
                f"{folder}: {INDEX_FILE} lists {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                "not in the folder; finish the download (every file the index names is needed)"
            )
        return files
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise HFImportError(f"{folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}: it holds no Hugging Face weights")
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def _refuse_cut_short(path: Path) -> None:
    """Name the file and the first tensor a file cut short lost, from what its header records (8 bytes
    of header size, a JSON header, then each tensor at its data_offsets): safetensors' own error
    says only that the file is not fully covered."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little") if len(head) == 8 else None
        if header_size is None or 8 + header_size > size:
            raise HFImportError(f"{path} is cut short ({size} bytes): its header is incomplete; download it again")
        try:
            header = json.loads(f.read(header_size))
            ends = {name: 8 + header_size + int(info["data_offsets"][1])
                    for name, info in header.items() if name != "__metadata__"}
        except (ValueError, KeyError, TypeError, IndexError):
            return  # not a header safetensors accepts either: its own error names the problem
    lost = sorted((end, name) for name, end in ends.items() if end > size)
    if lost:
        end, name = lost[0]
        raise HFImportError(f"{path} is cut short: it has {size} bytes, but its header places {name} up to byte {end} "
                            f"({len(lost)} tensor(s) lost); the file is truncated: download it again")


def _open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - any failure to parse means a damaged file
        raise HFImportError(f"{path} cannot be read ({type(err).__name__}: {err}); download it again") from err


class _Files:
    """The folder's safetensors files. Headers are read through handles kept open during the checks;
    tensors are read each through its own short-lived handle, so the pages of one tensor at a time
    are mapped into the process (a column block touches every page of a row-major tensor)."""

    def __init__(self, folder: Path, weight_map: dict[str, Path]) -> None:
        self.folder, self.weight_map, self.handles = folder, weight_map, {}
        for path in sorted(set(weight_map.values())):
            _refuse_cut_short(path)
            self.handles[path] = _open(path)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles = {}


def _check_tensors(files: _Files, args: ModelArgs, prefix: str = "") -> None:
    """Every tensor config.json implies is present (under `prefix`: a multimodal folder's text model,
    whose other tensors are not read), with its shape and a floating dtype."""
    expected = {prefix + t.name: t.shape for t in hf_tensors(args)}
    names = {n for n in files.weight_map if n.startswith(prefix) and not n.endswith(_IGNORED_SUFFIXES)}
    # A tied folder may still carry lm_head.weight (transformers ignores it then): so do we.
    names.discard(prefix + "lm_head.weight") if args.tie_embeddings else None
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        hint = ""
        if missing == [prefix + "lm_head.weight"]:
            hint = " (lm_head.weight missing: a tied checkpoint; its config.json should say tie_word_embeddings: true)"
        raise HFImportError(
            f"{files.folder} does not match its config.json (num_hidden_layers = {args.n_layers}): missing "
            f"{missing[:8]}, unexpected {unexpected[:8]}{hint}"
        )
    for name, shape in expected.items():
        piece = files.handles[files.weight_map[name]].get_slice(name)  # shape and dtype from the header
        actual, dtype = tuple(piece.get_shape()), piece.get_dtype()
        where = files.weight_map[name].name
        if actual != shape:
            raise HFImportError(
                f"{name} in {where} has shape {list(actual)}, but config.json implies {list(shape)}; the file "
                "belongs to another model or config.json is wrong"
            )
        if dtype not in _DTYPES:
            raise HFImportError(f"{name} in {where} has dtype {dtype}; hybridpar imports F32, BF16 or F16 weights")


class _HFSource(ForeignSource):
    """A checked folder; each block read from its tensor's file, wq and wk rows put back in Meta's order."""

    error = HFImportError

    def __init__(self, folder: Path, config: Optional[dict] = None) -> None:
        config = read_hf_json(folder) if config is None else config
        args = args_from_hf_config(config, folder / CONFIG_JSON)
        super().__init__(folder, args, folder / CONFIG_JSON, "read_hf_config(folder)", CONFIG_JSON)
        self.prefix = TEXT_PREFIX if config.get("model_type") == "llama4" else ""
        self.files = _Files(folder, _weight_map(folder))
        try:
            _check_tensors(self.files, args, self.prefix)
        finally:
            self.files.close()  # header handles: each copy opens its tensor's file on its own

    def tie_mismatch(self, model_tied: bool) -> str:
        which = "tied (tie_word_embeddings: true)" if self.args.tie_embeddings else "untied (its own lm_head.weight)"
        return (f"{self.folder} is {which} but the model is {'tied' if model_tied else 'untied'}: build the model "
                f"with tie_embeddings = {self.args.tie_embeddings}, from read_hf_config(folder)")

    def _head_dim(self, name: str) -> Optional[int]:
        """Rows per head for the RoPE-permuted projections (wq, wk; none in Llama 4's), else None."""
        permuted = not self.args.llama4 and name.endswith(("attention.wq.weight", "attention.wk.weight"))
        return self.args.head_dim if permuted else None

    def check_block(self, name: str, offset: Sequence[int], shape: Sequence[int]) -> None:
        head_dim = self._head_dim(name)
        if head_dim is not None and (offset[0] % head_dim or shape[0] % head_dim):
            raise HFImportError(f"{name}: rows {offset[0]}..{offset[0] + shape[0]} do not cover whole heads")

    def read_into(self, name: str, offset: Sequence[int], out: torch.Tensor) -> None:
        if self.args.llama4:  # its own names, the experts' weights fused and transposed
            stored, index, transposed = llama4_block(name, offset, out.shape, self.args.expert_hidden_dim)
        else:
            stored, index, transposed = hf_name(name), tuple(slice(o, o + n) for o, n in zip(offset, out.shape)), False
        stored = self.prefix + stored
        with _open(self.files.weight_map[stored]) as handle:  # unmapped again after the block
            block = handle.get_slice(stored)[index]
        if transposed:
            block = block.transpose(1, 2)
        head_dim = self._head_dim(name)
        if head_dim is not None:  # whole heads (check_block): undo HF's rotate-half order head by head
            block = block[torch.argsort(rope_permutation(out.shape[0] // head_dim, head_dim))]
        out.copy_(block)


def load_hf_checkpoint(folder: Union[str, Path], model: nn.Module, parallel: Any = None, *,
                       config: Optional[dict] = None) -> ModelArgs:
    """Fill `model` (a hybridpar.models.llama.Transformer built from read_hf_config(folder), at any mp, before
    FSDP) from a Hugging Face folder: every rank reads its own blocks (collective: one flag after
    the checks). Everything is checked before anything is copied, so an error leaves the model
    untouched. `parallel` is accepted for symmetry (the layout comes from the parameters'
    placements). `config`: config.json as already read (hybridpar.checkpoint.convert.read_config),
    not read again. Returns the folder's ModelArgs."""
    return load_foreign(_HFSource(Path(folder), config), model)
