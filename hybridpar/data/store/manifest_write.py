"""The manifest of a token store (hybridpar.data.store), written last, once every unit of its plan
is done (unit_build.unit_record), by whoever finds them all done, or by `hybridpar prepare --merge`:
the store is complete once it is there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from hybridpar.data.store.token_store import FORMAT, MANIFEST, VERSION, StoreError
from hybridpar.data.store.unit_build import unit_record
from hybridpar.data.store.unit_plan import Plan
from hybridpar.data.streams import DataFormatError
from hybridpar.data.tokenise import PART_NAMES
from hybridpar.files import file_lock, write_text_atomic
from hybridpar.progress import note

_MANIFEST_WAIT = 600.0  # seconds to wait for another process writing the manifest (seconds, even for a large store)


def finish_store(plan: Plan, name: str) -> tuple[bool, Optional[dict]]:
    """(whether the store of `plan` is complete, the manifest if this process wrote it): written
    here once every unit is done and nobody wrote it yet. `name` names the input in messages."""
    if (plan.folder / MANIFEST).is_file():
        return True, None
    if any(unit_record(plan, i) is None for i in range(len(plan.units))):
        return False, None  # other parts are still to come
    return True, write_manifest(plan, name)


def write_manifest(plan: Plan, name: str) -> Optional[dict]:
    """Once every unit of `plan` is done, its store's manifest (the store is complete): the
    manifest written here, or None where another process wrote it first. Refuses naming the units
    still missing. `name` names the input in messages."""
    folder = plan.folder
    if (folder / MANIFEST).is_file():  # complete: no lock to take (a complete store holds none)
        return None
    with file_lock(folder / (MANIFEST + ".lock"), timeout=_MANIFEST_WAIT, purpose="writing the manifest"):
        if (folder / MANIFEST).is_file():
            return None
        records = [unit_record(plan, i) for i in range(len(plan.units))]
        missing = [i for i, r in enumerate(records) if r is None]
        if missing:
            shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise StoreError(f"{folder}: {len(missing)} of {len(records)} units are not prepared yet (units {shown}): "
                             "run the parts that hold them (hybridpar prepare ... --part I/N) until each finishes")
        _check_sources(plan.data)
        manifest = _manifest(plan.data, records, name)
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def report_skipped(manifest: dict) -> None:
    """One line per source file whose bad records were skipped (data.on_bad_record = "skip")."""
    for f in manifest["files"]:
        if f["skipped"]:
            note(f"{f['path']}: {f['skipped']:,} bad records skipped of {f['skipped'] + f['documents']:,} "
                 f"(the first: {f.get('first_bad') or 'unknown'})")


def skipped_records(manifest: dict) -> int:
    """The bad records a store's preparation skipped, in all."""
    return sum(f.get("skipped", 0) for f in manifest["files"])


def _check_bad_records(data: dict, files: list[dict]) -> None:
    """Each source file's skipped records within data.max_bad_records (a share of its records below
    1, else a number): over it, a wrong format or a wrong text field is likelier than bad records."""
    cap = data.get("max_bad_records")
    for f in files if cap is not None else ():
        records = f["skipped"] + f["documents"]
        if f["skipped"] > (cap if cap >= 1 else cap * records):
            allowed = f"{cap:g} of a file's records" if cap < 1 else f"{cap:g} a file"
            raise DataFormatError(f"{f.get('path') or 'the embedded corpus'}: {f['skipped']:,} of {records:,} records "
                                  f"are bad, over data.max_bad_records = {allowed} (the first: {f['first_bad']}); "
                                  f"fix the file, or raise the cap (hybridpar prepare --max-bad-records) to skip them")


def _check_sources(data: dict) -> None:
    """The input must not have changed while the store was made: sizes and mtimes as planned."""
    for described in data["sources"]["files"]:
        if not described.get("path"):
            continue
        path = Path(described["path"])
        st = path.stat() if path.exists() else None
        if st is None or st.st_size != described["size"] or st.st_mtime_ns != described["mtime_ns"]:
            raise StoreError(f"{path} changed while the store was being prepared: delete the store folder and "
                             "prepare it again")


def _manifest(data: dict, records: list[dict], name: str) -> dict:
    files = [{**f, "documents": 0, "tokens": 0, "skipped": 0, "first_bad": ""} for f in data["sources"]["files"]]
    parts = {part: {"tokens": 0, "documents": 0, "shards": []} for part in PART_NAMES[: 2 if data["val_fraction"] else 1]}
    for record in records:
        described = files[record["file"]]
        described["documents"] += sum(record["documents"])
        described["tokens"] += sum(record["tokens"])
        described["skipped"] += record["skipped"]
        described["first_bad"] = described["first_bad"] or record.get("first_bad", "")
        for p, part in enumerate(parts):
            parts[part]["tokens"] += record["tokens"][p]
            parts[part]["documents"] += record["documents"][p]
        for shard in record["shards"]:
            parts[shard["part"]]["shards"].append({k: shard[k] for k in ("name", "tokens", "size", "chunks_crc32c")})
    _check_bad_records(data, files)
    if sum(p["tokens"] for p in parts.values()) == 0:
        raise DataFormatError(f"no tokens: the data source {name} holds no text")
    total = sum(p["documents"] for p in parts.values())
    for part, p in parts.items():
        if data["val_fraction"] and p["tokens"] == 0:
            change = "raise it, or name a held-out data.val_source" if part == "validation" else "lower it"
            raise DataFormatError(f"data.val_fraction = {data['val_fraction']} put {'none' if part == 'validation' else 'all'} "
                             f"of the {total} documents of {name} in validation: {change}")
    return {"format": FORMAT, "version": VERSION, "plan": data["key"],
            **{k: data[k] for k in ("dtype", "vocab_size", "eos_id", "tokenizer_sha256", "tokenizer_path",
                                    "text_field", "val_fraction", "on_bad_record")},
            "files": files, "parts": parts}
