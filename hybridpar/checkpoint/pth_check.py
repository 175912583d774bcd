"""What a torch.save file (a zip archive) records about itself, checked against the file before it is
loaded, so that a refusal names the real reason: which tensor a file cut short lost, or that its
pickle would run code.

torch.save writes `<archive>/data.pkl` first (a pickle of the tensors' names, shapes and storage
keys), then each storage as a record `<archive>/data/<key>`, and the zip directory last. A file cut
short loses its directory; its records are then found by walking from the front, each one's size
known from the pickle. The pickle is read by a skeleton unpickler that builds nothing: it accepts
only the few names a tensor dict uses.
"""

from __future__ import annotations

import collections
import io
import mmap
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Optional

import torch

from ..compat.torch import pickled_storage_dtype

_LOCAL_HEADER = b"PK\x03\x04"
_UNSAFE = re.compile(r"unsupported global:?\s*(?:GLOBAL\s+)?([\w.]+)", re.IGNORECASE)


def unsafe_global(error: BaseException) -> Optional[str]:
    """The global a weights_only refusal names (a pickle that would import or call it), else None."""
    if not isinstance(error, pickle.UnpicklingError):
        return None
    found = _UNSAFE.search(str(error))
    return found.group(1) if found else None


class _Skeleton(pickle.Unpickler):
    """Reads a torch.save pickle into {name: (storage key, bytes)}; refuses any other global."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, *args: storage
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return torch.empty(0, dtype=pickled_storage_dtype(name)).element_size()
        raise pickle.UnpicklingError(f"unsupported global {module}.{name}")

    def persistent_load(self, pid):  # ("storage", element size, key, location, elements)
        return pid[2], pid[1] * pid[4]


def _pickled(view) -> dict[str, tuple[str, int]]:
    """{tensor name: (storage key, storage bytes)} from the pickle, the archive's first record."""
    name_len, extra_len = struct.unpack_from("<HH", view, 26)
    state = _Skeleton(io.BytesIO(view[30 + name_len + extra_len:])).load()
    return {str(name): value for name, value in state.items()}


def cut_short(path: Path) -> Optional[str]:
    """When a torch.save file holds fewer bytes than its own records need: which record (and tensor)
    is the first one lost, else None. Reads the zip directory, or walks the records of a file that
    lost it; never reads tensor data."""
    size = path.stat().st_size
    if size < 30:
        return f"it has only {size} bytes" if size else "it is empty"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        if view[:4] != _LOCAL_HEADER:
            return None  # not a zip: the legacy format, or garbage (the load says which)
        name_len = struct.unpack_from("<H", view, 26)[0]
        pickle_name = bytes(view[30:30 + name_len]).decode(errors="replace")
        archive = pickle_name.rsplit("/", 1)[0]
        try:
            stored = _pickled(view)
        except Exception:  # noqa: BLE001 - the pickle itself is cut or damaged: the load says so
            return None
        lost = _first_lost(path, view, archive, {key: n for key, n in stored.values()}, size)
        if lost is None:
            directory = zipfile.is_zipfile(path)
    if lost is None:
        return None if directory else (f"it has {size} bytes: every tensor's bytes are there, but the zip "
                                       "directory torch.save writes last is cut off")
    key, end = lost
    names = ", ".join(name for name, (k, _) in stored.items() if k == key) or f"storage {key}"
    return f"it has {size} bytes, but the bytes of {names} (record {archive}/data/{key}) end at byte {end}"


def _first_lost(path: Path, view, archive: str, sizes: dict[str, int], size: int) -> Optional[tuple[str, int]]:
    """(storage key, end) of the first record that ends past the file's end."""
    if zipfile.is_zipfile(path):  # the directory is there: record extents from it
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                head = info.header_offset
                if head + 30 > size:
                    return info.filename.rsplit("/", 1)[-1], head + 30
                name_len, extra_len = struct.unpack_from("<HH", view, head + 26)
                end = head + 30 + name_len + extra_len + info.compress_size
                if end > size and "/data/" in info.filename:
                    return info.filename.rsplit("/", 1)[-1], end
        return None
    pos = 0
    for key in sorted(sizes, key=lambda k: int(k) if k.isdigit() else k):
        name = f"{archive}/data/{key}".encode()
        head = view.find(name, pos) - 30  # its local header, just past the previous record
        if head < 0:
            return key, pos + 30 + len(name) + sizes[key]  # its header is gone too
        name_len, extra_len = struct.unpack_from("<HH", view, head + 26)
        end = head + 30 + name_len + extra_len + sizes[key]
        if end > size:
            return key, end
        pos = end
    return None
