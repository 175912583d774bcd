"""Tokenizer: Llama 2 id conventions, exact round trips, training, the cache and its lock."""

import multiprocessing
import os
import time

import pytest

from hybridpar.data import Tokenizer, load_or_train_tokenizer, train_tokenizer
from hybridpar.data.tokenizer import cached_tokenizer_path
from tests.data.conftest import SAMPLE_VOCAB

TRICKY = [
    "Return the sum of *a* and *b*.",
    "Indented:\n    code = 1  # two  spaces\n\n\ttab\r\nend",
    "naïve café, 東京, emoji 🙂 and digits 1234567890",
    "",
    " leading and trailing spaces ",
]


def test_llama2_id_conventions(tokenizer):
    assert (tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 2, -1)
    assert tokenizer.vocab_size == SAMPLE_VOCAB
    assert [tokenizer.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    ids = tokenizer.encode("hello world")
    assert tokenizer.encode("hello world", bos=True, eos=True) == [1] + ids + [2]
    assert tokenizer.encode("hello world", eos=True) == ids + [2]
    assert all(3 <= i < tokenizer.vocab_size for i in ids)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_id not in ids  # byte fallback: nothing is unknown


def test_round_trip_over_corpus_and_batch_matches_single(tokenizer, corpus_sample):
    docs = corpus_sample[:100]
    batch = tokenizer.encode_batch(docs)
    assert batch == [tokenizer.encode(d) for d in docs]
    assert [tokenizer.decode(ids) for ids in batch] == docs
    assert tokenizer.encode_batch(["a b", "c"], eos=True) == [tokenizer.encode("a b") + [2], tokenizer.encode("c") + [2]]
    assert tokenizer.encode_batch([]) == []


def test_decode_accepts_arrays_and_tensors(tokenizer):
    import numpy as np
    import torch

    ids = tokenizer.encode("some text to decode")
    assert tokenizer.decode(np.array(ids, dtype=np.uint16)) == tokenizer.decode(torch.tensor(ids)) == "some text to decode"


def test_pickles_by_path(tokenizer):
    import pickle

    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.path == tokenizer.path and copy.encode("pickled text") == tokenizer.encode("pickled text")


def test_missing_directory_and_invalid_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer model .*nope.model does not exist"):
        Tokenizer(tmp_path / "nope.model")
    with pytest.raises(IsADirectoryError, match="is a directory; pass the tokenizer.model file inside it"):
        Tokenizer(tmp_path)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a sentencepiece model" * 10)
    with pytest.raises(ValueError, match=r"garbage.model is not a valid sentencepiece model"):
        Tokenizer(garbage)


def test_training_is_deterministic(tmp_path, corpus_sample, tokenizer):
    again = train_tokenizer(corpus_sample, SAMPLE_VOCAB, tmp_path / "again.model")
    assert again.path.read_bytes() == tokenizer.path.read_bytes()
    assert again.sha256 == tokenizer.sha256


def test_training_error_names_the_vocab_size(tmp_path, corpus_sample):
    with pytest.raises(ValueError, match=r"could not train a tokenizer of vocab_size 50000 on \d+ lines"):
        train_tokenizer(corpus_sample[:20], 50_000, tmp_path / "too_big.model")
    with pytest.raises(ValueError, match="the documents hold no text"):
        train_tokenizer(["", "   \n  "], 600, tmp_path / "empty.model")
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


def test_training_failure_leaves_an_existing_model_untouched(tmp_path, corpus_sample, tokenizer):
    target = tmp_path / "tokenizer.model"
    target.write_bytes(tokenizer.path.read_bytes())
    with pytest.raises(ValueError):
        train_tokenizer(corpus_sample[:20], 50_000, target)
    assert target.read_bytes() == tokenizer.path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.model"]


class CountingCorpus:
    def __init__(self, documents):
        self.documents, self.calls = documents, 0

    def __call__(self):
        self.calls += 1
        return iter(self.documents)


def test_cache_trains_once_then_reuses(tmp_path, corpus_sample, tokenizer):
    factory = CountingCorpus(corpus_sample)
    kwargs = dict(vocab_size=SAMPLE_VOCAB, documents_factory=factory, corpus_id="sample-300", cache_dir=tmp_path)
    first = load_or_train_tokenizer(None, **kwargs)
    assert factory.calls == 1 and first.path.parent == tmp_path
    assert first.path.read_bytes() == tokenizer.path.read_bytes()
    mtime = first.path.stat().st_mtime_ns
    second = load_or_train_tokenizer(None, **kwargs)
    assert factory.calls == 1 and second.path == first.path and second.path.stat().st_mtime_ns == mtime
    # Another vocab size or corpus is another cache entry.
    other = load_or_train_tokenizer(None, **{**kwargs, "vocab_size": SAMPLE_VOCAB + 100})
    assert factory.calls == 2 and other.path != first.path and other.vocab_size == SAMPLE_VOCAB + 100
    assert cached_tokenizer_path(tmp_path, corpus_id="other", vocab_size=SAMPLE_VOCAB) != first.path


def test_given_path_is_loaded_as_it_is(tmp_path, tokenizer):
    factory = CountingCorpus([])
    loaded = load_or_train_tokenizer(tokenizer.path, vocab_size=32000, documents_factory=factory, corpus_id="x", cache_dir=tmp_path)
    assert factory.calls == 0 and loaded.path == tokenizer.path and loaded.vocab_size == SAMPLE_VOCAB
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_or_train_tokenizer(tmp_path / "missing.model", vocab_size=600, documents_factory=factory, corpus_id="x", cache_dir=tmp_path)
    assert factory.calls == 0


def _train_in_child(cache_dir: str, log_path: str, documents: list) -> str:
    def factory():
        with open(log_path, "a") as log:  # one line per training, across processes
            log.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # widen the race: without the lock every process would train
        return iter(documents)

    tok = load_or_train_tokenizer(None, vocab_size=SAMPLE_VOCAB, documents_factory=factory, corpus_id="race", cache_dir=cache_dir)
    return tok.sha256


def test_concurrent_ranks_train_once(tmp_path, corpus_sample):
    log_path = tmp_path / "trainings.log"
    cache = tmp_path / "cache"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        hashes = pool.starmap(_train_in_child, [(str(cache), str(log_path), corpus_sample)] * 4)
    assert len(set(hashes)) == 1
    assert len(log_path.read_text().splitlines()) == 1
    names = sorted(p.name for p in cache.iterdir())
    assert len(names) == 2 and names[0].endswith(".model") and names[1].endswith(".model.lock")


def test_a_thread_limit_belongs_to_the_tokenizer_it_was_set_on(tokenizer, monkeypatch):
    """A preparation worker limits its tokenizer to one thread; another tokenizer of the same process
    keeps the library's default, and a copy sent to a worker keeps the limit."""
    import pickle

    from hybridpar.data.tokenizer import limit_threads

    for name in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):  # put back after the test
        monkeypatch.delenv(name, raising=False)
    limited, other = Tokenizer(tokenizer.path), Tokenizer(tokenizer.path)
    limit_threads(limited, 1)
    copy = pickle.loads(pickle.dumps(limited))
    asked = []
    for each in (limited, other, copy):
        monkeypatch.setattr(each._impl, "encode_batch_numpy",
                            lambda texts, threads: asked.append(threads) or [[len(t)] for t in texts])
        assert each.encode_batch_numpy(["one text"]) == [[8]]
    assert asked == [1, None, 1]
    assert os.environ["RAYON_NUM_THREADS"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "false"
