"""One store, one input at a time: a preparation of other input into a store being prepared is
refused at once, one of the same input joins; every wait is bounded and says what it waits for;
a failed start leaves nothing; a finished store keeps no lock files; workers report from inside a unit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpar.data.store.token_store import MANIFEST, PLAN, StoreError, TokenStore
from hybridpar.data.tokenizer import Tokenizer
from hybridpar.data.sources import describe_input
from hybridpar.data.store.unit_plan import plan_of, preparing
from hybridpar.data.store.prepare import prepare_store
from hybridpar.files import file_lock
from tests.data.stubs import NumberTokenizer, SlowNumberTokenizer
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


def _numbers(path: Path, documents: int, words: int = 50, offset: int = 1) -> Path:
    path.write_text("".join(json.dumps({"text": " ".join(str(offset + (d + w) % 900) for w in range(words))}) + "\n"
                            for d in range(documents)))
    return path


def _locks(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.lock*"))


def test_another_input_is_refused_while_a_store_is_prepared_and_the_same_joins(tmp_path):
    a, b = _numbers(tmp_path / "a.jsonl", 200), _numbers(tmp_path / "b.jsonl", 200, offset=3)
    tokenizer, out = NumberTokenizer(), tmp_path / "store"
    with preparing(plan_of(describe_input(a), tokenizer, out, unit_bytes=4000)):  # another process preparing a, as it looks
        started = time.monotonic()
        with pytest.raises(StoreError) as refused:
            prepare_store(b, tokenizer, out, workers=1, unit_bytes=4000, report=False)
        assert time.monotonic() - started < 5
        message = str(refused.value)
        assert "\n" not in message and "being prepared from other input" in message
        assert str(a) in message and f"pid {os.getpid()}" in message and "another --out" in message
        assert json.loads((out / PLAN).read_text())["sources"]["files"][0]["path"] == str(a)  # not replaced
        joined = prepare_store(a, tokenizer, out, workers=1, unit_bytes=4000, report=False)  # the same input joins
        assert joined.n_documents == 200
        assert _locks(out)  # the other still holds the store: its lock stays until it leaves
    assert _locks(out) == []  # ... and goes with the last one out
    assert prepare_store(a, tokenizer, out, workers=1, unit_bytes=4000, report=False).n_documents == 200
    assert _locks(out) == []  # a finished store takes no lock
    with pytest.raises(StoreError, match="holds a store of other input"):
        prepare_store(b, tokenizer, out, workers=1, unit_bytes=4000, report=False)
    assert _locks(out) == []


def test_an_unfinished_store_of_other_input_is_refused_not_replaced(tmp_path):
    a, b = _numbers(tmp_path / "a.jsonl", 200), _numbers(tmp_path / "b.jsonl", 200, offset=3)
    tokenizer, out = NumberTokenizer(), tmp_path / "store"
    plan = plan_of(describe_input(a), tokenizer, out, unit_bytes=4000)
    with preparing(plan):
        pass  # a plan of a, nothing made of it yet: b may take the folder
    prepare_store(b, tokenizer, out, workers=1, part=(0, 2), unit_bytes=4000, report=False)  # half of b's units done
    units = sorted((out / "units").iterdir())
    with pytest.raises(StoreError) as refused:
        prepare_store(a, tokenizer, out, workers=1, unit_bytes=4000, report=False)
    assert "unfinished store of other input" in str(refused.value) and "delete" in str(refused.value)
    assert str(b) in str(refused.value)
    assert sorted((out / "units").iterdir()) == units  # nothing of b's deleted


def test_a_wait_for_a_unit_another_holds_is_said_and_bounded(tmp_path, monkeypatch, capsys):
    from hybridpar.data.store import workers as store_work
    from hybridpar.data.store.token_store import unit_record_name

    monkeypatch.setattr(store_work, "WAIT_WITHOUT_PROGRESS", 1.5)
    monkeypatch.setattr(store_work, "SAY_WAITING_EVERY", 0.3)
    source, tokenizer, out = _numbers(tmp_path / "a.jsonl", 200), NumberTokenizer(), tmp_path / "store"
    plan = plan_of(describe_input(source), tokenizer, out, unit_bytes=4000)
    with preparing(plan):
        lock = out / (unit_record_name(1) + ".lock")
        with file_lock(lock, purpose="a test holding unit 1"):
            lock.write_text("elsewhere pid 4242\n")
            started = time.monotonic()
            with pytest.raises(StoreError) as gave_up:
                prepare_store(source, tokenizer, out, workers=1, unit_bytes=4000, report=True)
            waited = time.monotonic() - started
    assert 1.5 <= waited < 10
    message = str(gave_up.value)
    assert "unit 1 held by elsewhere pid 4242" in message and "none finished" in message, message
    said = [line for line in capsys.readouterr().err.splitlines() if "waiting for unit 1" in line]
    assert len(said) >= 2 and "elsewhere pid 4242" in said[0], said
    assert not (out / MANIFEST).exists()


def test_bad_part_and_unit_size_leave_nothing(tmp_path, capsys):
    from hybridpar.cli import main

    source = _numbers(tmp_path / "a.jsonl", 20)
    (tmp_path / "tok").write_text("not needed: refused before it is read")
    expected = {"0/0": "N must be 1 or more", "2/2": "the part must be in 0..1", "x": "give I/N"}
    for part, said in expected.items():
        assert main(["prepare", str(source), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "s"),
                     "--part", part]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    for unit_mb in ("0", "-1", "0.001", "nan"):
        assert main(["prepare", str(source), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "s"),
                     "--unit-mb", unit_mb]) == 2
        err = capsys.readouterr().err.strip()
        assert "--unit-mb" in err and "at least 0.015625" in err and len(err.splitlines()) == 1, err
    with pytest.raises(ValueError, match="N must be 1 or more"):
        prepare_store(source, NumberTokenizer(), tmp_path / "s", workers=1, part=(0, 0), report=False)
    with pytest.raises(ValueError, match="0..2"):
        prepare_store(source, NumberTokenizer(), tmp_path / "s", workers=1, part=(3, 3), report=False)
    assert not (tmp_path / "s").exists()


def test_the_floor_unit_size_is_taken(tmp_path, tokenizer):
    """--unit-mb at its floor (1/64, 16 KiB) prepares, in several units."""
    from hybridpar.cli import main
    from hybridpar.data.store.prepare import MIN_UNIT_MB

    source = _numbers(tmp_path / "a.jsonl", 400)
    assert main(["prepare", str(source), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "s"),
                 "--workers", "1", "--unit-mb", "0.015625"]) == 0
    assert MIN_UNIT_MB == 0.015625 and TokenStore(tmp_path / "s").n_documents == 400
    assert len(json.loads((tmp_path / "s" / PLAN).read_text())["units"]) == -(-source.stat().st_size // 2**14)


@pytest.mark.slow
def test_two_prepares_of_different_input_into_one_out(tmp_path, tokenizer):
    """Started together as commands: one completes the store, the other is refused in one line
    within seconds (before: both looped at "100%" until killed)."""
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    for path, tag in ((a, "a"), (b, "b")):
        with open(path, "w") as f:
            for i in range(6000):
                f.write(json.dumps({"text": f"document {i} of {tag}: " + "some words to tokenise " * 10}) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
    procs = {}
    for name in (a, b):
        procs[name] = (time.monotonic(), subprocess.Popen(
            [sys.executable, "-m", "hybridpar", "prepare", str(name), "--tokenizer", str(tokenizer.path), "--out",
             str(tmp_path / "store"), "--workers", "2", "--unit-mb", "0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = {}
    for name, (started, proc) in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = (proc.returncode, out, err, time.monotonic() - started)
    won = [n for n, r in results.items() if r[0] == 0]
    lost = [n for n, r in results.items() if r[0] != 0]
    assert len(won) == 1 and len(lost) == 1, results
    code, _, err, seconds = results[lost[0]]
    errors = [line for line in err.splitlines() if line.startswith("hybridpar: error")]
    assert len(errors) == 1 and str(tmp_path / "store") in errors[0] and "other input" in errors[0], err
    print(f"\nrefused after {seconds:.1f} s (the other took {results[won[0]][3]:.1f} s): {errors[0]}")
    assert seconds < 20
    store = TokenStore(tmp_path / "store")
    assert store.meta["files"][0]["path"] == str(won[0]) and store.n_documents == 6000
    assert _locks(tmp_path / "store") == []


class _DyingNumberTokenizer(NumberTokenizer):
    """NumberTokenizer (the same sha256) whose worker process is killed as the out-of-memory killer
    kills (SIGKILL) when it meets the document that starts with `at`."""

    def __init__(self, at: str) -> None:
        super().__init__()
        self.at, self.parent = at, os.getpid()

    def encode_batch(self, texts):
        if os.getpid() != self.parent and any(text.startswith(self.at) for text in texts):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().encode_batch(texts)


def test_a_worker_killed_is_one_line_and_the_next_run_finishes_the_store(tmp_path):
    """A worker process killed mid-unit stops the preparation with a line that names it and says
    what to do (before: the process pool's BrokenProcessPool); the same preparation again goes on
    where it stopped, to the store one process makes."""
    source = _numbers(tmp_path / "a.jsonl", 400)
    unit_bytes = source.stat().st_size // 4 + 1  # four units; document 350 ("351 352 ...") is in the last
    with pytest.raises(Exception) as failed:
        prepare_store(source, _DyingNumberTokenizer("351 "), tmp_path / "s", workers=2, unit_bytes=unit_bytes,
                      report=False)
    assert isinstance(failed.value, StoreError) and re.fullmatch(
        rf"{re.escape(str(tmp_path / 's'))}: a preparation worker \(pid \d+\) died: killed by signal "
        rf"{int(signal.SIGKILL)} \(out of memory\?\); run again: it goes on where it stopped",
        str(failed.value)), repr(failed.value)
    assert not (tmp_path / "s" / MANIFEST).exists()
    again = prepare_store(source, NumberTokenizer(), tmp_path / "s", workers=2, unit_bytes=unit_bytes, report=False)
    once = prepare_store(source, NumberTokenizer(), tmp_path / "once", workers=1, unit_bytes=unit_bytes,
                         report=False)
    assert again.meta["parts"] == once.meta["parts"]  # the same shards, sizes and checksums
    assert _locks(tmp_path / "s") == []


def test_a_workers_error_that_does_not_pickle_reaches_the_parent_as_its_text():
    """The queue would drop an error it cannot pickle, and the parent never hear of the failure."""
    from hybridpar.data.store.workers import _portable

    refused = ValueError("the record at a.jsonl:3 is bad")
    assert _portable(refused) is refused
    unpicklable = ValueError("a tokenizer failed", lambda: None)
    carried = _portable(unpicklable)
    assert isinstance(carried, StoreError) and str(carried) == f"ValueError: {unpicklable}", repr(carried)


@pytest.mark.slow
def test_workers_say_how_far_they_are_inside_a_unit(tmp_path):
    """Two workers, two units of about ten batches each, a tokenizer taking 0.2 s a batch: tokens
    made are heard before any unit is done (before, only when a unit was)."""
    source = _numbers(tmp_path / "a.jsonl", 6000, words=120)  # ~2.9 MB, 11 batches a unit
    heard = []

    def on_progress(text: str) -> None:
        heard.append((len(list((tmp_path / "s" / "units").glob("*.json"))), text))

    unit_bytes = source.stat().st_size // 2 + 1
    store = prepare_store(source, SlowNumberTokenizer(0.2), tmp_path / "s", workers=2, unit_bytes=unit_bytes,
                          report=False, on_progress=on_progress)
    assert store.n_documents == 6000
    inside = [text for records, text in heard if records == 0 and " 0 tokens made" not in text]
    assert inside, heard


def test_the_store_keeps_its_tokenizer_absolute_and_checked_by_sha256(tmp_path, tokenizer, bpe_files, monkeypatch):
    """Prepared with a relative --tokenizer, a run started elsewhere finds it; a file at that path
    with another sha256 is refused naming both; a missing one says to set data.tokenizer."""
    import shutil
    from types import SimpleNamespace

    from hybridpar.cli import main
    from hybridpar.data import build_data

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    shutil.copy(tokenizer.path, work / "tok.model")
    _numbers(work / "a.jsonl", 100, offset=1)
    monkeypatch.chdir(work)
    assert main(["prepare", "a.jsonl", "--tokenizer", "tok.model", "--out", "store", "--workers", "1"]) == 0
    assert TokenStore(work / "store").meta["tokenizer_path"] == str(work / "tok.model")
    monkeypatch.chdir(elsewhere)
    d = SimpleNamespace(sources=[], source=str(work / "store"), tokenizer="", val_source="", val_fraction=0.0, seq_len=16,
                        text_field="text", cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=600,
                        on_bad_record="error", max_document_bytes=1 << 20, max_bad_records=0.01)
    assert build_data(d)[0].sha256 == tokenizer.sha256
    shutil.copy(bpe_files[0], work / "tok.model")  # another tokenizer at the recorded path
    with pytest.raises(ValueError) as other:
        build_data(d)
    assert f"sha256 {tokenizer.sha256[:12]}" in str(other.value) and str(work / "tok.model") in str(other.value)
    assert f"another (sha256 {Tokenizer(work / 'tok.model').sha256[:12]})" in str(other.value)
    (work / "tok.model").unlink()
    with pytest.raises(ValueError, match=r"tok.model is gone\): set data.tokenizer"):
        build_data(d)


def test_a_path_in_the_way_says_what_to_do(tmp_path, tokenizer, capsys):
    from hybridpar.cli import main

    source = _numbers(tmp_path / "a.jsonl", 20)
    (tmp_path / "afile").write_text("mine")
    for out, said in ((tmp_path / "afile", "is a file, not a store folder: give another path"),
                      (tmp_path / "afile" / "sub", "a part of that path is a file, not a folder: give another path")):
        assert main(["prepare", str(source), "--tokenizer", str(tokenizer.path), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "afile").read_text() == "mine"
    from hybridpar.files import refuse_occupied

    with pytest.raises(FileExistsError, match="afile already exists and is not a folder: move or delete it, or choose"):
        refuse_occupied(tmp_path / "afile", "replace it with --overwrite", overwrite=True)
