"""Loading a DCP checkpoint safely: SafeLoadPlanner, and the errors a refused checkpoint raises.

SafeLoadPlanner is DCP's default load planner except that a non-tensor value (an optimizer's
hyperparameters, say) is unpickled only when torch.load's weights_only unpickler accepts it: the
default planner unpickles those bytes without restriction. It runs with every storage reader, the
fast one (hybridpar.fastpaths.dcp_reader) and DCP's own alike.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from ..safe_pickle import CheckpointReadError


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded here, with what to change."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose `.metadata` names a global DCP's metadata never holds (safe_pickle refused
    it before importing anything). Every rank reads `.metadata`, so every rank raises it alike."""

    every_rank = True  # hybridpar.mesh.ranks.raised_by_every_rank


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose bytes are not the ones written (a checksum mismatch, a file cut short or
    missing): resuming sets it aside and loads an older one."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that unpickles a stored non-tensor value only if it is plain data."""

    def load_bytes(self, read_item: ReadItem, value) -> None:
        try:
            torch.load(value, weights_only=True)  # plain data only, or it raises
        except Exception as err:  # noqa: BLE001 - the unpickler's errors vary
            raise CheckpointReadError(
                f"{read_item.storage_index.fqn}: the checkpoint stores a value that is not plain data, refused "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); load only checkpoints you trust "
                "and that hybridpar wrote"
            ) from err
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to hold plain data
