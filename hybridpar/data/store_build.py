"""Making a token store (hybridpar.data.store) from corpus files, on every core and every node.

The plan (store_plan) fixes the store's token order; this module makes one unit of it, and the
manifest once every unit is done; store_prepare runs the whole preparation. Whoever prepares
takes units one at a time, each under a lock of its own in the store folder, so any number of processes can work on one store at once: the workers of `hybridpar prepare`, the
parts of a Slurm array (`--part I/N` takes a fixed share), the ranks of a training job. A unit is
done when its record is written, after its shards; a process killed at any moment leaves at most
unfinished units, which the next run redoes, and a lock the kernel releases with its holder. The
manifest is written last, by whoever finds every unit done (or by `--merge`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Optional

import numpy as np

from hybridpar.data.formats import Tally, Unit, unit_documents
from hybridpar.data.shards import ShardWriter, shard_written
from hybridpar.data.sources import SourceFile, source_name
from hybridpar.data.store import FORMAT, MANIFEST, PLAN, VERSION, StoreError, TokenStore, unit_record_name
from hybridpar.data.store_plan import Plan, preparing, read_plan
from hybridpar.data.tokenise import PART_NAMES, pieces, token_batches
from hybridpar.files import PathLike, file_lock, write_text_atomic

_MANIFEST_WAIT = 600.0  # seconds to wait for another process writing the manifest (seconds, even for a large store)


# --- one unit ------------------------------------------------------------------------------------

def _record(plan: Plan, index: int) -> Optional[dict]:
    """Unit `index`'s record if the unit is done (its shards there, at their sizes), else None."""
    path = plan.folder / unit_record_name(index)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("plan") != plan.key:
        return None
    return record if all(shard_written(plan.folder, shard) for shard in record["shards"]) else None


def build_unit(plan: Plan, index: int, tokenizer, on_bytes=None, on_tokens=None) -> dict:
    """Tokenise unit `index` into its shards, then write its record (the unit is done). Its record.
    `on_bytes(n)` hears of input read, `on_tokens(n)` of each batch of tokens made."""
    data, unit = plan.data, plan.units[index]
    dtype, vocab_size = np.dtype(data["dtype"]), data["vocab_size"]
    tally = Tally()
    writers = [ShardWriter(plan.folder, index, part) for part in range(2 if data["val_fraction"] else 1)]
    tokens, documents = [0] * len(writers), [0] * len(writers)
    try:
        documents_in = unit_documents(unit, data["text_field"], data["on_bad_record"], tally, on_bytes,
                                      data["max_document_bytes"])
        for batch in token_batches(pieces(documents_in, data["val_fraction"]), tokenizer):
            for part, (ids, ended) in batch.items():
                if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
                    raise ValueError(f"the tokenizer produced id {bad}, outside its vocab of {vocab_size}")
                writers[part].write(ids.astype(dtype))
                tokens[part] += int(ids.size)
                documents[part] += ended
                if on_tokens is not None:
                    on_tokens(int(ids.size))
    except BaseException as err:
        for writer in writers:
            writer.finish(err)
        raise
    record = {"plan": plan.key, "unit": index, "file": data["units"][index]["file"], "tokens": tokens,
              "documents": documents, "skipped": tally.skipped,
              "shards": [s for w in writers for s in w.finish()]}
    write_text_atomic(plan.folder / unit_record_name(index), json.dumps(record) + "\n")
    return record


def _claim_and_build(plan: Plan, index: int, tokenizer, on_bytes=None, on_tokens=None) -> Optional[dict]:
    """Build unit `index` unless it is done or another process holds it: its record, or None."""
    lock = plan.folder / (unit_record_name(index) + ".lock")
    try:
        with file_lock(lock, timeout=0, purpose="preparing a unit"):
            if (record := _record(plan, index)) is not None:
                return record
            # who holds it, for a process that waits for it (the flock is on the file, not its text)
            lock.write_text(f"{socket.gethostname()} pid {os.getpid()}\n")
            return build_unit(plan, index, tokenizer, on_bytes, on_tokens)
    except TimeoutError:
        return None


def unit_holder(plan: Plan, index: int) -> str:
    """'host pid N' of the process that last took unit `index`, or '' (unknown)."""
    try:
        return (plan.folder / (unit_record_name(index) + ".lock")).read_text().strip()
    except OSError:
        return ""


def merge_store(out: PathLike) -> TokenStore:
    """Write the manifest of store `out` once every unit is done (any process may call it; the
    first writes it). Refuses naming the units still missing."""
    folder = Path(out)
    if (folder / MANIFEST).is_file():
        return TokenStore(folder)
    data = read_plan(folder)
    if data is None:
        raise StoreError(f"{folder} is not a token store being prepared (no {PLAN}): run hybridpar prepare first")
    files = [SourceFile(f["kind"], Path(f["path"]) if f.get("path") else None) for f in data["sources"]["files"]]
    plan = Plan(folder, data, tuple(Unit(files[u["file"]], u["start"], u["stop"], u["bytes"]) for u in data["units"]))
    with preparing(plan), file_lock(folder / (MANIFEST + ".lock"), timeout=_MANIFEST_WAIT,
                                    purpose="writing the manifest"):
        if (folder / MANIFEST).is_file():
            return TokenStore(folder)
        records = [_record(plan, i) for i in range(len(plan.units))]
        missing = [i for i, r in enumerate(records) if r is None]
        if missing:
            shown = ", ".join(str(i) for i in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise StoreError(f"{folder}: {len(missing)} of {len(records)} units are not prepared yet (units {shown}): "
                             "run the parts that hold them (hybridpar prepare ... --part I/N) until each finishes")
        _check_sources(data, files)
        manifest = _manifest(data, records, source_name(files))
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return TokenStore(folder)


def report_skipped(store: TokenStore) -> None:
    """One line per source file whose bad records were skipped (data.on_bad_record = "skip")."""
    from hybridpar.progress import note

    for f in store.meta["files"]:
        if f["skipped"]:
            note(f"{f['path']}: {f['skipped']:,} bad records skipped (no text, not a string, or over "
                 f"data.max_document_bytes) of "
                 f"{f['skipped'] + f['documents']:,}")


def _check_sources(data: dict, files: list[SourceFile]) -> None:
    """The input must not have changed while the store was made: sizes and mtimes as planned."""
    for described, f in zip(data["sources"]["files"], files):
        if f.path is None:
            continue
        st = f.path.stat() if f.path.exists() else None
        if st is None or st.st_size != described["size"] or st.st_mtime_ns != described["mtime_ns"]:
            raise StoreError(f"{f.path} changed while the store was being prepared: delete the store folder and "
                             "prepare it again")


def _manifest(data: dict, records: list[dict], name: str) -> dict:
    files = [{**f, "documents": 0, "tokens": 0, "skipped": 0} for f in data["sources"]["files"]]
    parts = {part: {"tokens": 0, "documents": 0, "shards": []} for part in PART_NAMES[: 2 if data["val_fraction"] else 1]}
    for record in records:
        described = files[record["file"]]
        described["documents"] += sum(record["documents"])
        described["tokens"] += sum(record["tokens"])
        described["skipped"] += record["skipped"]
        for p, part in enumerate(parts):
            parts[part]["tokens"] += record["tokens"][p]
            parts[part]["documents"] += record["documents"][p]
        for shard in record["shards"]:
            parts[shard["part"]]["shards"].append({k: shard[k] for k in ("name", "tokens", "size", "chunks_crc32c")})
    if sum(p["tokens"] for p in parts.values()) == 0:
        raise StoreError(f"no tokens: the data source {name} holds no text")
    total = sum(p["documents"] for p in parts.values())
    for part, p in parts.items():
        if data["val_fraction"] and p["tokens"] == 0:
            change = "raise it, or name a held-out data.val_source" if part == "validation" else "lower it"
            raise StoreError(f"data.val_fraction = {data['val_fraction']} put {'none' if part == 'validation' else 'all'} "
                             f"of the {total} documents of {name} in validation: {change}")
    return {"format": FORMAT, "version": VERSION, "plan": data["key"],
            **{k: data[k] for k in ("dtype", "vocab_size", "eos_id", "tokenizer_sha256", "tokenizer_path",
                                    "text_field", "val_fraction", "on_bad_record")},
            "files": files, "parts": parts}
