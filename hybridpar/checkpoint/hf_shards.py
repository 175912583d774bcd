"""A Hugging Face folder's weights in shards, as transformers' save_pretrained lays them out.

Planning needs only names, shapes and a dtype, so every rank computes the same plan from the
model's ModelArgs without talking: tensors are taken in order and a shard is closed when the next
tensor would take it past max_shard_size (huggingface_hub's split_torch_state_dict_into_shards,
which save_pretrained calls: no reordering, and a tensor larger than the limit alone gets a shard
of its own, placed before the shard being filled). Names: `model.safetensors` when one shard
holds everything (no index then), else `model-00001-of-0000N.safetensors` and
`model.safetensors.index.json` = {"metadata": {"total_size": bytes of the tensors,
"total_parameters": their element count}, "weight_map": {name: file}}, keys sorted.

API: parse_shard_size, ShardPlan, plan_shards, write_shard, write_index.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch

from ..files import atomic_path, write_text_atomic

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# transformers' units are decimal (5GB = 5 * 10^9 bytes); the binary ones are accepted too.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
SIZE_FORMS = "a byte count (5000000000) or a number with KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB"


def parse_shard_size(value: Union[int, str], where: str = "max_shard_size") -> int:
    """Bytes from 5GB, 500MB, 2GiB, 1.5GB or a byte count; ValueError naming `where` and the forms."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"{where} {value}: not a size; write {SIZE_FORMS}, e.g. 5GB")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{where} {value}: a shard needs at least one byte; write {SIZE_FORMS}, e.g. 5GB")
    return size


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """files[j]: the names shard j holds, in writing order; names: every name in gathering order."""

    files: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]
    nbytes: Mapping[str, int]
    numel: Mapping[str, int]

    @property
    def file_names(self) -> list[str]:
        n = len(self.files)
        return [WEIGHTS_FILE] if n == 1 else [f"model-{j + 1:05d}-of-{n:05d}.safetensors" for j in range(n)]

    def file_of(self) -> dict[str, int]:
        return {name: j for j, names in enumerate(self.files) for name in names}

    def last_of(self, j: int) -> str:
        """The name (in gathering order) after which shard j has every tensor."""
        position = {name: i for i, name in enumerate(self.names)}
        return max(self.files[j], key=position.__getitem__)

    def index(self) -> Optional[dict]:
        """model.safetensors.index.json's content; None for a single file (transformers writes none)."""
        if len(self.files) == 1:
            return None
        names = self.file_names
        weight_map = {name: names[j] for name, j in sorted(self.file_of().items())}
        return {"metadata": {"total_parameters": sum(self.numel.values()), "total_size": sum(self.nbytes.values())},
                "weight_map": weight_map}


def plan_shards(shapes: Sequence[tuple[str, Sequence[int]]], dtype: torch.dtype, max_bytes: int) -> ShardPlan:
    """Shards of at most max_bytes (a larger tensor alone: its own) for (name, shape) in order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = {name: math.prod(shape) for name, shape in shapes}
    nbytes = {name: n * itemsize for name, n in numel.items()}
    files, current, size = [], [], 0
    for name, _ in shapes:
        if nbytes[name] > max_bytes:
            files.append([name])
            continue
        if current and size + nbytes[name] > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes[name]
    if current or not files:
        files.append(current)
    return ShardPlan(tuple(tuple(f) for f in files), tuple(name for name, _ in shapes), nbytes, numel)


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """One safetensors file, durably (fsynced by its writer, which may be on another host) and under
    its final name only once complete."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(dict(tensors), str(tmp), metadata={"format": "pt"})


def write_index(folder: Path, plan: ShardPlan) -> None:
    """The index, if the plan has several shards (as transformers writes it: indent 2, keys sorted)."""
    index = plan.index()
    if index is not None:
        write_text_atomic(folder / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
