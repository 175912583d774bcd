"""Preparing a token store: EOS after every document, sources in order, streamed, never complete-looking
when it failed, cached by input and tokenizer."""

import json
import pickle
import tracemalloc

import numpy as np
import pytest

from hybridpar.data import TokenStore, cached_store, default_corpus_documents, default_corpus_id, prepare_store
from hybridpar.data import formats, tokenise
from tests.data.stubs import NumberTokenizer


def expected_tokens(tokenizer, documents):
    return [i for doc in documents for i in tokenizer.encode(doc, eos=True)]


def make_store(source, tokenizer, out, **options) -> TokenStore:
    return prepare_store(source, tokenizer, out, workers=1, report=False, **options)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_eos_after_every_document_exactly(tmp_path, tokenizer, corpus_sample):
    docs = corpus_sample[:5] + ["short", "line one\nline two"]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" + ("\n" if i == 2 else "") for i, d in enumerate(docs)))
    tf = make_store(src, tokenizer, tmp_path / "out.bin")
    assert tf.array().tolist() == expected_tokens(tokenizer, docs)
    assert (tf.n_tokens, tf.n_documents, tf.vocab_size, tf.dtype) == (len(tf.tokens), len(docs), tokenizer.vocab_size, np.uint16)
    assert int((tf.array() == tokenizer.eos_id).sum()) == len(docs)
    meta = json.loads((tmp_path / "out.bin" / "store.json").read_text())
    assert meta["tokenizer_sha256"] == tokenizer.sha256 and meta["dtype"] == "uint16" and meta["eos_id"] == 2
    assert meta["files"][0]["path"] == str(src) and meta["text_field"] == "text"
    assert meta["files"][0]["documents"] == len(docs) and meta["files"][0]["tokens"] == tf.n_tokens
    shards = [tmp_path / "out.bin" / s["name"] for s in meta["parts"]["train"]["shards"]]
    assert sum(p.stat().st_size for p in shards) == 2 * tf.n_tokens  # raw uint16, no header


def test_text_field_option(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "c.jsonl", [{"content": "first doc"}, {"content": "second doc"}])
    tf = make_store(src, tokenizer, tmp_path / "out.bin", text_field="content")
    assert tf.array().tolist() == expected_tokens(tokenizer, ["first doc", "second doc"])


def test_directories_are_sorted_and_lists_keep_their_order(tmp_path, tokenizer):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "b.txt").write_text("bravo file\nsecond line\n")
    (data / "a.txt").write_text("alpha file")
    write_jsonl(data / "sub" / "c.jsonl", [{"text": "charlie one"}, {"text": "charlie two"}])
    (data / ".hidden.txt").write_text("hidden")
    (data / "notes.md").write_text("not data")
    tf = make_store(data, tokenizer, tmp_path / "dir.bin")
    in_order = ["alpha file", "bravo file\nsecond line\n", "charlie one", "charlie two"]
    assert tf.array().tolist() == expected_tokens(tokenizer, in_order)

    extra = tmp_path / "z.txt"
    extra.write_text("zulu")
    tf = make_store([str(extra), data], tokenizer, tmp_path / "list.bin")
    assert tf.array().tolist() == expected_tokens(tokenizer, ["zulu"] + in_order)
    assert tf.n_documents == 5


def test_long_documents_cut_in_pieces_tokenise_as_whole(tmp_path, tokenizer, corpus_sample, monkeypatch):
    # Tiny pieces and batches: every document is cut at many line ends and spread over batches.
    monkeypatch.setattr(formats, "PIECE_CHARS", 50)
    monkeypatch.setattr(tokenise, "BATCH_CHARS", 300)
    long_doc = "\n".join(corpus_sample[:40]) + "\n\n  indented tail\n"
    txt = tmp_path / "long.txt"
    txt.write_text(long_doc)
    src = write_jsonl(tmp_path / "long.jsonl", [{"text": long_doc}, {"text": corpus_sample[41]}])
    tf = make_store([txt, src], tokenizer, tmp_path / "out.bin")
    assert tf.array().tolist() == expected_tokens(tokenizer, [long_doc, long_doc, corpus_sample[41]])


def test_crlf_txt_is_read_with_universal_newlines(tmp_path, tokenizer):
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    tf = make_store(tmp_path / "crlf.txt", tokenizer, tmp_path / "out.bin")
    assert tf.array().tolist() == expected_tokens(tokenizer, ["one\ntwo\n"])


@pytest.mark.parametrize("vocab,top,dtype", [(65536, 65535, np.uint16), (65537, 65536, np.uint32), (70000, 69999, np.uint32)])
def test_dtype_is_uint16_when_the_vocab_fits(tmp_path, vocab, top, dtype):
    (tmp_path / "ids.txt").write_text(f"5 {top} 7")
    tf = make_store(tmp_path / "ids.txt", NumberTokenizer(vocab_size=vocab), tmp_path / "out.bin")
    assert tf.dtype == dtype and tf.array().dtype == dtype
    assert tf.array().tolist() == [5, top, 7, 0]
    assert sum(s["size"] for s in tf.shards) == 4 * np.dtype(dtype).itemsize


def test_id_outside_the_vocab_is_an_error(tmp_path):
    (tmp_path / "ids.txt").write_text("5 1000")
    with pytest.raises(ValueError, match=r"produced id 1000, outside its vocab of 1000"):
        make_store(tmp_path / "ids.txt", NumberTokenizer(vocab_size=1000), tmp_path / "out.bin")


@pytest.mark.parametrize(
    "lines,message",
    [
        (['{"text": "ok"}', '{"text": "ok"}', '{"body": "no text here"}'], r"bad.jsonl:3: no 'text' field \(it has: body\); set data.text_field .* or set data.on_bad_record = \"skip\""),
        (['{"text": "ok"}', "{not json"], r"bad.jsonl:2: not valid JSON"),
        (['{"text": 5}'], r"bad.jsonl:1: 'text' is a int, not a string"),
        (['["text"]'], r"bad.jsonl:1: a JSON list, not an object with a 'text' field"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, tokenizer, lines, message):
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        make_store(tmp_path / "bad.jsonl", tokenizer, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()  # a refused preparation leaves nothing behind


def test_path_type_and_empty_input_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"data path .*missing.txt does not exist"):
        make_store(tmp_path / "missing.txt", tokenizer, tmp_path / "out.bin")
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"table.csv: unknown kind of data file; use 'default', .txt"):
        make_store(tmp_path / "table.csv", tokenizer, tmp_path / "out.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data directory .*empty has no data files"):
        make_store(tmp_path / "empty", tokenizer, tmp_path / "out.bin")
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}])
    with pytest.raises(ValueError, match=r"no tokens: the data source .*empty.txt, .*blank.jsonl holds no text"):
        make_store([tmp_path / "empty.txt", tmp_path / "blank.jsonl"], tokenizer, tmp_path / "out.bin")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    # nothing of the refused empty input blocks other input
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8 text"):
        make_store(tmp_path / "latin1.txt", tokenizer, tmp_path / "out.bin")
    assert not list(tmp_path.rglob("store.json")) and not list(tmp_path.rglob("*.tokens"))


def test_a_failed_store_never_looks_complete_and_a_folder_holds_one_store(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "kept"}])
    before = make_store(good, tokenizer, tmp_path / "out.bin").array().tolist()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}] * 3 + [{"no": "text"}])
    with pytest.raises(ValueError, match="holds a store of other input"):
        make_store(bad, tokenizer, tmp_path / "out.bin")
    assert TokenStore(tmp_path / "out.bin").array().tolist() == before
    with pytest.raises(ValueError, match="bad.jsonl:4"):
        make_store(bad, tokenizer, tmp_path / "bad.bin")
    assert not (tmp_path / "bad.bin").exists()  # refused: no unfinished store whose advice would go in circles
    with pytest.raises(ValueError, match=r"bad.bin has no store.json: it is not a token store"):
        TokenStore(tmp_path / "bad.bin")


def test_streaming_keeps_memory_bounded(tmp_path, tokenizer, corpus_sample):
    text = "\n\n".join(corpus_sample)
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        for _ in range(8_000_000 // len(text) + 1):
            f.write(text)
    size = big.stat().st_size
    tracemalloc.start()
    try:
        tf = make_store(big, tokenizer, tmp_path / "big.bin")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tf.n_documents == 1 and tf.n_tokens > 1_000_000
    assert peak < size / 4, f"peak {peak / 1e6:.1f} MB of Python memory for a {size / 1e6:.1f} MB file"
    # Spot check: the start and the end match tokenising those parts directly.
    head = tokenizer.encode(text[:2000])
    assert tf.tokens[: len(head) - 5].tolist() == head[:-5]
    assert tf.tokens[tf.n_tokens - 1:][0] == tokenizer.eos_id


def test_a_store_is_read_only_checked_and_pickles_small(tmp_path, tokenizer):
    tf = make_store(write_jsonl(tmp_path / "d.jsonl", [{"text": "some words " * 200}]), tokenizer, tmp_path / "t")
    with pytest.raises(ValueError, match="read-only"):
        tf.tokens.shards[0][0] = 7
    clone = pickle.loads(pickle.dumps(tf))
    assert len(pickle.dumps(tf)) < 4000 and clone.array().tolist() == tf.array().tolist()

    shard = tmp_path / "t" / tf.shards[0]["name"]
    with open(shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"token store .*t is damaged: units/000000.train.0.tokens is 10 bytes, the "
                                         r"manifest records \d+; prepare it again"):
        TokenStore(tmp_path / "t")
    (tmp_path / "t" / "store.json").unlink()
    with pytest.raises(ValueError, match="has no store.json: its preparation has not finished"):
        TokenStore(tmp_path / "t")
    with pytest.raises(ValueError, match="nope has no store.json: it is not a token store"):
        TokenStore(tmp_path / "nope")


def test_default_source_is_the_embedded_corpus(tmp_path, tokenizer, monkeypatch):
    docs = list(default_corpus_documents(max_documents=30))
    monkeypatch.setattr(formats, "default_corpus_documents", lambda on_bytes=None: iter(docs))  # keep the test fast
    tf = make_store("default", tokenizer, tmp_path / "default.bin")
    assert tf.array().tolist() == expected_tokens(tokenizer, docs)
    assert [(f["kind"], f["corpus_id"]) for f in tf.meta["files"]] == [("default", default_corpus_id())]


class CountingTokenizer:
    """Wraps a tokenizer and counts encode calls, to tell a cache hit from a new preparation."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.vocab_size, self.eos_id, self.sha256, self.path = inner.vocab_size, inner.eos_id, inner.sha256, inner.path

    def encode_batch(self, texts):
        self.calls += 1
        return self.inner.encode_batch(texts)


def test_cached_store_reuses_until_source_or_tokenizer_change(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "cached text"}])
    cache = tmp_path / "cache"
    counting = CountingTokenizer(tokenizer)
    first, validation = cached_store(src, counting, cache, report=False)
    calls, mtime = counting.calls, (first.folder / "store.json").stat().st_mtime_ns
    assert validation is None and calls > 0 and first.array().tolist() == expected_tokens(tokenizer, ["cached text"])
    again, _ = cached_store(src, counting, cache, report=False)
    assert again.folder == first.folder and counting.calls == calls
    assert (first.folder / "store.json").stat().st_mtime_ns == mtime

    write_jsonl(src, [{"text": "edited text, longer"}])  # size and mtime change
    edited, _ = cached_store(src, counting, cache, report=False)
    assert edited.folder != first.folder and edited.array().tolist() == expected_tokens(tokenizer, ["edited text, longer"])

    other_tokenizer = CountingTokenizer(tokenizer)
    other_tokenizer.sha256 = "another-model"
    assert cached_store(src, other_tokenizer, cache, report=False)[0].folder != edited.folder

    # A store a killed job left unfinished (a unit without its record, no manifest) is finished, not trusted.
    (edited.folder / "store.json").unlink()
    (edited.folder / "units" / "000000.json").unlink()
    calls = counting.calls
    finished, _ = cached_store(src, counting, cache, report=False)
    assert finished.folder == edited.folder and counting.calls > calls
    assert finished.array().tolist() == edited.array().tolist()
