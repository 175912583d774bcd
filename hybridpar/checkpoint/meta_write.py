"""Writing Meta's consolidated checkpoints (the format: hybridpar.checkpoint.meta, which exports this API).

Rank 0 refuses an occupied destination and stages `<folder>.partial`; every rank writes its own
consolidated files into it; rank 0 writes params.json last and renames the folder into place
(files.commit_staged), or removes it if any rank failed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.args import ModelArgs

from ..files import (OCCUPIED_ADVICE, atomic_output, begin_staging, commit_staged, refuse_occupied, staging_path,
                     write_text_atomic)
from ..ranks import on_rank0, raise_if_any_failed, rank_and_world
from .meta import (PARAMS_JSON, ROPE_FREQS, SIDECAR_JSON, MetaCheckpointError, _fmt, hybridpar_json, meta_ffn_fields,
                   meta_params_json, meta_shapes, rope_inverse_frequencies, shard_name, split_dim)


def _check_mp_out(args: ModelArgs, mp_out: int) -> None:
    if not isinstance(mp_out, int) or mp_out < 1:
        raise MetaCheckpointError(f"mp_out must be a positive integer, got {mp_out!r}")
    if args.kv_heads % mp_out:
        raise MetaCheckpointError(
            f"cannot export at mp_out = {mp_out}: n_kv_heads = {args.kv_heads} is not divisible by it, and Meta's "
            f"loader splits whole kv heads across files; choose an mp_out (convert's --meta-files) that divides "
            f"{args.kv_heads}"
        )
    try:
        args.check(mp_out)
    except ValueError as err:
        raise MetaCheckpointError(f"cannot export at mp_out = {mp_out}: {err}; choose another mp_out "
                                  "(convert's --meta-files)") from err


def _begin(folder: Path, overwrite: bool) -> Path:
    """Rank 0: refuse an existing `folder` (unless overwrite), then stage its replacement."""
    advice = "choose a new folder" if overwrite else OCCUPIED_ADVICE
    refuse_occupied(folder, advice, error_type=MetaCheckpointError, overwrite=overwrite, empty_ok=False)
    return begin_staging(folder)


def _slices(model: nn.Module, args: ModelArgs, mine: list[int], mp_out: int,
            dtype: Optional[torch.dtype]) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's files `mine`: {file: {name: slice}}. Collective: every rank gathers every
    parameter (full_tensor(), in the same order) and keeps only its slices, so no rank holds the
    whole model unless it writes every file. A mismatch is raised only after the last gather.
    A tied model's output.weight is written as a copy of tok_embeddings (as Meta's Llama 3.2 files)."""
    shapes, split = meta_shapes(args), args.resolved_embedding_split
    outputs: dict[int, dict[str, torch.Tensor]] = {j: {} for j in mine}
    problem: Optional[str] = None
    stored_dtype, seen = dtype, set()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name not in shapes or (name == "output.weight" and args.tie_embeddings):
                problem = problem or (f"{name} is not a parameter of Meta's Llama format "
                                      f"(tie_embeddings = {args.tie_embeddings})")
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if tuple(full.shape) != shapes[name]:
                problem = problem or f"{name} has shape {_fmt(full.shape)}, its ModelArgs imply {_fmt(shapes[name])}"
                continue
            stored_dtype = stored_dtype or full.dtype
            copies = [name, "output.weight"] if name == "tok_embeddings.weight" and args.tie_embeddings else [name]
            seen.update(copies)
            for j in mine:
                for key in copies:  # the same rows: both split on dim 0 (a tied model's embedding is vocab-split)
                    d = split_dim(key, split)
                    piece = full if d is None else full.chunk(mp_out, dim=d)[j]
                    # clone(): torch.save stores a view's whole storage, and the full tensor must be freed.
                    outputs[j][key] = piece.to(dtype or piece.dtype).clone(memory_format=torch.contiguous_format)
            del full
    lacking = [n for n in shapes if n not in seen]
    problem = problem or (f"the model has no {lacking[0]} (tie_embeddings = {args.tie_embeddings})" if lacking else None)
    if problem:
        raise MetaCheckpointError(f"{problem}: save a models.llama.Transformer built from its own ModelArgs")
    if split == "dim":
        freqs = rope_inverse_frequencies(args).to(stored_dtype or torch.float32)
        for j in mine:
            outputs[j][ROPE_FREQS] = freqs.clone()
    return outputs


def _write_files(staged: Path, model: nn.Module, args: ModelArgs, mp_out: int, dtype: Optional[torch.dtype]) -> None:
    """Write this rank's consolidated files (file j by rank j % world size) into `staged`."""
    rank, world = rank_and_world()
    outputs = _slices(model, args, [j for j in range(mp_out) if j % world == rank], mp_out, dtype)
    for j in sorted(outputs):
        with atomic_output(staged / shard_name(j)) as f:
            torch.save(outputs[j], f)
        outputs[j] = {}  # free each file's tensors once written


def _commit(staged: Path, folder: Path, args: ModelArgs) -> None:
    """Rank 0, once every file is written: hybridpar.json when needed, params.json last (a folder
    with it is complete), then the rename."""
    extra = hybridpar_json(args)
    if extra:
        write_text_atomic(staged / SIDECAR_JSON, json.dumps(extra, indent=2) + "\n")
    write_text_atomic(staged / PARAMS_JSON, json.dumps(meta_params_json(args), indent=2) + "\n")
    commit_staged(staged, folder)  # overwrite=True: the old folder goes only once the new one is in place


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

    File j is written by rank j % world_size, each rank keeping only the slices of its own files.
    Everything goes into `<folder>.partial`, renamed to `folder` when every file is written: a crash
    never leaves a half checkpoint under the final name (a shared file system is assumed). `dtype`:
    the stored dtype (default: the parameters'; Meta's releases are bfloat16). `folder` must not
    exist unless overwrite=True. Every rank returns the folder or raises.
    """
    folder = Path(folder)
    args = getattr(model, "args", None)
    if not isinstance(args, ModelArgs):
        raise MetaCheckpointError("save_meta_checkpoint needs a models.llama.Transformer (a model with .args)")
    _check_mp_out(args, mp_out)
    meta_ffn_fields(args)  # params.json must be able to state the feed-forward size: refuse before any write
    staged = on_rank0(lambda: _begin(folder, overwrite), f"prepare {staging_path(folder)}",
                      error_type=MetaCheckpointError)
    try:
        error: Optional[Exception] = None
        try:
            _write_files(staged, model, args, mp_out, dtype)
        except Exception as err:  # noqa: BLE001 - every rank raises below, not only this one
            error = err
        raise_if_any_failed(error, f"write {folder}", error_type=MetaCheckpointError)
        on_rank0(lambda: _commit(staged, folder, args), f"complete {folder}", error_type=MetaCheckpointError)
    except BaseException:
        if rank_and_world()[0] == 0:  # every rank is past its writes: all raise together above
            shutil.rmtree(staged, ignore_errors=True)
        raise
    return folder
