"""Does a checkpoint fit this model? Refusals, with the differences named and what to change, of a
hybridpar checkpoint saved for another model or saved without some of the model's tensors (a
pipeline-parallel save that did not get every stage), before anything is read; and of a save
that would leave such a checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hybridpar.models.args import ModelArgs

from ..mesh.ranks import mark_every_rank
from ..safe_pickle import UnsafePickleError, read_dcp_metadata
from .foreign import model_shapes
from .reader import CheckpointError, UnsafeCheckpointError
from .stages import missing_text


# ModelArgs fields that do not change what the stored tensors mean: batch and sequence limits
# (RoPE is computed on the fly) and how the embedding is split over mp (DCP stores whole tensors).
_NOT_IN_THE_WEIGHTS = {"max_batch_size", "max_seq_len", "embedding_split"}
# A params.json saved before a field existed holds the model that field's default describes.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelArgs)}


def _refuse_other_model(path: Path, saved: dict, params: dict) -> None:
    """Raise naming every field of the model's params that the checkpoint's params.json differs in."""
    differ = {k: (saved.get(k, _DEFAULTS.get(k)), v) for k, v in params.items()
              if k not in _NOT_IN_THE_WEIGHTS and saved.get(k, _DEFAULTS.get(k)) != v}
    if "tie_embeddings" in differ:
        tied = bool(differ["tie_embeddings"][0])
        stored = "no output.weight: its head reads tok_embeddings" if tied else "an output.weight of its own"
        raise CheckpointError(
            f"{path} was saved with tie_embeddings = {tied} ({stored}), this model has tie_embeddings = {not tied}: "
            f"build the model with tie_embeddings = {tied} (\"tie_embeddings\": {str(tied).lower()} in its "
            "params.json or preset) to load it"
        )
    if differ:
        listed = ", ".join(f"{k}: checkpoint {a!r}, this model {b!r}" for k, (a, b) in differ.items())
        raise CheckpointError(f"{path} was saved for a different model ({listed}); use the same model settings")


def check_checkpoint(path: Path, params: dict, model: torch.nn.Module,
                     needs_optimizer: bool = False) -> dict:
    """Refuse, with the differences named, a checkpoint that is incomplete or saved for another model.
    Returns DCP's metadata of what the checkpoint stores, by key."""
    if not (path / "train_state.json").exists() or not (path / ".metadata").exists():
        raise CheckpointError(f"{path} is not a complete hybridpar checkpoint (no train_state.json or .metadata)")
    _refuse_other_model(path, json.loads((path / "params.json").read_text()), params)
    try:  # after LoadCheck compared its bytes with the manifest, when there is one
        metadata = read_dcp_metadata(path / ".metadata").state_dict_metadata
    except UnsafePickleError as err:
        raise UnsafeCheckpointError(f"{err}; delete {path} or move it aside (a resumed run then loads the "
                                    "checkpoint before it)") from err
    if needs_optimizer and not any(key.startswith("optimizer.") for key in metadata):
        raise CheckpointError(
            f"{path} holds weights only (no optimizer state) and cannot be resumed: start a run from it "
            "with checkpoint.init_from instead"
        )
    absent = [name for name, _ in model.named_parameters()
              if not isinstance(metadata.get(f"model.{name}"), TensorStorageMetadata)]
    if absent:  # its params.json is this model's (checked above): the save left these out
        raise CheckpointError(
            f"{path} lacks {missing_text(absent)} of this model (its params.json is this model's): it was saved "
            "without them (a pipeline-parallel save not given every stage); load another checkpoint (a resumed "
            f"run loads the newest: move {path.name} out of {path.parent})")
    for name, param in model.named_parameters():
        stored = metadata[f"model.{name}"]
        if tuple(stored.size) != tuple(param.shape):
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(stored.size)} in the checkpoint, {tuple(param.shape)} in this model"
            )
    return metadata


def refuse_incomplete_save(final: Path, names: Iterable[str], params: dict) -> None:
    """Refuse, on every rank alike, a save whose ranks together hold less than the whole model of
    `params` (`names`: the model state's names on every rank together): it could never be loaded."""
    names = set(names)
    absent = [name for name in model_shapes(ModelArgs.from_dict(params)) if name not in names]
    if absent:
        raise mark_every_rank(CheckpointError(
            f"checkpoint {final.name} not saved: no rank holds {missing_text(absent)} of the model (n_layers = "
            f"{params['n_layers']}); give Checkpointer.save every stage module each rank holds (a list), on "
            "every rank"))
