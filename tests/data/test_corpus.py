"""The embedded default corpus: stdlib docstrings, parsed not imported, in a fixed order."""

import re
import sys

from hybridpar.data import corpus
from hybridpar.data import default_corpus_documents, default_corpus_id


def test_corpus_is_real_english_text(corpus_sample):
    assert len(corpus_sample) == 300
    assert all(isinstance(d, str) and len(d) >= corpus.MIN_DOCUMENT_CHARS for d in corpus_sample)
    text = "\n".join(corpus_sample)
    words = re.findall(r"[a-z]+", text.lower())
    for common in ("the", "of", "is", "return", "and"):
        assert words.count(common) > 50, common
    letters = sum(c.isalpha() or c.isspace() for c in text)
    assert letters / len(text) > 0.8  # prose, not code or binary
    assert len(set(corpus_sample)) == len(corpus_sample)  # exact duplicates are dropped


def test_corpus_is_deterministic_and_capped():
    first = list(default_corpus_documents(max_documents=120))
    assert first == list(default_corpus_documents(max_documents=120))
    assert list(default_corpus_documents(max_documents=50)) == first[:50]
    assert list(default_corpus_documents(max_documents=0)) == []
    assert list(default_corpus_documents(max_documents=-1)) == []


def test_documents_are_cleaned_docstrings():
    # The first file in sorted order is __future__.py; its module docstring opens the corpus.
    import __future__

    first = next(default_corpus_documents())
    assert first == __future__.__doc__.strip()
    assert not first.startswith((" ", "\n"))


SIDE_EFFECT = '''"""A module that must be parsed, never imported: importing it fails loudly."""
raise SystemExit("imported!")


class Thing:
    """A class docstring that is long enough to keep in the corpus."""

    def method(self):
        """A method docstring that is long enough to keep in the corpus too."""

    def tiny(self):
        """Tiny."""
'''


def test_parses_sources_and_skips_tests_site_packages_and_bad_files(tmp_path):
    (tmp_path / "b_module.py").write_text(SIDE_EFFECT)
    (tmp_path / "a_dup.py").write_text('"""A module that must be parsed, never imported: importing it fails loudly."""\n')
    (tmp_path / "latin1.py").write_bytes('"""Caf\xe9 docstring that is long enough but not UTF-8 at all."""\n'.encode("latin-1"))
    (tmp_path / "broken.py").write_text('"""A docstring long enough in a file that does not parse."""\ndef (:\n')
    for skipped in ("test", "tests", "idle_test", "site-packages", "pkg/test"):
        (tmp_path / skipped).mkdir(parents=True)
        (tmp_path / skipped / "mod.py").write_text('"""A docstring in a folder the corpus must skip entirely."""\n')
    (tmp_path / "test_thing.py").write_text('"""A docstring in a test file the corpus must skip entirely."""\n')
    (tmp_path / "pkg" / "mod.py").write_text('"""A docstring in a package that the corpus does include."""\n')

    files = corpus.stdlib_source_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["a_dup.py", "b_module.py", "broken.py", "latin1.py", "pkg/mod.py"]
    docs = list(corpus.docstring_documents(files))
    assert docs == [
        "A module that must be parsed, never imported: importing it fails loudly.",
        "A class docstring that is long enough to keep in the corpus.",
        "A method docstring that is long enough to keep in the corpus too.",
        "A docstring in a package that the corpus does include.",
    ]
    assert "b_module" not in sys.modules


def test_stdlib_walk_skips_test_suites_and_site_packages():
    root = corpus.stdlib_root()
    parts = {part for p in corpus.stdlib_source_files() for part in p.relative_to(root).parts[:-1]}
    assert not parts & {"test", "tests", "idle_test", "site-packages"}
    assert {"json", "email", "asyncio"} <= parts


def test_corpus_id_is_short_stable_and_names_the_python_version(monkeypatch):
    cid = default_corpus_id()
    assert cid == default_corpus_id()
    assert f"py{sys.version_info.major}.{sys.version_info.minor}" in cid and len(cid) < 64
    monkeypatch.setattr(corpus, "EXTRACTION_VERSION", corpus.EXTRACTION_VERSION + 1)
    assert default_corpus_id() != cid  # new extraction rules -> new cache keys

