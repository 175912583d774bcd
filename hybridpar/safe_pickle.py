"""Unpickling files that may come from anyone, without running their code.

A pickle names the globals it needs and the unpickler imports and calls them: a crafted file names
`os.system` and runs a command. Every pickle hybridpar reads from a file goes through `loads` with
the globals that file's format is made of; anything else is refused, naming the global, before it is
imported. Two formats are pickles: DCP's `.metadata` (its own dataclasses, torch.Size, dtypes,
layouts, paths) and torch's flight-recorder dumps (plain containers only: no global at all).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Callable, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class UnsafePickleError(ValueError):
    """A pickle refused because it names a global its format does not hold: reading it would have
    imported (and could have called) that global. Nothing of it was run."""

    def __init__(self, what: str, global_name: str, expected: str) -> None:
        self.global_name = global_name
        self.reason = (f"refused: unpickling it would import {global_name}, which {expected} never holds; "
                       "the file was crafted or is not what its name says (nothing of it was run)")
        super().__init__(f"{what}: {self.reason}")


class CheckpointReadError(ValueError):
    """A checkpoint reader's refusal of bytes it cannot use (a file cut short, a damaged archive, a
    value that is not plain data). Here, below both readers that raise it (DCP's with the safe
    planner, and the fast path's), so neither imports the other's floor."""


Allowed = Callable[[str, str], bool]


class _Restricted(pickle.Unpickler):
    def __init__(self, stream, allowed: Allowed, what: str, expected: str) -> None:
        super().__init__(stream)
        self._allowed, self._what, self._expected = allowed, what, expected

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(module, name):
            raise UnsafePickleError(self._what, f"{module}.{name}", self._expected)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:  # what torch.save's archives use: never in these formats
        raise UnsafePickleError(self._what, f"persistent id {str(pid)[:40]!r}", self._expected)


def loads(data: bytes, allowed: Allowed, what: str, expected: str) -> Any:
    """Unpickle `data` importing only the globals `allowed(module, name)` accepts. `what` names the
    source in the error (a path); `expected` the format ("a DCP .metadata file")."""
    return _Restricted(io.BytesIO(data), allowed, what, expected).load()


def no_globals(module: str, name: str) -> bool:
    """Plain containers and scalars only (dict, list, tuple, str, bytes, numbers, None, bool)."""
    return False


# --- DCP's .metadata ------------------------------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # an Enum: built from its value
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id: the folder it was saved to
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
}


def dcp_metadata_global(module: str, name: str) -> bool:
    """What DCP's `.metadata` is made of: its dataclasses, torch.Size, dtypes, layouts, paths."""
    if (module, name) in _DCP_CLASSES:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))


def read_dcp_metadata(path: Union[str, Path]) -> Metadata:
    """DCP's Metadata from a `.metadata` file, read through the restricted unpickler."""
    path = Path(path)
    metadata = loads(path.read_bytes(), dcp_metadata_global, str(path), "a checkpoint's .metadata")
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata: not a checkpoint's .metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader, reading `.metadata` through the restricted unpickler (DCP's own
    read_metadata unpickles it without restriction)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = getattr(self, "_get_metadata_path", None)  # torch < 2.8: always ".metadata"
        metadata = read_dcp_metadata(where(kwargs.get("rank")) if where else self.fs.concat_path(self.path, ".metadata"))
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata
