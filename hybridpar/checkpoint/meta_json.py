"""Reading a Meta checkpoint folder's params.json and hybridpar.json, each checked field by field
(the format: hybridpar.checkpoint.meta; the reader that uses these: meta_read)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from models.llama import ModelArgs

from .meta import (_FLOAT_FIELDS, _INT_FIELDS, PARAMS_JSON, REQUIRED_FIELDS, SIDECAR_FIELDS, SIDECAR_JSON,
                   MetaCheckpointError)

# Every field a params.json or hybridpar.json may hold with a type to check, and those that may be null.
_TYPES: dict[str, type] = {**{f: int for f in _INT_FIELDS}, **{f: float for f in _FLOAT_FIELDS},
                           "use_scaled_rope": bool, "ffn_hidden_size": int, **SIDECAR_FIELDS}
_NULLABLE = ("n_kv_heads", "ffn_dim_multiplier", "ffn_hidden_size")


def _read_object(path: Path) -> dict[str, Any]:
    try:
        fields = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MetaCheckpointError(f"{path} is not readable JSON ({err}); restore it from the original checkpoint") from err
    if not isinstance(fields, dict):
        raise MetaCheckpointError(f"{path} holds a {type(fields).__name__}, not a JSON object of model fields")
    return fields


def _check_types(path: Path, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        if value is None and name in _NULLABLE:
            continue
        kind = _TYPES.get(name)
        if kind is bool:
            wrong = not isinstance(value, bool)
        elif kind is not None:  # a bool is an int to Python, never to a params.json
            wrong = isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int)
        else:
            wrong = name == "embedding_split" and value not in ("auto", "dim", "vocab")
        if wrong:
            expected = {bool: "true or false", int: "an integer", float: "a number"}.get(kind, "auto, dim or vocab")
            raise MetaCheckpointError(f"{path}: field {name!r} is {value!r}; it must be {expected}: correct it")


def read_params(folder: Path) -> dict[str, Any]:
    """params.json's fields: known to ModelArgs, Meta's required ones present, each of its type."""
    path = folder / PARAMS_JSON
    if not path.is_file():
        raise MetaCheckpointError(
            f"{path} does not exist: a Meta checkpoint folder needs params.json next to its "
            "consolidated.NN.pth files; point at the folder that holds both"
        )
    params = _read_object(path)
    known = [f.name for f in dataclasses.fields(ModelArgs)]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise MetaCheckpointError(
            f"{path}: unknown field(s) {unknown}; the fields Meta's format and hybridpar know are {known}. "
            "Remove the unknown ones (or fix their spelling)"
        )
    missing = [f for f in REQUIRED_FIELDS if f not in params]
    if missing:
        raise MetaCheckpointError(
            f"{path}: required field(s) {missing} missing; Meta's params.json always has {list(REQUIRED_FIELDS)}. "
            "Add them with the values the checkpoint was trained with"
        )
    _check_types(path, params)
    return params


def read_sidecar(folder: Path, params: dict[str, Any]) -> dict[str, Any]:
    """hybridpar.json's fields ({} without the file): only SIDECAR_FIELDS, each of its type, none
    that params.json sets too."""
    path = folder / SIDECAR_JSON
    if not path.exists():
        return {}
    fields = _read_object(path)
    unknown = sorted(set(fields) - set(SIDECAR_FIELDS))
    if unknown:
        raise MetaCheckpointError(
            f"{path}: unknown field(s) {unknown}; {SIDECAR_JSON} holds only {list(SIDECAR_FIELDS)} (what Meta's "
            f"{PARAMS_JSON} cannot state). Remove the unknown ones (or fix their spelling)"
        )
    both = sorted(set(fields) & set(params))
    if both:
        raise MetaCheckpointError(
            f"{path} and {PARAMS_JSON} both set {both}: remove them from {PARAMS_JSON} (Meta's code refuses them there)"
        )
    _check_types(path, fields)
    return fields
