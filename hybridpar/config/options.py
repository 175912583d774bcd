"""Config fields that document themselves: `option(default, "what it does")` is a dataclass field whose
one-line description `hybridpar train --help` prints with its key, type and default (config.describe)."""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A mistake in the config: one line naming the key and what to change."""

    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def option(default: Any, help: str) -> Any:
    """A dataclass field with `default` (`list`: an empty list each) and a one-line description."""
    if default is list:
        return dataclasses.field(default_factory=list, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def description(field: dataclasses.Field) -> str:
    return field.metadata.get("help", "")
