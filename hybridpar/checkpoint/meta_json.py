"""Reading a Meta checkpoint folder's params.json and hybridpar.json, each checked field by field
(the format: hybridpar.checkpoint.meta; the reader that uses these: meta_read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridpar.models.args import check_fields, field_types
from hybridpar.models.fields import check_field, read_json_object

from .meta import PARAMS_JSON, SIDECAR_FIELDS, SIDECAR_JSON, MetaCheckpointError


def _read_object(path: Path) -> dict[str, Any]:
    return read_json_object(path, MetaCheckpointError, "restore it from the original checkpoint")


def read_params(folder: Path) -> dict[str, Any]:
    """params.json's fields: known to ModelArgs, the shape's present, each of its type (check_fields)."""
    path = folder / PARAMS_JSON
    if not path.is_file():
        raise MetaCheckpointError(
            f"{path} does not exist: a Meta checkpoint folder needs params.json next to its "
            "consolidated.NN.pth files; point at the folder that holds both"
        )
    params = _read_object(path)
    check_fields(params, path, MetaCheckpointError)
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
    types = field_types()
    for name, value in fields.items():
        check_field(path, name, value, types[name][0], error=MetaCheckpointError)
    return fields
