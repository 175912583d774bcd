"""Writing Meta's consolidated checkpoints (the format: hybridpar.checkpoint.meta, which exports this
API): the adapter to foreign.export_foreign, which stages the folder and gathers the parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from hybridpar.models.args import ModelArgs

from ..files import atomic_output, write_text_atomic
from .foreign import ForeignTarget, export_foreign, model_args
from .meta import (PARAMS_JSON, ROPE_FREQS, SIDECAR_JSON, MetaCheckpointError, hybridpar_json, meta_ffn_fields,
                   meta_params_json, rope_inverse_frequencies, shard_name, split_dim)


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


def refuse_llama4(args: ModelArgs) -> None:
    """MetaCheckpointError for a Llama 4 model: hybridpar writes Meta's Llama 2 and 3 layout only."""
    # Meta's own Llama 4 checkpoints (its llama-models code) are another layout (experts fused as
    # moe_w_in_eD_F ..., a params.json with moe_args) that no loader here can check an export against.
    if args.llama4:
        raise MetaCheckpointError("Meta's format is written for Llama 2 and 3; a Llama 4 model (experts, RoPE-less "
                                  "or chunked attention) converts to hf or dcp (hybridpar convert --to hf)")


class _MetaTarget(ForeignTarget):
    """mp_out consolidated files, each parameter split along split_dim. A tied model's output.weight
    is written as a copy of tok_embeddings (as Meta's Llama 3.2 files)."""

    error = MetaCheckpointError

    def pieces(self, name: str, full: torch.Tensor, j: int) -> dict[str, torch.Tensor]:
        tied = name == "tok_embeddings.weight" and self.args.tie_embeddings
        out = {}
        for key in [name, "output.weight"] if tied else [name]:  # the same rows: both split on dim 0 when tied
            d = split_dim(key, self.args.resolved_embedding_split)
            piece = full if d is None else full.chunk(self.n_files, dim=d)[j]
            # clone(): torch.save stores a view's whole storage, and the full tensor must be freed.
            out[key] = piece.to(self.dtype or piece.dtype).clone(memory_format=torch.contiguous_format)
        return out

    def write_file(self, staged: Path, j: int, tensors: dict[str, torch.Tensor]) -> None:
        if self.args.resolved_embedding_split == "dim":  # Llama 2's files carry rope.freqs, in the weights' dtype
            tensors[ROPE_FREQS] = rope_inverse_frequencies(self.args).to(next(iter(tensors.values())).dtype)
        with atomic_output(staged / shard_name(j)) as f:
            torch.save(tensors, f)

    def finish(self, staged: Path) -> None:
        """The tokenizer's files, hybridpar.json when needed, params.json last (a folder with it is complete)."""
        self.copy_extra_files(staged)
        extra = hybridpar_json(self.args)
        if extra:
            write_text_atomic(staged / SIDECAR_JSON, json.dumps(extra, indent=2) + "\n")
        write_text_atomic(staged / PARAMS_JSON, json.dumps(meta_params_json(self.args), indent=2) + "\n")


def save_meta_checkpoint(
    model: nn.Module,
    folder: Union[str, Path],
    parallel: Any = None,
    mp_out: int = 1,
    *,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
    extra_files: Optional[Mapping[str, Path]] = None,
) -> Path:
    """Write `model` (a hybridpar.models.llama.Transformer, plain or FSDP2-wrapped) as Meta's consolidated
    checkpoint with mp_out files. Collective: every rank calls it with the same arguments.

    File j is written by rank j % world_size, each rank keeping only the slices of its own files.
    Everything goes into `<folder>.partial`, renamed to `folder` when every file is written: a crash
    never leaves a half checkpoint under the final name (a shared file system is assumed). `dtype`:
    the stored dtype (default: the parameters'; Meta's releases are bfloat16). `folder` must not
    exist unless overwrite=True. extra_files: {name: file} copied in too (the tokenizer's, where Meta's
    folders keep it: tokenizer.model). Every rank returns the folder or raises.
    """
    args = model_args(model, MetaCheckpointError, "save_meta_checkpoint")
    refuse_llama4(args)
    _check_mp_out(args, mp_out)
    meta_ffn_fields(args)  # params.json must be able to state the feed-forward size: refuse before any write
    return export_foreign(_MetaTarget(args, mp_out, dtype, extra_files), model, Path(folder), overwrite)
