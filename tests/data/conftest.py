"""Fixtures for the data tests: a small slice of the embedded corpus and a tokenizer trained on it."""

import pytest

from hybridpar.data import default_corpus_documents, train_tokenizer

SAMPLE_DOCUMENTS = 300
SAMPLE_VOCAB = 600


@pytest.fixture(scope="session")
def corpus_sample() -> list[str]:
    return list(default_corpus_documents(max_documents=SAMPLE_DOCUMENTS))


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory, corpus_sample):
    """Trained once per session on the first few hundred docstrings (well under a second)."""
    return train_tokenizer(corpus_sample, SAMPLE_VOCAB, tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")
