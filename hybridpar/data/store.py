"""The token store: a prepared corpus as a folder of token shards and a manifest.

    STORE/plan.json              what is being made: the source files, their units, the tokenizer
    STORE/units/000012.json      a unit done: its documents, tokens, records skipped, its shards
    STORE/units/000012.train.0.tokens   the unit's token ids (raw uint16/uint32), at most
                                 MAX_SHARD_TOKENS a file; `.validation.` with a validation split
    STORE/store.json             the manifest, written last: the store is complete iff it is there

The tokens of a store are its units' shards in plan order: the same store whatever the number of
workers or parts that made it. Each shard's size and CRC-32C are in the manifest (`verify`).
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from hybridpar.data.tokenise import PART_NAMES
from hybridpar.files import PathLike, crc32c_file

MANIFEST = "store.json"
PLAN = "plan.json"
UNITS = "units"
FORMAT = "hybridpar-token-store"
VERSION = 1
MAX_SHARD_TOKENS = 1 << 28  # 512 MB of uint16 a file


class StoreError(ValueError):
    """A store that is incomplete, damaged or made for something else, with what to do. Every rank
    of a job reads the same store and meets the same error: said once."""

    every_rank = True  # hybridpar.ranks.raised_by_every_rank


def is_store(path: PathLike) -> bool:
    """Is `path` a token store (complete or not)?"""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / PLAN).is_file())


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
        raise StoreError(f"{path} is damaged ({err}); prepare the store again") from err
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{path} is not a hybridpar token store manifest")
    if manifest.get("version") != VERSION:
        raise StoreError(f"{folder} is a token store of version {manifest.get('version')}, this hybridpar reads "
                         f"version {VERSION}: prepare it again")
    return manifest


class _Concatenated:
    """The tokens of several memory-mapped shards as one sequence: slices read across shard edges."""

    def __init__(self, shards: list[np.memmap]) -> None:
        self.shards = shards
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
            parts.append(self.shards[i][lo:hi])
            start = self.starts[i] + hi
            i += 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.shards[0].dtype if self.shards else np.uint16)


class TokenStore:
    """A complete store's tokens of one part ("train", or "validation" when it was split), read as
    memory maps: `tokens[a:b]` reads across shard edges."""

    def __init__(self, folder: PathLike, part: str = "train") -> None:
        self.folder = Path(folder)
        self.meta = read_manifest(self.folder)
        if part not in self.meta["parts"]:
            raise StoreError(f"{self.folder} has no {part} part (it has: {', '.join(self.meta['parts'])})")
        self.part = part
        self.shards = self.meta["parts"][part]["shards"]
        for shard in self.shards:
            path = self.folder / shard["name"]
            size = path.stat().st_size if path.is_file() else None
            if size != shard["size"]:
                state = "missing" if size is None else f"{size} bytes, the manifest records {shard['size']}"
                raise StoreError(f"token store {self.folder} is damaged: {shard['name']} is {state}; prepare it again "
                                 f"(hybridpar verify {self.folder} checks every shard)")
        self._tokens: Optional[_Concatenated] = None

    @property
    def tokens(self) -> _Concatenated:
        if self._tokens is None:
            self._tokens = _Concatenated([np.memmap(self.folder / s["name"], dtype=self.dtype, mode="r")
                                          for s in self.shards if s["tokens"]])
        return self._tokens

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
        return {**self.__dict__, "_tokens": None}

    def __repr__(self) -> str:
        return f"TokenStore({str(self.folder)!r}, part={self.part!r}, n_tokens={self.n_tokens}, dtype={self.dtype})"


def shard_name(unit: int, part: int, index: int) -> str:
    return f"{UNITS}/{unit:06d}.{PART_NAMES[part]}.{index}.tokens"


def unit_record_name(unit: int) -> str:
    return f"{UNITS}/{unit:06d}.json"


def verify_store(folder: PathLike, out=None, progress: Optional[Callable[[int], None]] = None) -> int:
    """Check every shard of a store against the manifest's size and CRC-32C: a verdict line per
    damaged shard and a summary; 0 when all are ok, 1 otherwise."""
    import sys

    folder, out = Path(folder), out or sys.stdout
    try:
        manifest = read_manifest(folder)
    except StoreError as err:
        print(f"{folder}: NOT OK: {err}", file=out)
        return 1
    shards = [s for part in manifest["parts"].values() for s in part["shards"]]
    bad = 0
    for shard in shards:
        path = folder / shard["name"]
        if not path.is_file():
            verdict = "missing"
        elif path.stat().st_size != shard["size"]:
            verdict = f"damaged: {path.stat().st_size} bytes, the manifest records {shard['size']}"
        else:
            verdict = None if crc32c_file(path, progress)[1] == shard["crc32c"] else "damaged: checksum mismatch"
        if verdict is not None:
            bad += 1
            print(f"{shard['name']}: {verdict}", file=out)
    summary = "all ok" if not bad else f"NOT OK: {bad} damaged or missing"
    print(f"{folder}: token store, {len(shards) - bad} of {len(shards)} shards ok "
          f"({sum(p['tokens'] for p in manifest['parts'].values()):,} tokens); {summary}", file=out)
    return 0 if not bad else 1
