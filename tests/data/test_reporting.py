"""What preparing data says on stderr, and who says it: the process doing the work, whatever its
rank; a process that finds the work done, or waits for another to finish it, stays quiet."""

import json
import logging
import re
import threading
import time

from hybridpar.data import build_data, formats, load_or_train_tokenizer, prepare_cached, prepare_tokens
from tests.data.conftest import SAMPLE_VOCAB
from tests.runs import make_config

PROGRESS = re.compile(r"tokenising: [\d.]+ (B|KiB) of [\d.]+ KiB \(\d+%\)(, about \d+ s left)? \[\d+ s\]")


def sources(tmp_path, corpus_sample):
    """A .txt and a .jsonl file, each a few times the 8 KiB that a text file reads at once."""
    txt = tmp_path / "long.txt"
    txt.write_text("\n".join(corpus_sample[:150]) + "\n")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in corpus_sample[150:]))
    return [txt, jsonl]


def pretend_rank(monkeypatch, rank):
    monkeypatch.setattr("hybridpar.progress._rank", lambda: rank)


def test_progress_on_the_reporting_process_and_nothing_on_the_others(tmp_path, tokenizer, corpus_sample,
                                                                     capsys, monkeypatch):
    monkeypatch.setattr(formats, "PIECE_CHARS", 2000)  # the .txt file is read in several pieces
    files = sources(tmp_path, corpus_sample)
    tf = prepare_tokens(files, tokenizer, tmp_path / "a.bin", progress_every=0.0)  # no group: rank 0 reports
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"tokenising {files[0]}, {files[1]} into {tmp_path / 'a.bin'}"
    assert len(lines) >= 8 and all(PROGRESS.fullmatch(line) for line in lines[1:-1]), lines
    assert "(100%)" in lines[-2] and "(100%)" not in lines[-3]  # every byte of both files, once
    assert lines[-1].startswith("tokenising: done, ")
    assert lines[-1].endswith(f" s: {tf.n_tokens:,} tokens in {tf.n_documents:,} documents")

    pretend_rank(monkeypatch, 1)
    assert prepare_tokens(files, tokenizer, tmp_path / "b.bin", progress_every=0.0).n_tokens == tf.n_tokens
    assert capsys.readouterr().err == ""


class HeldTokenizer:
    """Holds its first encode until released, keeping prepare_cached's lock taken meanwhile."""

    def __init__(self, inner):
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()
        self.vocab_size, self.eos_id, self.sha256, self.path = inner.vocab_size, inner.eos_id, inner.sha256, inner.path

    def encode_batch(self, texts):
        self.entered.set()
        assert self.release.wait(30)
        return self.inner.encode_batch(texts)


def test_the_preparing_process_reports_whatever_its_rank_and_waiting_ones_stay_quiet(
        tmp_path, tokenizer, corpus_sample, capsys, caplog, monkeypatch):
    files, cache = sources(tmp_path, corpus_sample), tmp_path / "cache"
    pretend_rank(monkeypatch, 3)  # the first process to take the lock need not be rank 0
    first = prepare_cached(files, tokenizer, cache, progress_every=0.0)
    err = capsys.readouterr().err
    assert f"into {first.path}, once: later runs reuse it\n" in err and "tokenising: done" in err

    assert prepare_cached(files, tokenizer, cache, progress_every=0.0).path == first.path  # found: quiet
    assert capsys.readouterr().err == ""

    # One process prepares (quietly here), another waits for its lock and then finds the file.
    caplog.set_level(logging.INFO, logger="hybridpar.files")
    held, found = HeldTokenizer(tokenizer), []
    preparer = threading.Thread(target=prepare_cached, args=(files[:1], held, cache), kwargs={"report": False})
    preparer.start()
    assert held.entered.wait(30)
    waiter = threading.Thread(target=lambda: found.append(prepare_cached(files[:1], tokenizer, cache,
                                                                         progress_every=0.0)))
    waiter.start()
    deadline = time.monotonic() + 30
    while "another process is preparing it" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    held.release.set()
    preparer.join(30)
    waiter.join(30)
    assert "another process is preparing it" in caplog.text and len(found) == 1
    assert capsys.readouterr().err == ""


def test_training_a_tokenizer_says_so_once(tmp_path, corpus_sample, capsys):
    kwargs = dict(vocab_size=SAMPLE_VOCAB, documents_factory=lambda: iter(corpus_sample), corpus_id="sample",
                  cache_dir=tmp_path, corpus_name="the sample")
    tok = load_or_train_tokenizer(None, **kwargs)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"training a {SAMPLE_VOCAB}-token sentencepiece tokenizer on the sample, "
                        f"once: later runs reuse {tok.path}")
    assert re.fullmatch(rf"tokenizer: [\d,]+ lines of text read; sentencepiece is building the {SAMPLE_VOCAB}-token "
                        r"vocabulary", lines[1]) and len(lines) == 2
    load_or_train_tokenizer(None, **kwargs)
    assert capsys.readouterr().err == ""


def test_the_trainer_data_speaks_from_the_process_that_prepares(corpus, tmp_path, capsys, monkeypatch):
    config = make_config({**corpus, "cache_dir": str(tmp_path / "cache")}, tmp_path / "run")
    pretend_rank(monkeypatch, 2)
    build_data(config.data)
    err = capsys.readouterr().err
    assert "training a 512-token sentencepiece tokenizer on " + corpus["source"] in err
    assert "sentencepiece is building" in err and ", once: later runs reuse it\n" in err
    pretend_rank(monkeypatch, 0)
    build_data(config.data)  # everything cached: nothing to say
    assert capsys.readouterr().err == ""
