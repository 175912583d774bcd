"""Counting the files a process opens: open() (builtins and io, which pathlib uses), os.open, and
pyarrow's ParquetFile (which opens in C++, past Python's open)."""

from __future__ import annotations

import builtins
import io
import os
from collections import Counter


class CountedOpens:
    """with CountedOpens() as opened: ...; opened.count(path) is how often `path` was opened
    inside the block (paths compared resolved)."""

    def __init__(self) -> None:
        self.paths: Counter = Counter()
        self._saved: list = []

    def _note(self, file) -> None:
        if isinstance(file, (str, bytes, os.PathLike)):
            self.paths[os.path.realpath(os.fsdecode(file))] += 1

    def count(self, path) -> int:
        return self.paths[os.path.realpath(os.fsdecode(path))]

    def __enter__(self) -> "CountedOpens":
        import pyarrow.parquet as pq

        note = self._note

        def counting(real):
            def opened(file, *args, **kwargs):
                note(file)
                return real(file, *args, **kwargs)
            return opened

        class ParquetFile(pq.ParquetFile):
            def __init__(self, source, *args, **kwargs):
                note(source)
                super().__init__(source, *args, **kwargs)

        self._saved = [(builtins, "open", builtins.open), (io, "open", io.open), (os, "open", os.open),
                       (pq, "ParquetFile", pq.ParquetFile)]
        for module, name, real in self._saved:
            setattr(module, name, ParquetFile if name == "ParquetFile" else counting(real))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, real in self._saved:
            setattr(module, name, real)
