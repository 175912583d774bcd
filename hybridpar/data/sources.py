"""Data sources: what a `data.source` names, resolved to files in reading order and described
(paths, sizes, mtimes; the corpus id for "default") so that caches know when the input changed.

Sources: "default" (the embedded stdlib corpus), a .txt file (the whole file is one document), a
.jsonl file (one JSON object per line, the document in `text_field`), a directory of such files
(sorted, recursive, hidden names skipped) or a list of any of these.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
from typing import Optional, Sequence, Union

from hybridpar.data.corpus import default_corpus_bytes, default_corpus_id
from hybridpar.files import PathLike, sha256_text

DEFAULT_SOURCE = "default"
DATA_FILE_KINDS = {".txt": "txt", ".jsonl": "jsonl"}

Source = Union[PathLike, Sequence[PathLike]]


@dataclasses.dataclass(frozen=True)
class SourceFile:
    kind: str  # "default", "txt" or "jsonl"
    path: Optional[Path] = None


def resolve_sources(source: Source) -> list[SourceFile]:
    """Every input in reading order; errors name the path and what is accepted."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("the data source list is empty; give 'default', files or directories")
        return [f for item in source for f in resolve_sources(item)]
    if isinstance(source, str) and source == DEFAULT_SOURCE:
        return [SourceFile("default")]
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist")
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_FILE_KINDS and not _hidden(p, path)),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise ValueError(f"data directory {path} has no .txt or .jsonl files")
        return [SourceFile(DATA_FILE_KINDS[p.suffix], p.resolve()) for p in files]
    kind = DATA_FILE_KINDS.get(path.suffix)
    if kind is None:
        raise ValueError(
            f"{path}: unknown data file type {path.suffix!r}; use .txt (the whole file is one document), "
            f".jsonl (one JSON object per line with the text in a field), a directory of them, or 'default'"
        )
    return [SourceFile(kind, path.resolve())]


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def describe_sources(files: Sequence[SourceFile], text_field: str = "text") -> dict:
    """What the output was made from; sizes and mtimes make an edited file count as a new source."""
    described = []
    for f in files:
        if f.kind == "default":
            described.append({"kind": "default", "corpus_id": default_corpus_id()})
        else:
            st = f.path.stat()
            described.append({"kind": f.kind, "path": str(f.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    uses_field = any(f.kind == "jsonl" for f in files)
    return {"files": described, "text_field": text_field if uses_field else None}


def source_id(source: Source, text_field: str = "text") -> str:
    """A short stable name for a source (tokenizer cache key): the corpus id, or a hash of the files."""
    files = resolve_sources(source)
    if all(f.kind == "default" for f in files):
        return default_corpus_id()
    return "data-" + sha256_text(json.dumps(describe_sources(files, text_field), sort_keys=True))[:16]


def source_bytes(files: Sequence[SourceFile]) -> int:
    """How many bytes reading `files` goes through (for the embedded corpus, its standard-library
    sources): the total that progress counts up to."""
    return sum(default_corpus_bytes() if f.kind == "default" else f.path.stat().st_size for f in files)


def source_name(files: Sequence[SourceFile]) -> str:
    """A short name for messages: the embedded corpus, or the first few paths."""
    names = [f"the embedded corpus (Python {platform.python_version()}'s standard-library docstrings)"
             if f.kind == "default" else str(f.path) for f in files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
