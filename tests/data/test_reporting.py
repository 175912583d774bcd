"""What preparing data says on stderr, and who says it: rank 0 reports a store's preparation (every
process takes units of it); a tokenizer is announced by the process that trains it, whatever its
rank; a process that finds the work done stays quiet."""

import json
import re
import threading
import time

from hybridpar.data import build_data, formats, load_or_train_tokenizer, prepare_store
from tests.data.conftest import SAMPLE_VOCAB
from tests.runs import make_config

PROGRESS = re.compile(r"preparing .*: [\d.]+ (B|KiB) of [\d.]+ KiB \(\d+%\), [\d.]+ (B|KiB|MiB)/s, [\d,]+ tokens/s"
                      r"(, about \d+ s left)? \[\d+ s\]")


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
    # no process group: this process is rank 0, and reports
    tf = prepare_store(files, tokenizer, tmp_path / "a", workers=1, progress_every=0.0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"preparing {files[0]}, {files[1]} into the token store {tmp_path / 'a'}"
    assert len(lines) >= 8 and all(PROGRESS.fullmatch(line) for line in lines[1:-1]), lines
    assert "(100%)" in lines[-2] and "(100%)" not in lines[-3]  # every byte of both files, once
    assert lines[-1].startswith(f"preparing {tmp_path / 'a'}: done, ")
    assert lines[-1].endswith(f" s: {tf.n_tokens:,} tokens")

    pretend_rank(monkeypatch, 1)
    assert prepare_store(files, tokenizer, tmp_path / "b", workers=1, progress_every=0.0).n_tokens == tf.n_tokens
    assert capsys.readouterr().err == ""


class HeldTokenizer:
    """Holds its first encode until released, keeping the lock of the unit it prepares taken meanwhile."""

    def __init__(self, inner):
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()
        self.vocab_size, self.eos_id, self.sha256, self.path = inner.vocab_size, inner.eos_id, inner.sha256, inner.path
        self.texts: list[str] = []

    def encode_batch(self, texts):
        self.texts += texts
        self.entered.set()
        assert self.release.wait(30)
        return self.inner.encode_batch(texts)


def test_processes_preparing_one_store_share_its_units_and_wait_for_each_other(tmp_path, tokenizer, corpus_sample,
                                                                              capsys):
    """Two preparations of one store at once (the ranks of a job): the second takes the units the
    first does not hold, then waits for the one it holds; both end with the same complete store."""
    files = sources(tmp_path, corpus_sample)
    held, found = HeldTokenizer(tokenizer), []
    kwargs = dict(workers=1, report=False, unit_bytes=4000)
    first = threading.Thread(target=lambda: found.append(prepare_store(files, held, tmp_path / "s", **kwargs)))
    first.start()
    assert held.entered.wait(30)  # the first holds unit 0, stopped inside it
    second = threading.Thread(target=lambda: found.append(prepare_store(files, tokenizer, tmp_path / "s", **kwargs)))
    second.start()
    deadline = time.monotonic() + 30
    units = len(json.loads((tmp_path / "s" / "plan.json").read_text())["units"]) if (tmp_path / "s" / "plan.json").exists() else 0
    while len(list((tmp_path / "s" / "units").glob("*.json"))) < units - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(list((tmp_path / "s" / "units").glob("*.json"))) == units - 1 > 1  # all but the held one
    assert second.is_alive()  # waiting for unit 0
    held.release.set()
    first.join(30)
    second.join(30)
    assert len(found) == 2 and found[0].array().tolist() == found[1].array().tolist()
    # The first made unit 0 (the .txt file) only: the second made every unit of the .jsonl file.
    # (its pieces, each continuation after a newline, and one newline alone: the separator's own ids)
    txt = files[0].read_text()
    assert len(txt) <= sum(map(len, held.texts)) <= len(txt) + len(held.texts), (len(txt), len(held.texts))
    alone = prepare_store(files, tokenizer, tmp_path / "alone", **kwargs)
    assert alone.array().tolist() == found[0].array().tolist()
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
    assert "sentencepiece is building" in err and "preparing" not in err  # rank 0 reports the store
    pretend_rank(monkeypatch, 0)
    build_data(config.data)  # everything cached: nothing to say
    assert capsys.readouterr().err == ""


def test_the_embedded_corpus_is_counted_against_its_own_size(tmp_path, monkeypatch):
    """A store of the embedded corpus says how far it is as a share of the corpus's source files:
    its plan's one unit records 0 bytes, which made the first word 1e9% ("1030480300.0% of the
    input": the bytes read over 1). Reading the unit counts up to exactly the total."""
    from hybridpar.data import corpus
    from hybridpar.data.sources import describe_input
    from hybridpar.data.store.unit_plan import plan_of
    from hybridpar.data.store.workers import _Counted, _StoreProgress
    from tests.data.stubs import NumberTokenizer

    few = corpus.stdlib_source_files()[:20]  # the corpus cut short: seconds, not a whole standard library
    monkeypatch.setattr(corpus, "stdlib_source_files", lambda root=None: few)
    plan = plan_of(describe_input("default"), NumberTokenizer(), tmp_path / "store")
    heard = []
    progress = _StoreProgress(plan, range(len(plan.units)), False, 5.0, heard.append)
    counted = _Counted(plan, progress)
    for parts in formats.unit_documents(plan.units[0], "text", on_bytes=lambda n: counted.read(0, n)):
        for _ in parts:
            pass
    shares = [float(re.search(r"([\d.]+)% of the input", text).group(1)) for text in heard]
    assert shares and 0 < shares[0] <= 100, heard
    assert progress.done == progress.total == sum(path.stat().st_size for path in few)
