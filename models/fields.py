"""The type check of a model file's fields (Meta's params.json, hybridpar.json, Hugging Face's
config.json): one JSON type per field, and an error that names the field, the type it needs and
the value it holds. Every rank reads the same file, so the error is marked as every rank's (the
command line prints it once)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from hybridpar.mesh.ranks import mark_every_rank

_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
             list: "a list"}


def json_text(value: Any) -> str:
    """A JSON value as an error shows it: the string "256", the number 2.5, true, null, a list [1]."""
    text = json.dumps(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if isinstance(value, bool) or value is None:
        return text
    kind = {str: "the string", list: "a list", dict: "an object"}.get(type(value), "the number")
    return f"{kind} {text}"


def is_json_kind(value: Any, kind: type) -> bool:
    """Is `value` (as json.loads gives it) of JSON type `kind`? An integer is a number too; true and
    false are never numbers (they are ints to Python, not to a model file)."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def check_field(where: Any, name: str, value: Any, kind: type, *, nullable: bool = False,
                error: type[Exception] = ValueError) -> Any:
    """`value`, when it is of `kind` (or null and `nullable`); else raise `error` naming the field."""
    if (value is None and nullable) or (value is not None and is_json_kind(value, kind)):
        return value
    expected = _EXPECTED[kind] + (" or null" if nullable else "")
    raise mark_every_rank(error(f'{where}: "{name}" must be {expected}, got {json_text(value)}'))


def read_json_object(path: Union[str, Path], error: type[Exception], hint: str) -> dict[str, Any]:
    """The JSON object file `path` holds; else raise `error` saying what is wrong, then `hint`."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise mark_every_rank(error(f"{path} is not readable JSON ({err}); {hint}")) from err
    if not isinstance(value, dict):
        raise mark_every_rank(error(f"{path} holds a {type(value).__name__}, not a JSON object"))
    return value
