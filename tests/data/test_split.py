"""data.val_fraction: documents go whole to training or validation, never to both."""

import collections
import json

import numpy as np
import pytest

from hybridpar.data import cached_store
from hybridpar.data.formats import PIECE_CHARS
from tests.data.stubs import NumberTokenizer


def split(source, tokenizer, cache, fraction):
    return cached_store(source, tokenizer, cache, val_fraction=fraction, report=False)


def _documents(token_file) -> list[tuple[int, ...]]:
    """The documents of a store's part: its tokens cut after each EOS."""
    tokens = token_file.array().astype(np.int64)
    ends = np.flatnonzero(tokens == token_file.eos_id)
    assert len(ends) == token_file.n_documents and ends[-1] == len(tokens) - 1
    return [tuple(doc) for doc in np.split(tokens, ends + 1)[:-1]]


def test_every_document_lands_whole_in_one_split(corpus_sample, tokenizer, tmp_path):
    documents = corpus_sample + corpus_sample[:20]  # 20 documents twice: copies must land together
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    train, validation = split(source, tokenizer, tmp_path / "cache", 0.2)
    expected = collections.Counter(tuple(ids) + (tokenizer.eos_id,) for ids in tokenizer.encode_batch(
        [d for d in documents if d]))
    got_train, got_val = collections.Counter(_documents(train)), collections.Counter(_documents(validation))
    print(f"\n{sum(got_train.values())} training and {sum(got_val.values())} validation documents "
          f"({sum(got_val.values()) / len(documents):.1%}, asked 20%)")
    assert not set(got_train) & set(got_val), "a document is in both splits"
    assert got_train + got_val == expected  # each document once, whole, in exactly one split
    assert 0.1 < sum(got_val.values()) / len(documents) < 0.3
    assert validation.part == "validation" and validation.meta["val_fraction"] == 0.2
    # The split is the same whatever the order of the documents (it follows the text).
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(json.dumps({"text": d}) + "\n" for d in reversed(documents)))
    _, validation_again = split(shuffled, tokenizer, tmp_path / "cache", 0.2)
    assert collections.Counter(_documents(validation_again)) == got_val


def test_a_long_document_is_not_cut_between_the_splits(tmp_path):
    """A document of many pieces (longer than PIECE_CHARS) goes to one side with all its pieces."""
    numbers = NumberTokenizer(vocab_size=60_000)
    long_doc = "\n".join(" ".join(str(1 + (i * 10 + j) % 59_000) for j in range(10)) for i in range(8_000))
    assert len(long_doc) > 3 * PIECE_CHARS
    short = [" ".join(str(1 + (k * 7 + j) % 59_000) for j in range(5)) for k in range(400)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in [long_doc] + short))
    train, validation = split(source, numbers, tmp_path / "cache", 0.3)
    long_ids = tuple(int(w) for w in long_doc.split()) + (0,)
    found = {part: long_ids in _documents(f) for part, f in (("train", train), ("validation", validation))}
    print(f"\nthe {len(long_doc):,}-character document is in {[p for p, yes in found.items() if yes]}")
    assert sum(found.values()) == 1, found
    assert train.n_documents + validation.n_documents == 401


def test_the_split_is_cached_and_unsplit_data_is_untouched(corpus_sample, tokenizer, tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_sample))
    whole, none = cached_store(source, tokenizer, tmp_path / "cache", report=False)
    train, validation = split(source, tokenizer, tmp_path / "cache", 0.1)
    assert none is None and train.n_tokens + validation.n_tokens == whole.n_tokens
    again = split(source, tokenizer, tmp_path / "cache", 0.1)
    assert [(f.folder, f.part) for f in again] == [(train.folder, "train"), (validation.folder, "validation")]
    assert split(source, tokenizer, tmp_path / "cache", 0.2)[1].folder != validation.folder


@pytest.mark.parametrize("fraction, message", [(1e-9, "put none of the .* documents .* in validation: raise it"),
                                               (1 - 1e-9, "put all .* documents .* in validation: lower it")])
def test_a_split_with_an_empty_side_is_refused(corpus_sample, tokenizer, tmp_path, fraction, message):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_sample[:50]))
    with pytest.raises(ValueError, match=message):
        split(source, tokenizer, tmp_path / "cache", fraction)
    assert not list((tmp_path / "cache").rglob("store.json"))  # nothing that looks complete
