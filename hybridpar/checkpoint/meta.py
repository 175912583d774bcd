"""Meta's consolidated Llama checkpoints: import from and export to any model-parallel size.

The format, as Meta's llama / llama3 / llama-models repositories read and write it, is a folder:

    params.json            the model's shape (Meta's ModelArgs fields)
    consolidated.00.pth    model-parallel rank 0's shards, a flat {name: tensor} dict
    ...
    consolidated.{MP-1:02d}.pth

Each file holds every parameter under Meta's name (which are also the names of
`models.llama.Transformer`), split evenly across the MP files along Meta's dimension:

    dim 0   attention.wq/wk/wv, feed_forward.w1/w3, output (ColumnParallelLinear)
    dim 1   attention.wo, feed_forward.w2 (RowParallelLinear)
    tok_embeddings   dim 1 in the Llama 2 layout (ParallelEmbedding), dim 0 in the Llama 3 layout
                     (VocabParallelEmbedding)
    norms   whole, in every file

Llama 2 files also hold `rope.freqs` ([head_dim / 2], the RoPE inverse frequencies), which Meta's
code loads with strict=False and never uses: it is written in the Llama 2 layout and checked on import.

params.json as written here holds only fields Meta's code accepts. Meta builds its ModelArgs as
`ModelArgs(max_seq_len=..., max_batch_size=..., **params)`, so `max_seq_len` and `max_batch_size`
are left out (writing them would make Meta's loader fail with a duplicate keyword), and so is
hybridpar's `embedding_split` (an unknown keyword there): the layout is read back from the shard
shapes. `vocab_size` is -1 in the Llama 2 layout, as in Meta's Llama 2 releases (the vocabulary is
then the tok_embeddings shape), and the real size in the Llama 3 layout.

Public API:
    read_meta_params(folder, *, verify_checksums=False, **overrides) -> ModelArgs
    load_meta_checkpoint(folder, model, parallel, *, verify_checksums=False) -> ModelArgs
    save_meta_checkpoint(model, folder, parallel, mp_out, *, dtype=None, overwrite=False) -> Path
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from models.llama import ModelArgs

from ..files import replace_folder
from .ranks import from_rank0, gather_all, rank_and_world

PARAMS_JSON = "params.json"
SHARD_FILE = re.compile(r"^consolidated\.(\d+)\.pth$")
ROPE_FREQS = "rope.freqs"

# Fields every params.json Meta published has; the others have Meta's defaults.
REQUIRED_FIELDS = ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "norm_eps")
_INT_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_batch_size", "max_seq_len")
_FLOAT_FIELDS = ("ffn_dim_multiplier", "norm_eps", "rope_theta")
# Fields that change the numbers but not the shapes: a model built with other values would load
# without a shape error and compute something else, so load_meta_checkpoint compares them.
_BEHAVIOUR_FIELDS = ("norm_eps", "rope_theta", "use_scaled_rope")

_COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
           "feed_forward.w1.weight", "feed_forward.w3.weight")
_ROW = ("attention.wo.weight", "feed_forward.w2.weight")
_NORMS = ("attention_norm.weight", "ffn_norm.weight")


class MetaCheckpointError(ValueError):
    """A Meta checkpoint folder (or a model meant for it) that cannot be read, loaded or written."""


def shard_name(index: int) -> str:
    return f"consolidated.{index:02d}.pth"


def split_dim(name: str, embedding_split: str) -> Optional[int]:
    """The dimension Meta splits parameter `name` along across consolidated files (None: whole in each)."""
    if name == "tok_embeddings.weight":
        return 1 if embedding_split == "dim" else 0
    if name == "output.weight" or name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def meta_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of the Meta checkpoint of `args`, with its full (unsplit) shape."""
    d, q, kv, hidden = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
            p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q),
            p + "feed_forward.w1.weight": (hidden, d), p + "feed_forward.w2.weight": (d, hidden),
            p + "feed_forward.w3.weight": (hidden, d),
            p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,),
        })
    shapes.update({"norm.weight": (d,), "output.weight": (args.vocab_size, d)})
    return shapes


def rope_inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """The `rope.freqs` entry of Llama 2 files: theta^(-2i / head_dim) for each pair i, [head_dim / 2] fp32.

    Always the unscaled frequencies, as in Meta's Llama 2 files (Llama 3.1's scaling never met this
    layout in Meta's releases; the entry is informational: Meta's code does not read it).
    """
    half = torch.arange(0, args.head_dim, 2)[: args.head_dim // 2].float()
    return 1.0 / (args.rope_theta ** (half / args.head_dim))


# --- reading ----------------------------------------------------------------------------------


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _read_params(folder: Path) -> dict[str, Any]:
    path = folder / PARAMS_JSON
    if not path.is_file():
        raise MetaCheckpointError(
            f"{path} does not exist: a Meta checkpoint folder needs params.json next to its "
            "consolidated.NN.pth files; point at the folder that holds both"
        )
    try:
        params = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MetaCheckpointError(f"{path} is not readable JSON ({err}); restore it from the original checkpoint") from err
    if not isinstance(params, dict):
        raise MetaCheckpointError(f"{path} holds a {type(params).__name__}, not a JSON object of model fields")
    known = [f.name for f in dataclasses.fields(ModelArgs)]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise MetaCheckpointError(
            f"{path}: unknown field(s) {unknown}; the fields Meta's format and hybridpar know are {known}. "
            "Remove the unknown ones (or fix their spelling)"
        )
    missing = [f for f in REQUIRED_FIELDS if f not in params]
    if missing:
        raise MetaCheckpointError(
            f"{path}: required field(s) {missing} missing; Meta's params.json always has {list(REQUIRED_FIELDS)}. "
            "Add them with the values the checkpoint was trained with"
        )
    for name, value in params.items():
        if value is None and name in ("n_kv_heads", "ffn_dim_multiplier"):
            continue
        wrong = (
            (name in _INT_FIELDS and (isinstance(value, bool) or not isinstance(value, int)))
            or (name in _FLOAT_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, float))))
            or (name == "use_scaled_rope" and not isinstance(value, bool))
            or (name == "embedding_split" and value not in ("auto", "dim", "vocab"))
        )
        if wrong:
            raise MetaCheckpointError(f"{path}: field {name!r} has the value {value!r} of the wrong type or range")
    return params


def _load_file(path: Path, verify_checksums: bool = False) -> dict[str, torch.Tensor]:
    """Open one consolidated file without reading its tensors into memory (mmap), weights only."""
    try:
        if zipfile.is_zipfile(path):
            if verify_checksums:
                # torch.load never checks the zip's CRC-32s: flipped bytes inside a tensor load silently.
                with zipfile.ZipFile(path) as archive:
                    bad = archive.testzip()
                if bad is not None:
                    raise MetaCheckpointError(
                        f"{path}: entry {bad} fails its CRC-32 check: the file is corrupt; copy or download it again"
                    )
            state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        else:
            # torch.save's legacy (non-zip) format cannot be memory-mapped; a truncated zip lands here
            # too (its directory is at the end) and fails to unpickle below.
            state = torch.load(path, weights_only=True, map_location="cpu")
    except MetaCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to parse means a damaged file
        # The first sentence only: torch's own advice (e.g. "retry with weights_only=False") does not apply.
        first_line = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:200]
        raise MetaCheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {first_line}): the file is truncated or corrupt; "
            "copy or download it again"
        ) from err
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise MetaCheckpointError(f"{path} does not hold a flat {{name: tensor}} dict as Meta's consolidated files do")
    return dict(state)


def _shard_paths(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise MetaCheckpointError(f"{folder} is not a folder: pass the folder holding params.json and consolidated.NN.pth")
    found = {}
    for path in folder.iterdir():
        match = SHARD_FILE.match(path.name)
        if match:
            found[int(match.group(1))] = path
    if not found:
        raise MetaCheckpointError(
            f"no consolidated.NN.pth files in {folder}: a Meta checkpoint has consolidated.00.pth up to "
            "consolidated.{MP-1}.pth; check the path or finish the download"
        )
    missing = [i for i in range(max(found) + 1) if i not in found]
    if missing:
        have = ", ".join(f"{i:02d}" for i in sorted(found))
        raise MetaCheckpointError(
            f"{folder}: missing {', '.join(shard_name(i) for i in missing)} (found consolidated.{{{have}}}.pth); "
            "every model-parallel shard from 00 up is needed: copy the missing file(s)"
        )
    return [found[i] for i in range(len(found))]


@dataclasses.dataclass
class _Source:
    """An opened checkpoint folder: params, memory-mapped shards and the resolved layout."""

    folder: Path
    params: dict[str, Any]
    paths: list[Path]
    shards: list[dict[str, torch.Tensor]]
    args: ModelArgs

    @property
    def n(self) -> int:
        return len(self.shards)

    def pieces(self, name: str) -> list[torch.Tensor]:
        return [shard[name] for shard in self.shards]


def _check_shard_count(paths: list[Path], shards: list[dict], params: dict) -> None:
    """The first wq's rows tell how many files the checkpoint was split into: catch lost trailing files."""
    key = "layers.0.attention.wq.weight"
    if params["n_layers"] < 1 or key not in shards[0] or shards[0][key].dim() != 2:
        return  # reported as a missing key or a shape mismatch later
    rows, dim, n = shards[0][key].shape[0], params["dim"], len(shards)
    if rows * n != dim:
        implied = f"{dim} / {rows} = {dim // rows}" if rows and dim % rows == 0 else f"{dim} / {rows}, not a whole number"
        raise MetaCheckpointError(
            f"{paths[0].parent}: found {n} consolidated file(s), but {key} in {paths[0].name} has {rows} rows "
            f"and params.json says dim = {dim}, which implies {implied} files; a file is missing (copy all "
            "of them) or params.json belongs to another model"
        )


def _resolve_layout(paths: list[Path], shards: list[dict], params: dict) -> tuple[str, int]:
    """(embedding_split, vocab_size) from the tok_embeddings shard shape and the number of files."""
    key, n, dim = "tok_embeddings.weight", len(shards), params["dim"]
    if key not in shards[0]:
        raise MetaCheckpointError(f"{paths[0]} has no {key}: it is not a complete Meta Llama shard")
    shape = tuple(shards[0][key].shape)
    if len(shape) != 2:
        raise MetaCheckpointError(f"{key} in {paths[0]} has shape {_fmt(shape)}, expected 2 dimensions [vocab, dim]")
    rows, cols = shape
    declared = params.get("embedding_split", "auto")
    if n == 1:
        # One file says nothing about the split: follow Meta's releases (Llama 2: vocab -1, rope.freqs).
        if declared != "auto":
            split = declared
        else:
            split = "dim" if params["vocab_size"] == -1 or ROPE_FREQS in shards[0] else "vocab"
        vocab = rows
    elif cols == dim:
        split, vocab = "vocab", rows * n
    elif cols * n == dim:
        split, vocab = "dim", rows
    else:
        raise MetaCheckpointError(
            f"{key} in {paths[0].name} has shape {_fmt(shape)}: with {n} files its second dimension should be "
            f"dim = {dim} (split on the vocabulary, Llama 3 layout) or dim / {n} = {dim / n:g} (split on dim, "
            "Llama 2 layout); params.json's dim or the number of files is wrong"
        )
    if declared not in ("auto", split):
        raise MetaCheckpointError(
            f"{paths[0].parent / PARAMS_JSON} says embedding_split = {declared!r}, but {key} in {paths[0].name} "
            f"{_fmt(shape)} across {n} files is split as {split!r}; remove embedding_split from params.json"
        )
    if params["vocab_size"] not in (-1, vocab):
        raise MetaCheckpointError(
            f"{paths[0].parent / PARAMS_JSON} says vocab_size = {params['vocab_size']}, but {key} in {paths[0].name} "
            f"{_fmt(shape)} across {n} files holds {vocab} tokens; fix vocab_size (or set it to -1)"
        )
    return split, vocab


def _check_shards(source: _Source) -> None:
    """Every file holds exactly Meta's keys, each with its share of the shape params.json implies."""
    args, n = source.args, source.n
    shapes = meta_shapes(args)
    split = args.resolved_embedding_split
    for path, shard in zip(source.paths, source.shards):
        keys = set(shard) - {ROPE_FREQS}
        missing, unexpected = sorted(set(shapes) - keys, key=_natural), sorted(keys - set(shapes), key=_natural)
        if missing or unexpected:
            problems = [f"{what} keys {names[:8]}{' ...' if len(names) > 8 else ''}"
                        for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
            raise MetaCheckpointError(
                f"{path} does not match params.json (n_layers = {args.n_layers}): {', '.join(problems)}; "
                "the file belongs to another model or is incomplete"
            )
        for name, full in shapes.items():
            expected = list(full)
            d = split_dim(name, split)
            if d is not None:
                if full[d] % n:
                    raise MetaCheckpointError(
                        f"{name}: its full size {full[d]} on dim {d} does not split evenly into the {n} files of "
                        f"{source.folder}; the number of files or params.json is wrong"
                    )
                expected[d] = full[d] // n
            actual = tuple(shard[name].shape)
            if actual != tuple(expected):
                how = f"full {_fmt(full)} split on dim {d} into {n} files" if d is not None else "whole in every file"
                raise MetaCheckpointError(
                    f"{name} in {path} has shape {_fmt(actual)}, but params.json implies {_fmt(expected)} "
                    f"({how}); params.json does not describe this checkpoint (dim, n_heads, n_kv_heads, "
                    "multiple_of, ffn_dim_multiplier, vocab_size) or the file is from another model"
                )
            if not shard[name].is_floating_point():
                raise MetaCheckpointError(f"{name} in {path} has dtype {shard[name].dtype}, expected floating point")
        if ROPE_FREQS in shard:
            _check_rope_freqs(shard[ROPE_FREQS], args, path)


def _check_rope_freqs(freqs: torch.Tensor, args: ModelArgs, path: Path) -> None:
    expected = rope_inverse_frequencies(args)
    if tuple(freqs.shape) != tuple(expected.shape):
        raise MetaCheckpointError(
            f"{ROPE_FREQS} in {path} has shape {_fmt(freqs.shape)}, but params.json implies head_dim / 2 = "
            f"{expected.numel()}; check dim and n_heads in params.json"
        )
    # Stored in the weights' dtype (bf16 in Meta's releases): compare within that precision.
    tolerance = 4 * torch.finfo(freqs.dtype).eps if freqs.is_floating_point() else 0.0
    worst = ((freqs.float() - expected).abs() / expected.abs()).max().item()
    if not worst <= tolerance:
        raise MetaCheckpointError(
            f"{ROPE_FREQS} in {path} differs from the frequencies params.json implies (rope_theta = "
            f"{args.rope_theta}) by up to {worst:.3g} relative; "
            "set rope_theta in params.json to the value the model was trained with"
        )


def _natural(key: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _open(folder: Union[str, Path], overrides: Mapping[str, Any], verify_checksums: bool = False) -> _Source:
    folder = Path(folder)
    paths = _shard_paths(folder)
    params = _read_params(folder)
    shards = [_load_file(p, verify_checksums) for p in paths]
    _check_shard_count(paths, shards, params)
    embedding_split, vocab = _resolve_layout(paths, shards, params)
    fields = {**params, "vocab_size": vocab, "embedding_split": embedding_split, **overrides}
    try:
        args = ModelArgs.from_dict(fields)
        args.check(1)
    except ValueError as err:
        raise MetaCheckpointError(f"{folder / PARAMS_JSON}: {err}") from err
    source = _Source(folder, params, paths, shards, args)
    _check_shards(source)
    return source


def read_meta_params(folder: Union[str, Path], *, verify_checksums: bool = False, **overrides: Any) -> ModelArgs:
    """The ModelArgs of a Meta checkpoint folder, checked against its consolidated files.

    A vocab_size of -1 (Llama 2) is replaced by the size the tok_embeddings shards hold, and
    `embedding_split` is set to the layout the files use ("dim": Llama 2, "vocab": Llama 3; with one
    file, "dim" when vocab_size is -1 or rope.freqs is present, else "vocab"). `overrides` replace
    fields (e.g. max_seq_len=4096, which Meta's params.json does not hold). The files are memory-mapped,
    not read, so bytes damaged inside a tensor go unnoticed unless verify_checksums=True (reads every
    byte to check the zip CRC-32s). Raises MetaCheckpointError naming the file, key and shapes when
    anything does not fit.
    """
    return _open(folder, overrides, verify_checksums).args


# --- import -----------------------------------------------------------------------------------


def _local_box(param: torch.Tensor, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape): the block of the full tensor this rank holds."""
    if not isinstance(param, DTensor):
        return (0,) * param.dim(), tuple(param.shape)
    for placement in param.placements:
        # Shard subclasses (FSDP2's _StridedShard) interleave; only plain tensor-parallel layouts are boxes here.
        if not (type(placement) is Shard or isinstance(placement, Replicate)):
            raise MetaCheckpointError(
                f"{name} is placed as {param.placements} on mesh dims {param.device_mesh.mesh_dim_names}: "
                "load_meta_checkpoint fills a model before FSDP; call it before apply_fsdp"
            )
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(offset), tuple(shape)


@torch.no_grad()
def _fill(local: torch.Tensor, offset: Sequence[int], pieces: list[torch.Tensor], dim: Optional[int]) -> None:
    """Copy block [offset, offset + local.shape) of the full tensor, stored as `pieces` split along
    `dim` (None: each piece is whole), into `local`, touching only the parts of the pieces it needs."""
    box = [slice(o, o + n) for o, n in zip(offset, local.shape)]
    if dim is None:
        local.copy_(pieces[0][tuple(box)])
        return
    size = pieces[0].shape[dim]
    lo, hi = offset[dim], offset[dim] + local.shape[dim]
    for k in range(lo // size, -(-hi // size)):
        a, b = max(lo, k * size), min(hi, (k + 1) * size)
        src, dst = list(box), [slice(None)] * local.dim()
        src[dim], dst[dim] = slice(a - k * size, b - k * size), slice(a - lo, b - lo)
        local[tuple(dst)].copy_(pieces[k][tuple(src)])


def load_meta_checkpoint(
    folder: Union[str, Path], model: nn.Module, parallel: Any = None, *, verify_checksums: bool = False
) -> ModelArgs:
    """Fill `model` (a models.llama.Transformer built from `read_meta_params(folder)`, at any mp,
    before FSDP wrapping) from a Meta checkpoint written at any MP.

    Every rank memory-maps all source files and copies only its own slice of each parameter from
    the pieces of the files that overlap it: no rank reads or holds a full tensor unless its
    parameter is whole (norms, kv heads replicated when mp > n_kv_heads). No communication; every
    rank reads the folder itself. `parallel` is accepted for symmetry with the export (the layout
    comes from the parameters' DTensor placements). verify_checksums: as in read_meta_params.
    Returns the checkpoint's ModelArgs.
    """
    source = _open(folder, {}, verify_checksums)
    args = source.args
    model_args = getattr(model, "args", None)
    if isinstance(model_args, ModelArgs):
        differ = [f for f in _BEHAVIOUR_FIELDS if getattr(model_args, f) != getattr(args, f)]
        if differ:
            detail = ", ".join(f"{f} = {getattr(args, f)!r} (model: {getattr(model_args, f)!r})" for f in differ)
            raise MetaCheckpointError(
                f"{source.folder / PARAMS_JSON} has {detail}: build the model from read_meta_params(folder)"
            )
    shapes = meta_shapes(args)
    own = model.state_dict()
    missing, unexpected = sorted(set(shapes) - set(own), key=_natural), sorted(set(own) - set(shapes), key=_natural)
    if missing or unexpected:
        raise MetaCheckpointError(
            f"the model does not match the checkpoint in {source.folder} (n_layers = {args.n_layers}): "
            f"checkpoint keys the model lacks {missing[:8]}, model keys the checkpoint lacks {unexpected[:8]}; "
            "build the model from read_meta_params(folder)"
        )
    split = args.resolved_embedding_split
    # Check every parameter before copying any, so an error leaves the model untouched.
    plan = []
    for name, target in own.items():
        if tuple(target.shape) != shapes[name]:
            raise MetaCheckpointError(
                f"{name}: the model's full shape is {_fmt(target.shape)}, the checkpoint in {source.folder} "
                f"holds {_fmt(shapes[name])}; build the model from read_meta_params(folder)"
            )
        local = target.to_local() if isinstance(target, DTensor) else target
        if local.device.type == "meta":
            raise MetaCheckpointError(
                f"{name} is on the meta device: allocate the model first (model.to_empty(device=...))"
            )
        offset, shape = _local_box(target, name)
        if tuple(local.shape) != tuple(shape):
            raise MetaCheckpointError(
                f"{name}: local shard {_fmt(local.shape)} is not the block {_fmt(shape)} its placement implies; "
                "load before apply_fsdp"
            )
        plan.append((local, offset, source.pieces(name), split_dim(name, split)))
    for local, offset, pieces, dim in plan:
        _fill(local, offset, pieces, dim)
    return args


# --- export -----------------------------------------------------------------------------------


def meta_params_json(args: ModelArgs) -> dict[str, Any]:
    """params.json as Meta's code accepts it (see the module docstring for what is left out and why)."""
    llama2 = args.resolved_embedding_split == "dim"
    params: dict[str, Any] = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads}
    if args.n_kv_heads is not None:
        params["n_kv_heads"] = args.n_kv_heads
    params["vocab_size"] = -1 if llama2 else args.vocab_size
    params["multiple_of"] = args.multiple_of
    if args.ffn_dim_multiplier is not None:
        params["ffn_dim_multiplier"] = args.ffn_dim_multiplier
    params["norm_eps"] = args.norm_eps
    # Llama 2's ModelArgs has no rope_theta (Code Llama's has): write it only when it is not the default.
    if not llama2 or args.rope_theta != ModelArgs.rope_theta:
        params["rope_theta"] = args.rope_theta
    if args.use_scaled_rope:  # Llama 3.1's field; older code does not know it
        params["use_scaled_rope"] = True
    return params


def _check_mp_out(args: ModelArgs, mp_out: int) -> None:
    if not isinstance(mp_out, int) or mp_out < 1:
        raise MetaCheckpointError(f"mp_out must be a positive integer, got {mp_out!r}")
    if args.kv_heads % mp_out:
        raise MetaCheckpointError(
            f"cannot export at mp_out = {mp_out}: n_kv_heads = {args.kv_heads} is not divisible by it, and Meta's "
            f"loader splits whole kv heads across files; choose an mp_out that divides {args.kv_heads}"
        )
    try:
        args.check(mp_out)
    except ValueError as err:
        raise MetaCheckpointError(f"cannot export at mp_out = {mp_out}: {err}; choose another mp_out") from err


def _write_durably(path: Path, write) -> None:
    # fsync before the folder is renamed: otherwise a crash could leave the final name with empty files.
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_meta_checkpoint(
    model: nn.Module,
    folder: Union[str, Path],
    parallel: Any = None,
    mp_out: int = 1,
    *,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
) -> Path:
    """Write `model` (a models.llama.Transformer, plain or FSDP2-wrapped) as Meta's consolidated
    checkpoint with mp_out files. Collective: every rank calls it with the same arguments.

    File j is written by rank j % world_size. Parameters are gathered one at a time (full_tensor(),
    in the same order on every rank) and each rank keeps only the slices of its own files, so no rank
    holds the whole model unless it writes every file (world_size == 1). Everything goes into a
    temporary folder next to `folder`, renamed to `folder` when every file is written: a crash never
    leaves a half checkpoint under the final name (a shared file system is assumed). `dtype`: the
    stored dtype (default: the parameters'; Meta's releases are bfloat16). `folder` must not exist
    unless overwrite=True. Returns the folder.
    """
    folder = Path(folder)
    args = getattr(model, "args", None)
    if not isinstance(args, ModelArgs):
        raise MetaCheckpointError("save_meta_checkpoint needs a models.llama.Transformer (a model with .args)")
    _check_mp_out(args, mp_out)
    rank, world = rank_and_world()
    split = args.resolved_embedding_split
    shapes = meta_shapes(args)

    # Rank 0 decides (one file system view) and tells the others: the temp folder, or why not.
    decision: Any = None
    if rank == 0:
        try:
            if folder.exists() and not overwrite:
                raise MetaCheckpointError(f"{folder} already exists: choose a new folder or pass overwrite=True")
            folder.parent.mkdir(parents=True, exist_ok=True)
            # os.mkdir (not mkdtemp, whose 0700 would become the checkpoint's mode) under a unique name.
            tmp = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:12]}.partial"
            tmp.mkdir()
            decision = ("ok", str(tmp))
        except Exception as err:  # noqa: BLE001 - every rank must raise the same error
            decision = ("error", f"{type(err).__name__}: {err}")
    status, value = from_rank0(decision, world)
    if status == "error":
        raise MetaCheckpointError(value)
    tmp = Path(value)

    mine = [j for j in range(mp_out) if j % world == rank]
    outputs: dict[int, dict[str, torch.Tensor]] = {j: {} for j in mine}
    error: Optional[str] = None
    stored_dtype = dtype
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name not in shapes:
                error = error or f"{name} is not a parameter of Meta's Llama format"
                continue
            # Collective: every rank gathers every parameter in the same order, then drops it.
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if tuple(full.shape) != shapes[name]:
                error = error or f"{name} has shape {_fmt(full.shape)}, its ModelArgs imply {_fmt(shapes[name])}"
                continue
            stored_dtype = stored_dtype or full.dtype
            d = split_dim(name, split)
            for j in mine:
                piece = full if d is None else full.chunk(mp_out, dim=d)[j]
                # clone(): torch.save stores a view's whole storage, and the full tensor must be freed.
                outputs[j][name] = piece.to(dtype or piece.dtype).clone(memory_format=torch.contiguous_format)
            del full
    if error is None:
        try:
            if split == "dim":
                freqs = rope_inverse_frequencies(args).to(stored_dtype or torch.float32)
            for j in mine:
                if split == "dim":
                    outputs[j][ROPE_FREQS] = freqs.clone()
                _write_durably(tmp / shard_name(j), lambda f, j=j: torch.save(outputs[j], f))
                outputs[j] = {}  # free each file's tensors once written
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            error = f"{type(err).__name__}: {err}"
    errors = [e for e in gather_all(error, world) if e is not None]

    outcome: Any = None
    if rank == 0:
        try:
            if errors:
                raise MetaCheckpointError(f"writing {folder} failed: {errors[0]}")
            # params.json last: a folder with it is complete.
            text = json.dumps(meta_params_json(args), indent=2) + "\n"
            _write_durably(tmp / PARAMS_JSON, lambda f: f.write(text.encode()))
            replace_folder(tmp, folder)  # overwrite=True: the old folder goes only once the new one is in place
            outcome = ("ok", str(folder))
        except Exception as err:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = ("error", str(err) if isinstance(err, MetaCheckpointError) else f"{type(err).__name__}: {err}")
    status, value = from_rank0(outcome, world)
    if status == "error":
        raise MetaCheckpointError(value)
    return folder
