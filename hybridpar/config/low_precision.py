"""The [float8] config section, without torch: float8 matmuls in the linears through torchao
(hybridpar.parallel.float8 applies it; torchao is imported only when a recipe is chosen).

    recipe           "none", or torchao's "tensorwise", "rowwise", "rowwise_with_gw_hp"
    fsdp_all_gather  FSDP2 all-gathers the weights in float8 (tensorwise only)
    skip             the linears kept in high precision, by name
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import re

from .evaluation import split_task_names
from .options import ConfigError, importable, option

RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")
MULTIPLE = 16  # a float8 matmul's dimensions (torch._scaled_mm's): a linear with another stays in high precision
TORCHAO = (0, 18)  # the oldest torchao whose float8 training functions hybridpar calls
INSTALL = "pip install 'hybridpar[float8]' (or pip install 'torchao>=0.18')"


@dataclasses.dataclass
class Float8Config:
    recipe: str = option("none", "float8 matmuls in the linears (torchao's recipes): \"none\", \"tensorwise\", "
                                 "\"rowwise\" or \"rowwise_with_gw_hp\"")
    fsdp_all_gather: bool = option(False, "with \"tensorwise\": FSDP all-gathers the weights in float8, their "
                                          "scales computed once after each optimizer step")
    # A layer whose per-rank slice has a dimension not a multiple of 16 is kept too: float8 matmuls need it.
    skip: list = option(["output"], "linears kept in high precision: names or patterns matched against a "
                                    "module's name or its end (\"output\", \"wq\", \"layers.0.*\")")

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def validate(self) -> None:
        """ConfigError naming the float8.* key; float8.skip given as "a,b" becomes a list."""
        self.skip = split_task_names(self.skip)
        if self.recipe not in RECIPES:
            raise ConfigError(f"float8.recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ConfigError(f"float8.fsdp_all_gather needs float8.recipe = \"tensorwise\" (one scale per weight), "
                              f"got {self.recipe!r}; set float8.fsdp_all_gather = false or choose \"tensorwise\"")


def names_skipped(name: str, patterns) -> bool:
    """Whether float8.skip's `patterns` name the linear `name`: a pattern matching it or its end."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p) for p in patterns)


def require_torchao() -> None:
    """ConfigError in one line, saying what to install, when torchao (>= 0.18) is not importable."""
    version = _version("torchao") if importable("torchao") else None
    if version is None:
        raise ConfigError(f"float8.recipe needs torchao, which is not installed: {INSTALL}")
    if version < TORCHAO:
        raise ConfigError(f"float8.recipe needs torchao >= {'.'.join(map(str, TORCHAO))}, and "
                          f"{'.'.join(map(str, version))} is installed: {INSTALL}")


def _version(package: str):
    """The installed version's first two numbers, (0, 18) for "0.18.0+cu128"; None when not installed."""
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else (0, 0)
