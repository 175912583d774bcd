"""prepare with byte-level BPE tokenizers: token files equal the tokenizer's ids, long documents cut
in pieces too, the cache keyed by each tokenizer's sha256, uint32 files above 65,535 ids."""

import json

import numpy as np
import pytest

from hybridpar.data import Tokenizer, cached_store, formats, prepare_store, tokenise
from tests.data.bpe_files import MIXED_TEXT, write_wide_tiktoken_file


def expected_tokens(tokenizer, documents):
    return [i for doc in documents for i in tokenizer.encode(doc, eos=True)]


def make_store(source, tokenizer, out):
    return prepare_store(source, tokenizer, out, workers=1, report=False)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def check_file(name, token_file, expected):
    ours = token_file.array().tolist()
    mismatches = sum(a != b for a, b in zip(ours, expected)) + abs(len(ours) - len(expected))
    print(f"{name}: {len(expected)} ids compared, {mismatches} mismatches")
    assert mismatches == 0


@pytest.mark.parametrize("which", ["tiktoken", "huggingface"])
def test_token_file_equals_the_tokenizers_ids(which, tiktoken_tokenizer, hf_tokenizer, corpus_sample, tmp_path):
    tok = tiktoken_tokenizer if which == "tiktoken" else hf_tokenizer
    docs = corpus_sample[:30] + [MIXED_TEXT, "short", "line one\nline two"]
    tf = make_store(write_jsonl(tmp_path / "docs.jsonl", docs), tok, tmp_path / "out.bin")
    check_file(which, tf, expected_tokens(tok, docs))
    assert (tf.dtype, tf.vocab_size, tf.eos_id, tf.tokenizer_sha256) == (np.uint16, tok.vocab_size, tok.eos_id, tok.sha256)
    assert int((tf.array() == tok.eos_id).sum()) == len(docs)


@pytest.mark.parametrize("which", ["tiktoken", "huggingface"])
def test_long_documents_cut_in_pieces_tokenise_as_whole(which, tiktoken_tokenizer, hf_tokenizer, corpus_sample,
                                                        tmp_path, monkeypatch):
    # Tiny pieces: cuts land before blank lines, indented lines and after punctuation at line ends,
    # where the split pattern would join the newline to what follows.
    monkeypatch.setattr(formats, "PIECE_CHARS", 40)
    monkeypatch.setattr(tokenise, "BATCH_CHARS", 300)
    tok = tiktoken_tokenizer if which == "tiktoken" else hf_tokenizer
    long_doc = "\n".join(corpus_sample[:40]) + "\n\n  indented tail\n" + MIXED_TEXT * 3 + "end.\n\n\n \n  \nlast"
    (tmp_path / "long.txt").write_text(long_doc)
    src = write_jsonl(tmp_path / "long.jsonl", [long_doc, corpus_sample[41]])
    tf = make_store([tmp_path / "long.txt", src], tok, tmp_path / "out.bin")
    as_read = long_doc.replace("\r\n", "\n")  # a .txt is read with universal newlines
    check_file(f"{which}, cut in pieces", tf, expected_tokens(tok, [as_read, long_doc, corpus_sample[41]]))


def test_cache_is_keyed_by_the_tokenizer(tiktoken_tokenizer, hf_tokenizer, tokenizer, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["first document", MIXED_TEXT])
    files = {tok.kind: cached_store(src, tok, tmp_path / "cache", report=False)[0]
             for tok in (tiktoken_tokenizer, hf_tokenizer, tokenizer)}
    assert len({tf.folder for tf in files.values()}) == 3
    again, _ = cached_store(src, Tokenizer(tiktoken_tokenizer.path), tmp_path / "cache", report=False)
    assert again.folder == files["tiktoken"].folder and again.tokenizer_sha256 == tiktoken_tokenizer.sha256
    for kind, tok in [("tiktoken", tiktoken_tokenizer), ("huggingface", hf_tokenizer)]:
        assert files[kind].array().tolist() == expected_tokens(tok, ["first document", MIXED_TEXT])


def test_ids_above_65535_make_a_uint32_file(tmp_path):
    write_wide_tiktoken_file(tmp_path / "wide.model")
    tok = Tokenizer(tmp_path / "wide.model")
    docs = [MIXED_TEXT, "ÿ\x7f" * 20]
    tf = make_store(write_jsonl(tmp_path / "docs.jsonl", docs), tok, tmp_path / "wide.bin")
    expected = expected_tokens(tok, docs)
    assert tf.dtype == np.uint32 and max(expected) == tok.eos_id == 65_793
    assert sum(s["size"] for s in tf.shards) == 4 * len(expected)
    check_file("uint32", tf, expected)


def test_pieces_stay_bounded_without_a_preferred_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "PIECE_CHARS", 40)
    indented = "".join(f"    line {i}\n" for i in range(400))  # no line starts a chunk of its own
    (tmp_path / "indented.txt").write_text(indented)
    for pieces in (list(formats.cut(indented)), list(formats._txt_pieces(tmp_path / "indented.txt"))):
        assert "".join(pieces) == indented and len(pieces) > 1
        assert max(map(len, pieces)) <= formats._LONGEST_PIECE * 40 + len("    line 399\n")
