"""The token store: a prepared corpus as a folder of token shards and a manifest.

    STORE/plan.json              what is being made: the source files, their units, the tokenizer
    STORE/units/000012.json      a unit done: its documents, tokens, records skipped, its shards
    STORE/units/000012.train.0.tokens   the unit's token ids (raw uint16/uint32), at most
                                 MAX_SHARD_TOKENS a file; `.validation.` with a validation split
    STORE/store.json             the manifest, written last: the store is complete iff it is there
    STORE/damaged.json           damage a job met in the store it prepared in its data cache: the
                                 next start of the job checks the store and repairs it (prepare.py)

The tokens of a store are its units' shards in plan order: the same store whatever the number of
workers or parts that made it. Each shard's size is in the manifest, and the CRC-32C of every
64 KiB chunk in a sidecar (hybridpar.data.chunks): a chunk is checked the first time a window reads
it, its tokens against the vocabulary too; `hybridpar verify` checks them all (integrity.py).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import socket
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from hybridpar.data.chunks import CHUNK_BYTES, chunk_damage, read_sums, sums_name
from hybridpar.data.tokenise import PART_NAMES
from hybridpar.files import PathLike, write_text_atomic

log = logging.getLogger(__name__)

MANIFEST = "store.json"
DAMAGED = "damaged.json"
PLAN = "plan.json"
UNITS = "units"
FORMAT = "hybridpar-token-store"
VERSION = 2  # 2: chunk checksums (hybridpar.data.chunks)
MAX_SHARD_TOKENS = 1 << 28  # 512 MB of uint16 a file


class StoreError(ValueError):
    """A store that is incomplete, damaged or made for something else, with what to do. Every rank
    of a job reads the same store and meets the same error: said once."""

    every_rank = True  # hybridpar.mesh.ranks.raised_by_every_rank


class StoreDamagedError(StoreError):
    """A shard's bytes found damaged as they were read. Only the ranks that read them meet it: the
    trainer agrees with every rank to stop (trainer._data_stop), then every rank raises it alike."""

    every_rank = False


class ManifestDamagedError(StoreError):
    """A manifest that cannot be read, or whose records disagree: `what` says how."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path} is damaged{what}; prepare the store again")
        self.what = what


def read_manifest(folder: Path) -> dict:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        hint = (f"its preparation has not finished: run the same hybridpar prepare command again (it goes on "
                f"where it stopped), or hybridpar prepare --merge --out {folder} once every part is done"
                if (folder / PLAN).is_file() else "it is not a token store")
        raise StoreError(f"{folder} has no {MANIFEST}: {hint}")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ManifestDamagedError(path, f" ({err})") from err
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{path} is not a hybridpar token store manifest")
    if manifest.get("version") != VERSION:
        raise StoreError(f"{folder} is a token store of version {manifest.get('version')}, this hybridpar reads "
                         f"version {VERSION}: prepare it again")
    check_manifest(manifest, path)
    return manifest


_SHARD_NAME = re.compile(r"units/[0-9]{6}\.(train|validation)\.[0-9]+\.tokens")  # inside the store, always


def check_manifest(manifest: dict, path: Path) -> None:
    """The manifest's fields, types and counts agree with each other and name only files inside the
    store (a shard named `../../x` or `/x` is refused, never opened); StoreError in one line."""
    def bad(what: str):
        raise ManifestDamagedError(path, f": {what}")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    parts = manifest.get("parts")
    if not isinstance(parts, dict) or "train" not in parts:
        bad("it has no \"parts\" with a train part")
    if manifest.get("dtype") not in ("uint16", "uint32"):
        bad(f"dtype {manifest.get('dtype')!r} is not uint16 or uint32")
    if not count(manifest.get("vocab_size")) or not count(manifest.get("eos_id")):
        bad("vocab_size and eos_id must be whole numbers")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for name, part in parts.items():
        if name not in PART_NAMES or not isinstance(part, dict) or not count(part.get("tokens")) \
                or not count(part.get("documents")) or not isinstance(part.get("shards"), list):
            bad(f"part {name!r} is not a part (tokens, documents, shards)")
        for shard in part["shards"]:
            if not isinstance(shard, dict) or not all(count(shard.get(k)) for k in ("tokens", "size", "chunks_crc32c")):
                bad(f"a shard of part {name!r} is not a shard record (name, tokens, size, chunks_crc32c)")
            if not isinstance(shard.get("name"), str) or not _SHARD_NAME.fullmatch(shard["name"]):
                bad(f"shard name {shard.get('name')!r} is not a shard file of this store (units/NNNNNN.PART.I.tokens)")
            if shard["size"] != shard["tokens"] * itemsize:
                bad(f"{shard['name']} records {shard['tokens']:,} tokens of {itemsize} bytes in {shard['size']:,} bytes")
        held = sum(s["tokens"] for s in part["shards"])
        if held != part["tokens"]:
            bad(f"the {name} part records {part['tokens']:,} tokens, its shards hold {held:,}")
    files = manifest.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and count(f.get("tokens")) for f in files):
        bad("\"files\" is not a list of source files with their tokens")
    if sum(f["tokens"] for f in files) != sum(p["tokens"] for p in parts.values()):
        bad(f"its source files hold {sum(f['tokens'] for f in files):,} tokens, its parts "
            f"{sum(p['tokens'] for p in parts.values()):,}")


class _Concatenated:
    """The tokens of several memory-mapped shards as one sequence: slices read across shard edges."""

    def __init__(self, shards: list[np.memmap], check: Callable[[int, int, int], None] = lambda i, lo, hi: None) -> None:
        self.shards, self.check = shards, check
        self.starts = [0]
        for s in shards:
            self.starts.append(self.starts[-1] + len(s))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a token store is read in contiguous slices")
        start, stop, _ = index.indices(len(self))
        parts = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop and i < len(self.shards):
            lo = start - self.starts[i]
            hi = min(stop, self.starts[i + 1]) - self.starts[i]
            self.check(i, lo, hi)
            parts.append(self.shards[i][lo:hi])
            start = self.starts[i] + hi
            i += 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.shards[0].dtype if self.shards else np.uint16)


class TokenStore:
    """A complete store's tokens of one part ("train", or "validation" when it was split), read as
    memory maps: `tokens[a:b]` reads across shard edges. `cached`: a store a job prepared in its data
    cache, whose damage is recorded in it (record_damage) for the job's next start to repair."""

    def __init__(self, folder: PathLike, part: str = "train", cached: bool = False) -> None:
        self.folder, self.cached = Path(folder), cached
        try:
            self.meta = read_manifest(self.folder)
        except ManifestDamagedError as err:
            if not cached:
                raise
            raise self.damaged(StoreError, f"{MANIFEST}{err.what}") from None
        if part not in self.meta["parts"]:
            raise StoreError(f"{self.folder} has no {part} part (it has: {', '.join(self.meta['parts'])})")
        self.part = part
        self.shards = self.meta["parts"][part]["shards"]
        for shard in self.shards:
            path = self.folder / shard["name"]
            size = path.stat().st_size if path.is_file() else None
            if size != shard["size"]:
                state = "missing" if size is None else f"{size} bytes, the manifest records {shard['size']}"
                raise self.damaged(StoreError, f"{shard['name']} is {state}")
        self._tokens: Optional[_Concatenated] = None

    @property
    def tokens(self) -> _Concatenated:
        """The part's tokens; each chunk is checked the first time a slice reads it (_ChunkCheck)."""
        if self._tokens is None:
            shards = [s for s in self.shards if s["tokens"]]
            maps = [np.memmap(self.folder / s["name"], dtype=self.dtype, mode="r") for s in shards]
            self._tokens = _Concatenated(maps, _ChunkCheck(self.folder, shards, maps, self.vocab_size, self.damaged))
        return self._tokens

    def damaged(self, error: type, what: str) -> StoreError:
        """The one-line error of damage `what` met in this store, with what to do: prepare it again,
        or, for a store in a job's cache, the same command again once the damage is recorded."""
        line = f"token store {self.folder} is damaged: {what}"
        verify = f"hybridpar verify {self.folder} lists every damaged chunk"
        if not self.cached:
            return error(f"{line}; prepare it again (the same hybridpar prepare repairs it in place; {verify})")
        if record_damage(self.folder, line):
            return error(f"{line}; it is this job's data cache of data.source: run the same command again, its start "
                         f"checks the store and prepares the damaged units again ({verify})")
        return error(f"{line}; it is this job's data cache of data.source, and the damage could not be recorded in it "
                     f"for the next start to repair: delete {self.folder} and run the same command again")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def n_tokens(self) -> int:
        return int(self.meta["parts"][self.part]["tokens"])

    @property
    def n_documents(self) -> int:
        return int(self.meta["parts"][self.part]["documents"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer_sha256"]

    def __len__(self) -> int:
        return self.n_tokens

    def array(self) -> np.ndarray:
        """Every token of the part in one array (small stores: tests, inspection)."""
        return np.asarray(self.tokens[0:self.n_tokens])

    def __getstate__(self) -> dict:  # DataLoader workers reopen the memory maps
        return {**self.__dict__, "_tokens": None}  # and check the chunks they read again, once each

    def __repr__(self) -> str:
        return f"TokenStore({str(self.folder)!r}, part={self.part!r}, n_tokens={self.n_tokens}, dtype={self.dtype})"


def given_store(folder: PathLike, tokenizer, val_fraction: float) -> tuple[TokenStore, Optional[TokenStore]]:
    """(training part, validation part or None) of the store a data source names, refused in one
    line if another tokenizer made it, or if it was split otherwise than data.val_fraction asks."""
    store = TokenStore(folder)
    if tokenizer.sha256 != store.tokenizer_sha256:
        made_with = store.meta.get("tokenizer_path", "") or "unknown"
        raise ValueError(f"the token store {folder} was made with another tokenizer ({made_with}, sha256 "
                         f"{store.tokenizer_sha256[:12]}) than this run's {tokenizer.path} (sha256 {tokenizer.sha256[:12]}): "
                         f"set data.tokenizer to the store's, or prepare the store again with this one")
    if val_fraction > 0 and store.meta["val_fraction"] != val_fraction:
        made = (f"with val_fraction {store.meta['val_fraction']}" if store.meta["val_fraction"]
                else "without a validation split")
        raise ValueError(f"data.val_fraction = {val_fraction}, but the token store {folder} was prepared {made}: "
                         f"prepare it with --val-fraction {val_fraction}, or name a data.val_source")
    return store, TokenStore(folder, "validation") if val_fraction > 0 else None


class _ChunkCheck:
    """Checks the chunks a slice of shard i reads, each once per process: its CRC-32C and its tokens
    against the vocabulary. Remembers a byte per chunk (a 2 TB store: 32 MB, once all is read)."""

    def __init__(self, folder: Path, shards: list[dict], maps: list[np.memmap], vocab_size: int,
                 damaged: Callable[[type, str], StoreError]) -> None:
        self.folder, self.shards, self.maps, self.vocab_size = folder, shards, maps, vocab_size
        self.damaged = damaged  # TokenStore.damaged
        self.itemsize = maps[0].itemsize if maps else 2
        self.sums: list[Optional[np.ndarray]] = [None] * len(shards)
        self.done: list[Optional[bytearray]] = [None] * len(shards)  # 1: checked

    def __call__(self, i: int, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        itemsize = self.itemsize
        first, last = lo * itemsize // CHUNK_BYTES, ((hi - 1) * itemsize) // CHUNK_BYTES + 1
        done = self.done[i]
        if done is not None and done.find(0, first, last) < 0:  # the common case: a fraction of a microsecond
            return
        shard, path = self.shards[i], self.folder / self.shards[i]["name"]
        if done is None:
            try:
                self.sums[i] = read_sums(self.folder / sums_name(shard["name"]), shard["size"], shard["chunks_crc32c"])
            except ValueError as err:
                raise self.damaged(StoreDamagedError, f"{path}: {err}") from None
            done = self.done[i] = bytearray(len(self.sums[i]))
        per_chunk = CHUNK_BYTES // itemsize
        for c in range(first, last):
            if not done[c]:
                data = self.maps[i][c * per_chunk:(c + 1) * per_chunk]
                found = chunk_damage(data, int(self.sums[i][c]), self.vocab_size)
                if found is not None:
                    raise self.damaged(StoreDamagedError, damage_where(path, c * CHUNK_BYTES, data.nbytes, found))
                done[c] = 1


def damage_where(path: Path, chunk_offset: int, nbytes: int, found: tuple[Optional[int], str]) -> str:
    """A damaged chunk: the file, the byte offset (or range), what is wrong."""
    at, what = found
    where = f"bytes {chunk_offset}..{chunk_offset + nbytes - 1}" if at is None else f"byte {chunk_offset + at}"
    return f"{path}, {where}: {what}"


def record_damage(folder: Path, line: str) -> bool:
    """Damage met in store `folder` written to its DAMAGED record, atomically (the ranks that meet it
    at once each replace it whole): the next preparation of the store checks every chunk and repairs
    it (prepare.prepare). Whether it was written: a folder this process may not write in leaves
    the damage error as it is, never another error."""
    record = {"damage": line, "by": f"{socket.gethostname()} pid {os.getpid()}"}
    try:
        write_text_atomic(folder / DAMAGED, json.dumps(record, indent=1) + "\n")
        return True
    except (OSError, ValueError) as err:  # (a full disk's DiskFullError is a ValueError too)
        log.debug("%s: not written (%s)", folder / DAMAGED, err)  # said in the error line, once
        return False


def shard_name(unit: int, part: int, index: int) -> str:
    return f"{UNITS}/{unit:06d}.{PART_NAMES[part]}.{index}.tokens"


def unit_record_name(unit: int) -> str:
    return f"{UNITS}/{unit:06d}.json"
