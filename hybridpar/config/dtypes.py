"""The floating-point dtypes hybridpar accepts by name: torch's names only (also Hugging Face's
`torch_dtype`), in config values, `hybridpar plan` and `hybridpar generate`. A short alias (`bf16`)
is refused with the right spelling: one vocabulary everywhere.

torch is imported on first use of a torch dtype, so the command line's parser (and `--help`) and
the config checks run without it."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DType:
    name: str  # torch's name, the only accepted spelling
    alias: str  # recognised only to say which name to write instead
    bytes: int

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.name)


TABLE = (
    DType("float32", "fp32", 4),
    DType("bfloat16", "bf16", 2),
    DType("float16", "fp16", 2),
)
BY_NAME = {d.name: d for d in TABLE}
NAMES = tuple(d.name for d in TABLE)
_BY_ALIAS = {d.alias: d for d in TABLE}


def __getattr__(name: str) -> Any:
    # The torch-valued tables, built when first asked for (and kept: `is` holds between uses).
    if name == "TORCH_DTYPES":  # torch's name -> torch dtype
        value = {d.name: d.torch for d in TABLE}
    elif name == "CANONICAL_NAMES":  # torch dtype -> torch's name for it
        value = {d.torch: d.name for d in TABLE}
    else:
        raise AttributeError(f"module 'hybridpar.config.dtypes' has no attribute {name!r}")
    globals()[name] = value
    return value


def check(name: str, where: str) -> str:
    """`name` if it is one of torch's dtype names, else ValueError naming `where` (a config key or a
    flag) and the spelling to write."""
    if name in BY_NAME:
        return name
    if name in _BY_ALIAS:
        raise ValueError(f"{where}: write {_BY_ALIAS[name].name!r} (torch's name) instead of {name!r}")
    raise ValueError(f"{where}: unknown dtype {name!r}; choose one of {', '.join(NAMES)}")


def parse(name: str, where: str = "dtype") -> DType:
    """The dtype torch's `name` stands for; ValueError naming `where` and the valid names."""
    return BY_NAME[check(name, where)]


def dtype_bytes(name: str) -> int:
    return parse(name).bytes
