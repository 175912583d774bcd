"""The embedded default corpus: the docstrings of Python's standard library.

Real English prose that is on every machine with Python, so training runs with no download. The
sources are parsed with `ast`, never imported: importing some stdlib modules has side effects
(`antigravity` opens a browser, `this` prints). Test suites, site-packages and files that are not
UTF-8 or do not parse are skipped; files are read in sorted order, so the corpus is the same on
every machine with the same Python build.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import platform
import sysconfig
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

# Docstrings shorter than this ("Return self.") add little text and many document boundaries.
MIN_DOCUMENT_CHARS = 40
# Part of the corpus id: bump when the extraction rules change, so caches built from the old
# corpus are not reused.
EXTRACTION_VERSION = 1

_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Optional[Path] = None) -> list[Path]:
    """The .py files under `root` (default: the stdlib) minus test suites and site-packages, sorted."""
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("test_")]
        found.extend(Path(folder, f) for f in files if f.endswith(".py") and not f.startswith("test_"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def docstrings_of_file(path: Path) -> list[str]:
    """Cleaned docstrings of one source file in source order; [] when it is not UTF-8 or does not parse."""
    try:
        source = path.read_bytes().decode("utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like in old modules
            tree = ast.parse(source, filename=str(path))
    except (OSError, ValueError, SyntaxError, RecursionError):  # UnicodeDecodeError is a ValueError
        return []
    found: list[str] = []
    _collect_docstrings(tree, found)
    return found


def _collect_docstrings(node: ast.AST, found: list[str]) -> None:
    # Depth first in source order (ast.walk is breadth first, which scatters a class's methods).
    if isinstance(node, _DOCUMENTED_NODES):
        raw = ast.get_docstring(node, clean=False)
        if raw:
            found.append(inspect.cleandoc(raw))
    for child in ast.iter_child_nodes(node):
        _collect_docstrings(child, found)


def docstring_documents(paths: Iterable[Path], max_documents: Optional[int] = None,
                        on_bytes: Optional[Callable[[int], None]] = None) -> Iterator[str]:
    """One document per docstring of `paths`, skipping tiny ones and exact duplicates (copied modules).
    `on_bytes(n)` is told the size of each file once its docstrings are handed out (progress)."""
    if max_documents is not None and max_documents <= 0:
        return
    seen: set[bytes] = set()
    count = 0
    for path in paths:
        for doc in docstrings_of_file(path):
            if len(doc) < MIN_DOCUMENT_CHARS:
                continue
            key = hashlib.sha1(doc.encode("utf-8")).digest()
            if key in seen:
                continue
            seen.add(key)
            yield doc
            count += 1
            if max_documents is not None and count >= max_documents:
                return
        if on_bytes is not None:
            on_bytes(_size(path))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def default_corpus_documents(max_documents: Optional[int] = None,
                             on_bytes: Optional[Callable[[int], None]] = None) -> Iterator[str]:
    """The standard library's docstrings, one document each, in a fixed order; files are parsed lazily.
    `on_bytes`: as docstring_documents."""
    return docstring_documents(stdlib_source_files(), max_documents, on_bytes)


def default_corpus_bytes() -> int:
    """The size of the source files the corpus is read from: what on_bytes adds up to."""
    return sum(_size(path) for path in stdlib_source_files())


def default_corpus_id() -> str:
    """A short id that changes when the corpus would: Python version plus a fingerprint of the files.

    The fingerprint (relative paths and sizes, no reading) tells apart builds of one version that
    ship different stdlib files, e.g. a distribution's patched Python.
    """
    root = stdlib_root()
    digest = hashlib.sha256(f"extraction v{EXTRACTION_VERSION} min {MIN_DOCUMENT_CHARS}\n".encode())
    for path in stdlib_source_files(root):
        digest.update(f"{path.relative_to(root).as_posix()} {path.stat().st_size}\n".encode())
    return f"stdlib-docstrings-py{platform.python_version()}-{digest.hexdigest()[:10]}"
