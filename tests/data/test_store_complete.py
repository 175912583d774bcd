"""A complete token store is used as it is: told complete from its manifest, its plan.json and a stat
of each source file, with no source file opened and no plan made; a source changed since is not."""

from __future__ import annotations

import json
import os

import pytest

from hybridpar.data import cached_store
from hybridpar.data.formats import MAX_DOCUMENT_BYTES
from hybridpar.data.sources import describe_input
from hybridpar.data.store.unit_plan import finished_store
from tests.opens import CountedOpens

OPTIONS = dict(val_fraction=0.0, on_bad_record="error", max_document_bytes=MAX_DOCUMENT_BYTES)


def _source(tmp_path, kind: str):
    docs = [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(40)]
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=10)
    else:
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_complete_store_opens_no_source_file_and_makes_no_plan(tmp_path, tokenizer, monkeypatch, kind):
    import hybridpar.data.store.unit_plan as store_plan
    import hybridpar.data.store.prepare as store_prepare

    source = _source(tmp_path, kind)
    first, _ = cached_store(str(source), tokenizer, tmp_path / "cache", report=False)
    planned = []
    for module in (store_plan, store_prepare):
        real = module.plan_of
        monkeypatch.setattr(module, "plan_of", lambda *a, real=real, **k: planned.append(a) or real(*a, **k))
    with CountedOpens() as opened:
        again, _ = cached_store(str(source), tokenizer, tmp_path / "cache", report=False)
    assert again.folder == first.folder and again.array().tolist() == first.array().tolist()
    assert opened.count(source) == 0 and planned == []
    assert opened.count(first.folder / "plan.json") == 1  # what tells it complete, read once


def test_counting_sees_a_source_opened(tmp_path, tokenizer):
    """The counter itself: planning a new store opens the source (else the test above proves nothing)."""
    for kind in ("jsonl", "parquet"):
        (tmp_path / kind).mkdir()
        source = _source(tmp_path / kind, kind)
        with CountedOpens() as opened:
            cached_store(str(source), tokenizer, tmp_path / "cache", report=False)
        assert opened.count(source) > 0, kind


def test_a_store_of_a_source_changed_since_is_not_finished(tmp_path, tokenizer):
    source = _source(tmp_path, "jsonl")
    store, _ = cached_store(str(source), tokenizer, tmp_path / "cache", report=False)
    assert finished_store(store.folder, describe_input(str(source)), tokenizer.sha256, **OPTIONS)
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, another mtime
    assert not finished_store(store.folder, describe_input(str(source)), tokenizer.sha256, **OPTIONS)
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = describe_input(str(source))
    assert finished_store(store.folder, now, tokenizer.sha256, **OPTIONS)
    assert not finished_store(store.folder, now, "another-tokenizer", **OPTIONS)
    assert not finished_store(store.folder, now, tokenizer.sha256, **{**OPTIONS, "on_bad_record": "skip"})
    assert not finished_store(store.folder, describe_input(str(source), "body"), tokenizer.sha256, **OPTIONS)
    (store.folder / "store.json").rename(store.folder / "store.json.gone")  # not complete
    assert not finished_store(store.folder, now, tokenizer.sha256, **OPTIONS)


def test_tokenizer_sha256_is_the_tokenizers_without_loading_it(tmp_path, tokenizer, bpe_files):
    """What resolve_job tells a cached store by: the sha256 a loaded Tokenizer records, of every kind
    (a tokenizer.json's with its tokenizer_config.json beside it)."""
    import shutil

    from hybridpar.data import Tokenizer
    from hybridpar.data.tokenizer import tokenizer_sha256

    hf, tiktoken_file, _ = bpe_files
    configured = tmp_path / "hf"
    shutil.copytree(hf.parent, configured)
    (configured / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    for path in (tokenizer.path, hf, tiktoken_file, configured / "tokenizer.json", configured):
        assert tokenizer_sha256(path) == Tokenizer(path).sha256, path
    assert tokenizer_sha256(configured) != tokenizer_sha256(hf)
