"""The plan of a token store: its source files cut into units (formats.plan_units), which fixes the
store's token order, written to the store folder's plan.json; and the share of it a --part takes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hybridpar.data.formats import BAD_RECORD_CHOICES, UNIT_BYTES, Unit, plan_units
from hybridpar.data.sources import Source, describe_sources, resolve_sources
from hybridpar.data.store import FORMAT, MANIFEST, PLAN, VERSION, StoreError
from hybridpar.data.tokenise import token_dtype
from hybridpar.files import PathLike, sha256_text, write_text_atomic


@dataclasses.dataclass(frozen=True)
class Plan:
    folder: Path
    data: dict  # plan.json
    units: tuple[Unit, ...]

    @property
    def key(self) -> str:
        return self.data["key"]


def make_plan(source: Source, tokenizer, out: PathLike, *, text_field: str = "text", val_fraction: float = 0.0,
              on_bad_record: str = "error", unit_bytes: int = UNIT_BYTES) -> Plan:
    """The plan of a store of `source` tokenised by `tokenizer` in folder `out`, written to plan.json
    (or checked against the one there: a store folder holds one store)."""
    if on_bad_record not in BAD_RECORD_CHOICES:
        raise ValueError(f"data.on_bad_record must be one of {', '.join(BAD_RECORD_CHOICES)}, got {on_bad_record!r}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"the validation fraction must be in [0, 1), got {val_fraction}")
    eos_id, vocab_size = int(tokenizer.eos_id), int(tokenizer.vocab_size)
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"the tokenizer has no usable eos piece (eos_id {eos_id}); documents need one between them")
    files = resolve_sources(source)
    units = plan_units(files, text_field, unit_bytes)
    data = {"format": FORMAT + "-plan", "version": VERSION, "sources": describe_sources(files, text_field),
            "tokenizer_sha256": tokenizer.sha256, "tokenizer_path": str(getattr(tokenizer, "path", "")),
            "vocab_size": vocab_size, "eos_id": eos_id, "dtype": token_dtype(vocab_size).name,
            "text_field": text_field, "val_fraction": val_fraction, "on_bad_record": on_bad_record,
            "units": [{"file": files.index(u.file), "start": u.start, "stop": u.stop, "bytes": u.nbytes} for u in units]}
    data["key"] = sha256_text(json.dumps(data, sort_keys=True))[:16]
    folder = Path(out)
    existing = folder / PLAN
    other = json.loads(existing.read_text()) if existing.is_file() else {}
    if other.get("key") != data["key"]:
        if (folder / MANIFEST).is_file():  # a complete store is never replaced
            differs = [k for k in ("sources", "tokenizer_sha256", "text_field", "val_fraction", "on_bad_record")
                       if other.get(k) != data[k]] or ["the units"]
            raise StoreError(f"{folder} holds a store of other input ({', '.join(differs)} differ): give another "
                             f"--out, or delete {folder} to prepare it anew")
        # Nothing there, or an unfinished store of other input: its unit records name the old plan and
        # are not reused.
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(existing, json.dumps(data, indent=1) + "\n")
    return Plan(folder, data, tuple(units))


def part_of(plan: Plan, part: int, parts: int) -> list[int]:
    """The units of part `part` of `parts`: the largest first to the part with the least input so far."""
    if not 0 <= part < parts:
        raise ValueError(f"--part {part}/{parts}: the part must be in 0..{parts - 1}")
    loads, mine = [0] * parts, []
    for i in sorted(range(len(plan.units)), key=lambda i: (-plan.units[i].nbytes, i)):
        target = loads.index(min(loads))
        loads[target] += plan.units[i].nbytes
        if target == part:
            mine.append(i)
    return sorted(mine)
