"""Config fields that document themselves: `option(default, "what it does")` is a dataclass field whose
one-line description `hybridpar train --help` prints with its key, type and default (config.describe);
and the parsing of a value given as text (parse_pp_layers)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any


class ConfigError(ValueError):
    """A mistake in the config: one line naming the key and what to change."""

    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def importable(package: str) -> bool:
    """Whether `package` can be imported, found without importing it (a broken or blocked installation
    counts as missing)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def option(default: Any, help: str) -> Any:
    """A dataclass field with `default` (`list`: an empty list each; a list: a copy of it each) and a
    one-line description."""
    if default is list or isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default) if default is not list else [],
                                 metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def description(field: dataclasses.Field) -> str:
    return field.metadata.get("help", "")


def parse_pp_layers(value) -> list[int]:
    """parallel.pp_layers as a list of ints: a TOML list, or a command line's "4,4,3" (or "[4, 4, 3]")."""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").strip("[]").split(",") if v]
    try:
        layers = [int(v) for v in value]
    except (TypeError, ValueError):
        layers = None
    if layers is None or any(isinstance(v, bool) for v in value) or any(n < 0 for n in layers):
        raise ConfigError(f"parallel.pp_layers must list each stage's transformer layers (integers >= 0, e.g. "
                          f"[4, 4, 3] or \"4,4,3\"), got {value!r}")
    return layers
