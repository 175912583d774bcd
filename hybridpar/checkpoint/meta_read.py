"""Reading Meta's consolidated checkpoints (the format: hybridpar.checkpoint.meta, which exports this API).

read_meta_params checks a folder's params.json against the shapes of its consolidated files;
load_meta_checkpoint fills a model at any mp from a checkpoint written at any MP, each rank copying
only its own slice of each parameter from the memory-mapped files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from hybridpar.models.args import ModelArgs

from ..mesh.ranks import mark_every_rank
from .foreign import ForeignSource, load_foreign, model_shapes, natural
from .meta import (PARAMS_JSON, ROPE_FREQS, SHARD_FILE, SIDECAR_JSON, MetaCheckpointError, _load_file,
                   rope_inverse_frequencies, shard_name, split_dim)
from .meta_json import read_params, read_sidecar
from .stages import held


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


class _MetaSource(ForeignSource):
    """An opened checkpoint folder: params, memory-mapped shards and the resolved layout."""

    error = MetaCheckpointError

    def __init__(self, folder: Path, params: dict[str, Any], paths: list[Path], shards: list[dict[str, torch.Tensor]],
                 args: ModelArgs) -> None:
        super().__init__(folder, args, folder / PARAMS_JSON, "read_meta_params(folder)", "the caller's overrides")
        self.params, self.paths, self.shards = params, paths, shards

    def pieces(self, name: str) -> list[torch.Tensor]:
        return [shard[name] for shard in self.shards]

    def check_block(self, name: str, offset: Sequence[int], shape: Sequence[int]) -> None:
        """A tied model reads output.weight from tok_embeddings: the files' copy must equal it on this rank's rows."""
        if name != "tok_embeddings.weight" or not self.args.tie_embeddings:
            return
        if not _same_block(offset, shape, self.pieces("output.weight"), self.pieces("tok_embeddings.weight"), 0):
            raise MetaCheckpointError(
                f"output.weight in {self.folder} differs from tok_embeddings.weight in rows {offset[0]} to "
                f"{offset[0] + shape[0] - 1}: the checkpoint is untied and the model tied (tie_embeddings = true, "
                f"from {self.tied_by}). Put {{\"tie_embeddings\": false}} in {self.folder / SIDECAR_JSON} and build "
                "the model from read_meta_params(folder)"
            )

    def read_into(self, name: str, offset: Sequence[int], out: torch.Tensor) -> None:
        """Touching only the parts of the files' pieces the block needs."""
        pieces, dim = self.pieces(name), split_dim(name, self.args.resolved_embedding_split)
        for k, src, dst in _overlaps(offset, out.shape, pieces, dim):
            out[dst].copy_(pieces[k][src])


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
        raise MetaCheckpointError(f"{key} in {paths[0]} has shape {list(shape)}, expected 2 dimensions [vocab, dim]")
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
            f"{key} in {paths[0].name} has shape {list(shape)}: with {n} files its second dimension should be "
            f"dim = {dim} (split on the vocabulary, Llama 3 layout) or dim / {n} = {dim / n:g} (split on dim, "
            "Llama 2 layout); params.json's dim or the number of files is wrong"
        )
    if declared not in ("auto", split):
        raise MetaCheckpointError(
            f"{paths[0].parent / PARAMS_JSON} says embedding_split = {declared!r}, but {key} in {paths[0].name} "
            f"{list(shape)} across {n} files is split as {split!r}; remove embedding_split from params.json"
        )
    if params["vocab_size"] not in (-1, vocab):
        raise MetaCheckpointError(
            f"{paths[0].parent / PARAMS_JSON} says vocab_size = {params['vocab_size']}, but {key} in {paths[0].name} "
            f"{list(shape)} across {n} files holds {vocab} tokens; fix vocab_size (or set it to -1)"
        )
    return split, vocab


def _check_shards(source: _MetaSource) -> None:
    """Every file holds exactly Meta's keys, each with its share of the shape params.json implies."""
    args, n = source.args, len(source.shards)
    shapes = {**model_shapes(args), "output.weight": (args.vocab_size, args.dim)}  # files hold it when tied too
    split = args.resolved_embedding_split
    for path, shard in zip(source.paths, source.shards):
        keys = set(shard) - {ROPE_FREQS}
        missing, unexpected = sorted(set(shapes) - keys, key=natural), sorted(keys - set(shapes), key=natural)
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
                how = f"full {list(full)} split on dim {d} into {n} files" if d is not None else "whole in every file"
                raise MetaCheckpointError(
                    f"{name} in {path} has shape {list(actual)}, but params.json implies {list(expected)} "
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
            f"{ROPE_FREQS} in {path} has shape {list(freqs.shape)}, but params.json implies head_dim / 2 = "
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


def read_meta_json(folder: Path) -> dict[str, dict]:
    """{"params.json": ..., "hybridpar.json": ...} of a Meta folder, each checked ({} without a hybridpar.json)."""
    params = read_params(Path(folder))
    return {PARAMS_JSON: params, SIDECAR_JSON: read_sidecar(Path(folder), params)}


def _open(folder: Union[str, Path], overrides: Mapping[str, Any], verify_checksums: bool = False,
          parsed: Optional[Mapping[str, dict]] = None) -> _MetaSource:
    folder = Path(folder)
    paths = _shard_paths(folder)
    parsed = read_meta_json(folder) if parsed is None else parsed
    params, sidecar = parsed[PARAMS_JSON], parsed[SIDECAR_JSON]
    shards = [_load_file(p, verify_checksums) for p in paths]
    _check_shard_count(paths, shards, params)
    embedding_split, vocab = _resolve_layout(paths, shards, params)
    fields = {**params, **sidecar, "vocab_size": vocab, "embedding_split": embedding_split, **overrides}
    try:
        args = ModelArgs.from_dict(fields)
        args.check(1)
    except ValueError as err:  # the same on every rank: each reads the same files
        raise mark_every_rank(MetaCheckpointError(f"{folder / PARAMS_JSON}: {err}")) from err
    source = _MetaSource(folder, params, paths, shards, args)
    _check_shards(source)
    if "tie_embeddings" not in overrides:  # else the caller has decided
        _resolve_tie(source, sidecar)
    return source


_TIE_SAMPLE_ROWS = 64


def _sample_rows_equal(source: _MetaSource) -> bool:
    """output.weight equals tok_embeddings.weight, exactly, on up to 64 evenly spaced rows (both split
    on the vocabulary, the same way in every file): a few rows read from the memory-mapped files."""
    embedding, output = source.pieces("tok_embeddings.weight"), source.pieces("output.weight")
    rows = embedding[0].shape[0]
    vocab = rows * len(source.shards)
    count = min(_TIE_SAMPLE_ROWS, vocab)
    sample = sorted({(i * (vocab - 1)) // max(count - 1, 1) for i in range(count)})
    return all(torch.equal(embedding[r // rows][r % rows], output[r // rows][r % rows]) for r in sample)


def _resolve_tie(source: _MetaSource, sidecar: Mapping[str, Any]) -> None:
    """tie_embeddings from hybridpar.json (or params.json) when stated, checked against a sample of
    rows; else, in the Llama 3 layout, true when the sample of output.weight equals tok_embeddings."""
    declared = next((p for p, f in ((SIDECAR_JSON, sidecar), (PARAMS_JSON, source.params)) if "tie_embeddings" in f),
                    None)
    if declared is not None:
        source.tied_by = declared
        if source.args.tie_embeddings and not _sample_rows_equal(source):
            raise MetaCheckpointError(
                f"{source.folder / declared} says tie_embeddings = true, but output.weight differs from "
                "tok_embeddings.weight in the consolidated files: set it to false (or remove it) if the model "
                "has its own output head, else the files are from another model"
            )
    elif source.args.resolved_embedding_split != "vocab":
        source.tied_by = "the Llama 2 layout (tok_embeddings split on dim, unlike output)"
    elif _sample_rows_equal(source):
        source.args = dataclasses.replace(source.args, tie_embeddings=True)
        source.tied_by = "the consolidated files (output.weight equals tok_embeddings.weight)"
    else:
        source.tied_by = "the consolidated files (output.weight differs from tok_embeddings.weight)"


def read_meta_params(folder: Union[str, Path], *, verify_checksums: bool = False,
                     parsed: Optional[Mapping[str, dict]] = None, **overrides: Any) -> ModelArgs:
    """The ModelArgs of a Meta checkpoint folder, checked against its consolidated files.

    A vocab_size of -1 (Llama 2) is replaced by the size the tok_embeddings shards hold, and
    `embedding_split` is set to the layout the files use ("dim": Llama 2, "vocab": Llama 3; with one
    file, "dim" when vocab_size is -1 or rope.freqs is present, else "vocab"). hybridpar.json, when
    present, adds the fields Meta's params.json cannot state (RoPE factors, tie_embeddings). Unless
    it states tie_embeddings (a folder from Meta has no such file), tie_embeddings is true when
    output.weight equals tok_embeddings.weight exactly on up to 64 evenly spaced rows (Meta's Llama
    3.2 1B/3B files hold both, equal; a few rows of the memory-mapped files are read); two matrices
    that agree there but not elsewhere need {"tie_embeddings": false} in hybridpar.json. A Llama 3.2
    folder from Meta reads with the RoPE factor 8 Meta's code fixes; the models were trained with 32:
    add {"rope_scaling_factor": 32.0} in hybridpar.json. `overrides` replace fields (e.g.
    max_seq_len=4096, which Meta's params.json does not hold). The files are memory-mapped, not
    read, so bytes damaged inside a tensor go unnoticed unless verify_checksums=True (reads every
    byte to check the zip CRC-32s).
    `parsed`: the folder's JSON files as read_meta_json read them, not read again.
    Raises MetaCheckpointError naming the file, key and shapes when anything does not fit.
    """
    return _open(folder, overrides, verify_checksums, parsed).args


# --- import -----------------------------------------------------------------------------------


def _overlaps(offset: Sequence[int], shape: Sequence[int], pieces: list[torch.Tensor], dim: Optional[int]):
    """(k, index in pieces[k], index in the block) for each piece overlapping block [offset, offset +
    shape) of the full tensor stored as `pieces` split along `dim` (None: each piece is whole)."""
    box = [slice(o, o + n) for o, n in zip(offset, shape)]
    if dim is None:
        yield 0, tuple(box), (slice(None),) * len(shape)
        return
    size = pieces[0].shape[dim]
    lo, hi = offset[dim], offset[dim] + shape[dim]
    for k in range(lo // size, -(-hi // size)):
        a, b = max(lo, k * size), min(hi, (k + 1) * size)
        src, dst = list(box), [slice(None)] * len(shape)
        src[dim], dst[dim] = slice(a - k * size, b - k * size), slice(a - lo, b - lo)
        yield k, tuple(src), tuple(dst)


def _same_block(offset: Sequence[int], shape: Sequence[int], a: list[torch.Tensor], b: list[torch.Tensor],
                dim: Optional[int]) -> bool:
    """Two tensors stored alike (pieces split along `dim`) are equal, exactly, on one block."""
    return all(torch.equal(a[k][src], b[k][src]) for k, src, _ in _overlaps(offset, shape, a, dim))


def load_meta_checkpoint(
    folder: Union[str, Path], model: nn.Module, parallel: Any = None, *, verify_checksums: bool = False,
    parsed: Optional[Mapping[str, dict]] = None,
) -> ModelArgs:
    """Fill `model` (a hybridpar.models.llama.Transformer built from `read_meta_params(folder)`, at any mp,
    before FSDP wrapping) from a Meta checkpoint written at any MP.

    Every rank memory-maps all source files and copies only its own slice of each parameter from
    the pieces of the files that overlap it: no rank reads or holds a full tensor unless its
    parameter is whole (norms, kv heads replicated when mp > n_kv_heads). Every rank reads the
    folder itself; the only communication is one flag after the checks (collective: every rank calls). `parallel` is accepted for symmetry with the export (the layout
    comes from the parameters' DTensor placements). verify_checksums: as in read_meta_params.
    A tied model (tie_embeddings, as read_meta_params tells) takes tok_embeddings only, after
    checking that the files' output.weight equals it on this rank's rows; the model's
    tie_embeddings must be the checkpoint's. A pipeline stage (pipeline.cutting.build_stage) reads
    only its layers and ends. `parsed`: as in read_meta_params. Returns the checkpoint's ModelArgs.
    """
    # A pipeline stage lacking the embedding or the head is untied (build_stage refuses a tied model):
    # deciding it from the files would read rows of matrices the stage does not hold.
    whole = held(model, "tok_embeddings.weight") and held(model, "norm.weight")
    overrides = {} if whole else {"tie_embeddings": False}
    return load_foreign(_open(folder, overrides, verify_checksums, parsed), model)
