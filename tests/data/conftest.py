"""Fixtures for the data tests: a slice of the embedded corpus, a sentencepiece tokenizer trained on it,
and byte-level BPE files (tokenizer.json and a Llama 3-style tiktoken file) trained on it too."""

import pytest

from hybridpar.data import Tokenizer, default_corpus_documents, train_tokenizer
from tests.data.bpe_files import MIXED_TEXT, train_hf_bpe, write_tiktoken_file

SAMPLE_DOCUMENTS = 300
SAMPLE_VOCAB = 600
BPE_VOCAB = 1000


@pytest.fixture(scope="session")
def corpus_sample() -> list[str]:
    return list(default_corpus_documents(max_documents=SAMPLE_DOCUMENTS))


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory, corpus_sample):
    """Trained once per session on the first few hundred docstrings (well under a second)."""
    return train_tokenizer(corpus_sample, SAMPLE_VOCAB, tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")


@pytest.fixture(scope="session")
def bpe_files(tmp_path_factory, corpus_sample):
    """(tokenizer.json path, tiktoken file path, number of BPE ranks), trained once per session."""
    folder = tmp_path_factory.mktemp("bpe")
    hf, n_words = train_hf_bpe(corpus_sample[:150] + [MIXED_TEXT] * 3, BPE_VOCAB)
    (folder / "hf").mkdir()
    (folder / "original").mkdir()
    hf.save(str(folder / "hf" / "tokenizer.json"))
    assert write_tiktoken_file(hf, folder / "original" / "tokenizer.model") == n_words
    return folder / "hf" / "tokenizer.json", folder / "original" / "tokenizer.model", n_words


@pytest.fixture(scope="session")
def tiktoken_tokenizer(bpe_files):
    return Tokenizer(bpe_files[1])


@pytest.fixture(scope="session")
def hf_tokenizer(bpe_files):
    return Tokenizer(bpe_files[0])
