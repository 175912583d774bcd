"""Making one unit of a token store (hybridpar.data.store) from corpus files, on every core and every node.

The plan (unit_plan) fixes the store's token order; this module makes one unit of it;
workers runs the units of a share, manifest_write writes the manifest once every unit is done,
and prepare drives the whole preparation. Whoever prepares takes units one at a time,
each under a lock of its own in the store folder, so any number of processes can work on one
store at once: the workers of `hybridpar prepare`, the parts of a Slurm array (`--part I/N`
takes a fixed share), the ranks of a training job. A unit is done when its record is written,
after its shards; a process killed at any moment leaves at most unfinished units, which the next
run redoes, and a lock the kernel releases with its holder.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Optional

import numpy as np

from hybridpar.data.formats import Tally, unit_documents
from hybridpar.data.shards import ShardWriter, shard_written
from hybridpar.data.store.token_store import unit_record_name
from hybridpar.data.store.unit_plan import Plan
from hybridpar.data.tokenise import pieces, token_batches
from hybridpar.files import file_lock, write_text_atomic


# --- one unit ------------------------------------------------------------------------------------

def unit_record(plan: Plan, index: int) -> Optional[dict]:
    """Unit `index`'s record if the unit is done (its shards there, at their sizes), else None."""
    record = written_record(plan, index)
    if record is None:
        return None
    return record if all(shard_written(plan.folder, shard) for shard in record["shards"]) else None


def written_record(plan: Plan, index: int) -> Optional[dict]:
    """Unit `index`'s record as written for `plan` (whatever became of its shards since), else None."""
    try:
        record = json.loads((plan.folder / unit_record_name(index)).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("plan") == plan.key else None


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
              "documents": documents, "skipped": tally.skipped, "first_bad": tally.first_bad,
              "shards": [s for w in writers for s in w.finish()]}
    write_text_atomic(plan.folder / unit_record_name(index), json.dumps(record) + "\n")
    return record


def claim_and_build(plan: Plan, index: int, tokenizer, on_bytes=None, on_tokens=None) -> Optional[dict]:
    """Build unit `index` unless it is done or another process holds it: its record, or None."""
    lock = plan.folder / (unit_record_name(index) + ".lock")
    try:
        with file_lock(lock, timeout=0, purpose="preparing a unit"):
            if (record := unit_record(plan, index)) is not None:
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
