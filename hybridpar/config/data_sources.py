"""The config's data sources, torch- and data-free (checked before hybridpar.data, which resolves
them, is imported): the embedded corpus's name, `data.sources` read into tables, and the check that
two sources do not name the same data however spelled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from hybridpar.files import PathLike

from .options import ConfigError

DEFAULT_SOURCE = "default"  # the embedded corpus


class SourceNames:
    """Sources as written, each checked against those before it: the same file or folder however
    spelled (a trailing '/', './', a link, relative or absolute), or one inside another."""

    def __init__(self) -> None:
        self._named: dict = {}  # real path (or "default") -> the source as first written

    def clash(self, source: PathLike) -> Optional[tuple[str, str]]:
        """(the earlier source as written, how the two overlap) if `source` names data an earlier
        one named; else None, and `source` is remembered."""
        real = DEFAULT_SOURCE if source == DEFAULT_SOURCE else Path(source).resolve()
        if real in self._named:
            what = "embedded corpus" if real == DEFAULT_SOURCE else "folder" if real.is_dir() else "file"
            return self._named[real], f"are the same {what}" + ("" if real == DEFAULT_SOURCE else f" ({real})")
        if real != DEFAULT_SOURCE:
            inside = [(p, real) for p in real.parents if p in self._named]
            if real.is_dir():  # a folder holding an earlier source (a scan of them all: lists of folders are short)
                inside += [(real, other) for other in self._named if other != DEFAULT_SOURCE and
                           other.is_relative_to(real)]
            if inside:
                outer, inner = inside[0]
                earlier = self._named[outer if outer != real else inner]
                return earlier, f"overlap ({inner} lies inside {outer})"
        self._named[real] = str(source)
        return None


_BLEND_KEYS = ("name", "source", "weight", "text_field")


def blend_sources(value: Any) -> list[dict]:
    """data.sources as a list of {"name", "source", "weight"[, "text_field"]}, checked: TOML tables,
    or the command line's "name=path@weight,..." (or a JSON list of tables). Errors name the entry
    and what to change."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ConfigError(f"data.sources: {value!r} is not a JSON list of tables ({err})") from None
    if isinstance(value, str):
        entries = []
        for item in (part.strip() for part in value.split(",") if part.strip()):
            name, eq, rest = item.partition("=")
            path, at, weight = rest.rpartition("@")
            if not (eq and at and name.strip() and path.strip()):
                raise ConfigError(f"data.sources: {item!r} is not name=path@weight (e.g. web=/data/web@0.7)")
            entries.append({"name": name.strip(), "source": path.strip(), "weight": weight.strip()})
        value = entries
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise ConfigError("data.sources must be [[data.sources]] tables, or \"name=path@weight,...\"")
    out, names, paths = [], {}, SourceNames()  # names: each source as written -> its name
    for i, entry in enumerate(value):
        where = f"data.sources entry {i + 1}" + (f" ({entry['name']!r})" if "name" in entry else "")
        unknown = sorted(set(entry) - set(_BLEND_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key {', '.join(map(repr, unknown))}; a source has {', '.join(_BLEND_KEYS)}")
        missing = [k for k in ("name", "source", "weight") if k not in entry]
        if missing:
            raise ConfigError(f"{where}: no {', '.join(missing)}; every source needs a name, a source and a weight")
        try:
            weight = float(entry["weight"])
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: weight {entry['weight']!r} is not a number") from None
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise ConfigError(f"{where}: weight {entry['weight']!r} must be above 0 (drop the source to leave it out)")
        name, source = str(entry["name"]), str(entry["source"])
        if name in names.values():
            raise ConfigError(f"{where}: the name {name!r} is used twice; give every source its own")
        clash = paths.clash(source)
        if clash:
            raise ConfigError(f"{where}: the source {source!r} and {clash[0]!r} (source {names[clash[0]]!r}) "
                              f"{clash[1]}: list it once, with the sum of the weights")
        names[source] = name
        out.append({"name": name, "source": source, "weight": weight,
                    **({"text_field": str(entry["text_field"])} if "text_field" in entry else {})})
    return out
