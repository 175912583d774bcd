"""The floating-point dtypes hybridpar accepts by name: torch's name (also Hugging Face's
`torch_dtype`) or its short alias, as config values, `hybridpar plan` and `hybridpar generate` take them."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DType:
    name: str  # torch's name, the canonical one
    alias: str
    torch: torch.dtype

    @property
    def bytes(self) -> int:
        return self.torch.itemsize


TABLE = (
    DType("float32", "fp32", torch.float32),
    DType("bfloat16", "bf16", torch.bfloat16),
    DType("float16", "fp16", torch.float16),
)
BY_NAME = {name: d for d in TABLE for name in (d.name, d.alias)}  # names and aliases
TORCH_DTYPES = {name: d.torch for name, d in BY_NAME.items()}  # names and aliases -> torch dtypes
CANONICAL_NAMES = {d.torch: d.name for d in TABLE}  # torch dtype -> torch's name for it
NAMES = tuple(d.name for d in TABLE)
ALIASES = tuple(sorted(d.alias for d in TABLE))


def parse(name: str) -> DType:
    """The dtype a name or alias stands for; ValueError naming the valid ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(BY_NAME)}") from None


def dtype_bytes(name: str) -> int:
    return parse(name).bytes
