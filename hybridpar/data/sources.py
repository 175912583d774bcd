"""Data sources: what a `data.source` names, resolved to files in reading order and described
(paths, sizes, mtimes; the corpus id for "default") so that caches know when the input changed.

Sources: "default" (the embedded stdlib corpus), a .txt file (the whole file is one document), a
.jsonl file (one JSON object per line, the document in `text_field`), compressed as .jsonl.gz or
.jsonl.zst, a .parquet or .arrow file (the document in column `text_field`), a Hugging Face
`datasets` folder (save_to_disk's state.json and arrow files), a directory of any of these (sorted
by path, recursive, hidden names skipped; the hub layout is a directory of parquet files) or a
list of any of these.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from hybridpar.data.corpus import default_corpus_bytes, default_corpus_id
from hybridpar.data.store.token_store import MANIFEST, PLAN
from hybridpar.data.streams import DataFormatError
from hybridpar.config.data_sources import DEFAULT_SOURCE, SourceNames
from hybridpar.files import PathLike, sha256_text
from hybridpar.progress import note

# The name's ending -> the kind of file, longest first.
DATA_FILE_KINDS = {".jsonl.zst": "jsonl.zst", ".jsonl.zstd": "jsonl.zst", ".jsonl.gz": "jsonl.gz", ".jsonl": "jsonl",
                   ".txt": "txt", ".parquet": "parquet", ".arrow": "arrow"}
ACCEPTED = ("'default', .txt (the whole file is one document), .jsonl / .jsonl.gz / .jsonl.zst (one JSON object per "
            "line), .parquet, .arrow, a Hugging Face datasets folder (save_to_disk), or a directory of them")


def kind_of(path: Path) -> Optional[str]:
    name = path.name.lower()
    return next((kind for end, kind in DATA_FILE_KINDS.items() if name.endswith(end)), None)

Source = Union[PathLike, Sequence[PathLike]]


@dataclasses.dataclass(frozen=True)
class SourceFile:
    kind: str  # "default" or a DATA_FILE_KINDS value
    path: Optional[Path] = None


def is_store(path: PathLike) -> bool:
    """Does `path` name a token store (complete or not: hybridpar.data.store), not raw text?"""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / PLAN).is_file())


@dataclasses.dataclass(frozen=True)
class Input:
    """One data source as a run reads it, looked at once: a token store as given (`store`), or raw
    files resolved (in reading order) and described (paths, sizes, mtimes). What the tokenizer's
    cache key, a store's cache folder, its plan and its completeness check take, so that none of
    them walks or stats the source again."""

    source: Source  # as the config names it
    text_field: str
    name: str  # for messages (source_name)
    files: tuple[SourceFile, ...] = ()
    description: Optional[dict] = None  # describe_sources(files, text_field); None for a store
    store: Optional[Path] = None  # the token store the source names


def describe_input(source: Source, text_field: str = "text", walked: Optional[Mapping] = None) -> Input:
    """`source` looked at once: a token store as it is, else resolved and described. `walked`:
    {source_key(source): files} of sources walked already (a job's: hybridpar.preflight.Job.sources),
    whose files are taken from it instead of walking the source again."""
    if not isinstance(source, (list, tuple)) and is_store(source):
        return Input(source, text_field, str(source), store=Path(source))
    files = walked.get(source_key(source)) if walked else None
    files = tuple(resolve_sources(source) if files is None else files)
    return Input(source, text_field, source_name(files), files, describe_sources(files, text_field))


def joined_input(inputs: Sequence[Input], text_field: str) -> Input:
    """The raw inputs read as one (a blend's tokenizer is trained on them together, read with
    `text_field`), described from their descriptions: no file is looked at again."""
    raw = [i for i in inputs if i.store is None]
    files = tuple(f for i in raw for f in i.files)
    described = [d for i in raw for d in i.description["files"]]
    uses_field = any(f.kind not in ("default", "txt") for f in files)
    source = raw[0].source if len(raw) == 1 else [i.source for i in raw]
    return Input(source, text_field, source_name(files), files,
                 {"files": described, "text_field": text_field if uses_field else None})


def input_id(corpus: Input) -> str:
    """A short stable name for raw input (the tokenizer cache's key): the corpus id, or a hash of
    its description."""
    described = corpus.description["files"]
    if all(f["kind"] == "default" for f in described):
        return described[0]["corpus_id"] if described else default_corpus_id()
    return "data-" + sha256_text(json.dumps(corpus.description, sort_keys=True))[:16]


def resolve_sources(source: Source) -> list[SourceFile]:
    """Every input in reading order, each real file once; errors name the path and what is accepted.
    Links that lead to a folder or file already read are skipped (a folder holding `again -> .`
    would be walked again and again), and so are files of no known kind: one note says which."""
    walk = _Walk()
    files = walk.source(source)
    walk.tell()
    return files


def source_key(source: PathLike) -> str:
    """One source (a path or "default", as written) as a key of a table of walked sources
    ({source_key(source): files}: hybridpar.preflight.Job.sources, describe_input's `walked`)."""
    return str(source)


class _Walk:
    """Resolves sources, remembering each real folder and file it has seen (by device and inode)."""

    def __init__(self) -> None:
        self.named = SourceNames()
        self.seen: dict[tuple[int, int], Path] = {}  # real folder or file -> the path it was first met by
        self.again: list[tuple[Path, Path]] = []  # (path, the path met before) of what was skipped
        self.unknown: list[Path] = []  # files of no known kind in folders

    def source(self, source: Source) -> list[SourceFile]:
        if isinstance(source, (list, tuple)):
            if not source:
                raise ValueError("the data source list is empty; give 'default', files or directories")
            return [f for item in source for f in self.source(item)]
        clash = self.named.clash(source)
        if clash:
            raise ValueError(f"the data sources {clash[0]!r} and {str(source)!r} {clash[1]}: list each file or "
                             "folder once")
        if isinstance(source, str) and source == DEFAULT_SOURCE:
            return [SourceFile("default")]
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"data path {path} does not exist")
        if path.is_dir():
            if is_store(path):  # (a source that is a store alone never gets here: describe_input)
                raise DataFormatError(f"{path} is a token store (prepared already), not raw text to prepare: train on "
                                      f"it as it is (data.source = {path}); {_STORE_WITH_RAW}")
            if not self._first(path):
                return []
            found = self._folder(path)
            if not found:
                raise ValueError(f"data directory {path} has no data files; it may hold {ACCEPTED}")
            files = [p for p in sorted(found, key=lambda p: p.relative_to(path).as_posix()) if self._first(p)]
            return [SourceFile(kind_of(p), p.resolve()) for p in files]
        kind = kind_of(path)
        if kind is None:
            raise ValueError(f"{path}: unknown kind of data file; use {ACCEPTED}")
        return [SourceFile(kind, path.resolve())] if self._first(path) else []

    def _first(self, path: Path) -> bool:
        """Whether `path` leads to a folder or file not met before (else it is noted as skipped)."""
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        if key in self.seen:
            self.again.append((path, self.seen[key]))
            return False
        self.seen[key] = path
        return True

    def _folder(self, root: Path) -> list[Path]:
        """The data files under `root`, each folder walked once; a `datasets` folder contributes the
        arrow files its state.json lists (not its caches), and hidden names are skipped."""
        if (root / "dataset_dict.json").is_file():
            splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
            raise ValueError(f"{root} is a Hugging Face DatasetDict with splits {', '.join(splits)}: give one split's "
                             f"folder, e.g. {root / (splits[0] if splits else 'train')}")
        if (root / "state.json").is_file() and (root / "dataset_info.json").is_file():
            state = json.loads((root / "state.json").read_text())
            listed = [root / entry["filename"] for entry in state["_data_files"]]
            missing = [p.name for p in listed if not p.is_file()]
            if missing:
                raise ValueError(f"{root} is a datasets folder whose state.json lists files that are not there: "
                                 f"{', '.join(missing)}; save it again")
            return listed
        found = []
        for child in sorted(root.iterdir()):
            if child.name.startswith("."):
                continue
            if child.is_dir() and is_store(child):
                raise DataFormatError(f"the data folder {root} holds the token store {child}, which is never read as "
                                      f"raw text: move it out of the folder; {_STORE_WITH_RAW}")
            if child.is_dir():
                found += self._folder(child) if self._first(child) else []
            elif child.is_file() and kind_of(child) is not None:
                found.append(child)
            else:
                self.unknown.append(child)
        return found

    def tell(self) -> None:
        """One note of what was skipped, once a process (resolving the same sources again says nothing)."""
        said = []
        if self.again:
            shown = "; ".join(f"{p} is {'a link to' if p.is_symlink() else 'the same as'} {first}"
                              for p, first in self.again[:3])
            said.append(f"data: {len(self.again)} path(s) lead to a folder or file already read, read once: {shown}"
                        + ("; ..." if len(self.again) > 3 else ""))
        if self.unknown:
            shown = ", ".join(str(p) for p in self.unknown[:3]) + (", ..." if len(self.unknown) > 3 else "")
            said.append(f"data: {len(self.unknown)} file(s) in the data folders are not data files and were skipped "
                        f"({shown}); data files are {', '.join(DATA_FILE_KINDS)}")
        for text in said:
            if text not in _SAID:
                _SAID.add(text)
                note(text)


_SAID: set[str] = set()  # the notes said in this process
# How a store and raw files are used together: each is a source of its own.
_STORE_WITH_RAW = ("with raw files, make the two a blend, each a source of its own (data.sources, e.g. "
                   "\"store=STORE@0.5,raw=FILES@0.5\": the job prepares the raw one, or hybridpar prepare of the raw "
                   "files alone does)")


def describe_sources(files: Sequence[SourceFile], text_field: str = "text") -> dict:
    """What the output was made from; sizes and mtimes make an edited file count as a new source."""
    described = []
    for f in files:
        if f.kind == "default":
            described.append({"kind": "default", "corpus_id": default_corpus_id()})
        else:
            st = f.path.stat()
            described.append({"kind": f.kind, "path": str(f.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    uses_field = any(f.kind not in ("default", "txt") for f in files)
    return {"files": described, "text_field": text_field if uses_field else None}


def source_id(source: Source, text_field: str = "text") -> str:
    """A short stable name for a source (tokenizer cache key): input_id of its files."""
    files = tuple(resolve_sources(source))
    return input_id(Input(source, text_field, "", files, describe_sources(files, text_field)))


def source_bytes(files: Sequence[SourceFile]) -> int:
    """How many bytes reading `files` goes through (for the embedded corpus, its standard-library
    sources): the total that progress counts up to."""
    return sum(default_corpus_bytes() if f.kind == "default" else f.path.stat().st_size for f in files)


def source_name(files: Sequence[SourceFile]) -> str:
    """A short name for messages: the embedded corpus, or the first few paths."""
    names = [f"the embedded corpus (Python {platform.python_version()}'s standard-library docstrings)"
             if f.kind == "default" else str(f.path) for f in files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
