"""Reading Meta's consolidated checkpoints (the format: hybridpar.checkpoint.meta, which exports this API).

read_meta_params checks a folder's params.json against the shapes of its consolidated files;
load_meta_checkpoint fills a model at any mp from a checkpoint written at any MP, each rank copying
only its own slice of each parameter from the memory-mapped files.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.llama import ModelArgs

from ..parallel.state import local_box
from .meta import (_BEHAVIOUR_FIELDS, _FLOAT_FIELDS, _INT_FIELDS, PARAMS_JSON, REQUIRED_FIELDS, ROPE_FREQS, SHARD_FILE,
                   MetaCheckpointError, _fmt, _load_file, meta_shapes, rope_inverse_frequencies, shard_name, split_dim)


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
        offset, shape = local_box(target, name, MetaCheckpointError)
        if tuple(local.shape) != tuple(shape):
            raise MetaCheckpointError(
                f"{name}: local shard {_fmt(local.shape)} is not the block {_fmt(shape)} its placement implies; "
                "load before apply_fsdp"
            )
        plan.append((local, offset, source.pieces(name), split_dim(name, split)))
    for local, offset, pieces, dim in plan:
        _fill(local, offset, pieces, dim)
    return args

