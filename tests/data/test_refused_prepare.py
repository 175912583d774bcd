"""Advice that works as said: a damaged store prepared again is repaired in place and verifies clean;
a refused preparation leaves nothing that blocks the next correct command; a store is never read
as raw text; `hybridpar verify` of something else says what it takes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hybridpar.cli import main
from hybridpar.data.store.token_store import DAMAGED, MANIFEST, TokenStore
from hybridpar.data.store.integrity import verify_store
from hybridpar.data.streams import DataFormatError


@pytest.fixture
def corpus(tmp_path, corpus_sample):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_sample))
    return path


def _prepare(source, tokenizer, out, *more: str) -> int:
    return main(["prepare", *map(str, source if isinstance(source, list) else [source]), "--tokenizer",
                 str(tokenizer.path), "--out", str(out), "--workers", "1", "--unit-mb", "0.02", *more])


def _damage(store, how: str) -> None:
    shards = sorted(store.glob("units/*.tokens"))
    if how == "sums deleted":
        shards[1].with_suffix(".sums").unlink()
    elif how == "sums truncated":
        sums = shards[1].with_suffix(".sums")
        sums.write_bytes(sums.read_bytes()[:2])
    elif how == "token bytes flipped":
        data = bytearray(shards[2].read_bytes())
        data[100] ^= 0xFF
        shards[2].write_bytes(data)
    elif how == "shard and record deleted":
        shards[0].unlink()
        (store / "units" / "000003.json").unlink()
    else:  # the manifest cut short
        manifest = store / MANIFEST
        manifest.write_text(manifest.read_text()[:100])


@pytest.mark.parametrize("how", ["sums deleted", "sums truncated", "token bytes flipped", "shard and record deleted",
                                 "manifest cut short"])
def test_a_damaged_store_prepared_again_is_repaired_and_verifies_clean(how, corpus, tokenizer, tmp_path, capsys):
    """Verify and training said "damaged ... prepare it again", and the same prepare again said
    "complete" having checked nothing: now it checks every chunk and makes the damaged units again."""
    store = tmp_path / "store"
    assert _prepare(corpus, tokenizer, store) == 0
    before = TokenStore(store).array().copy()
    assert len(list(store.glob("units/*.json"))) > 3
    _damage(store, how)
    assert verify_store(store) == 1
    capsys.readouterr()
    assert _prepare(corpus, tokenizer, store) == 0
    said = capsys.readouterr()
    assert f"{store} is damaged (" in said.err and "its manifest" in said.err, said.err
    assert f"{store}: complete, {len(before):,} tokens" in said.out
    assert verify_store(store) == 0
    assert np.array_equal(TokenStore(store).array(), before)
    assert not list(store.glob("**/*.lock"))  # a complete store holds no lock file
    assert _prepare(corpus, tokenizer, store) == 0  # whole now: checked, and nothing made again
    said = capsys.readouterr()
    assert "damaged" not in said.err and "preparing" not in said.err.replace(f"checking the complete store {store}", "")


def test_a_refused_empty_input_leaves_nothing_and_the_fixed_input_prepares(tmp_path, tokenizer, corpus_sample,
                                                                          capsys):
    """An empty .jsonl was refused, leaving an unfinished store; the same command after the input
    was fixed was refused ("unfinished store of other input"), and training on it advised "run the
    same prepare again", which failed again."""
    source, store = tmp_path / "d.jsonl", tmp_path / "store"
    source.write_text("")
    assert _prepare(source, tokenizer, store) == 2
    assert "no tokens: the data source" in capsys.readouterr().err
    assert not store.exists()
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_sample[:20]))
    assert _prepare(source, tokenizer, store) == 0 and TokenStore(store).n_documents == 20

    kept = tmp_path / "kept"  # a folder the user made: the store's files go, the folder stays
    kept.mkdir()
    assert _prepare(source, tokenizer, kept, "--val-fraction", "0.999") == 2
    assert "data.val_fraction = 0.999 put all of the 20 documents" in capsys.readouterr().err
    assert kept.is_dir() and not list(kept.iterdir())
    assert _prepare(source, tokenizer, kept, "--val-fraction", "0.2") == 0
    assert TokenStore(kept, "validation").n_documents > 0


def test_a_refused_input_leaves_nothing_in_the_cache(tmp_path, tokenizer, corpus_sample):
    from hybridpar.data import build_data

    source = tmp_path / "d.jsonl"
    source.write_text(json.dumps({"text": ""}) + "\n")
    d = SimpleNamespace(sources=[], source=str(source), tokenizer=str(tokenizer.path), val_source="", val_fraction=0.0,
                        seq_len=8, text_field="text", cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=600,
                        on_bad_record="error", max_document_bytes=1 << 20, max_bad_records=0.01)
    with pytest.raises(ValueError, match="no tokens: the data source .*d.jsonl holds no text"):
        build_data(d)
    assert not list((tmp_path / "cache").iterdir())
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_sample[:20]))
    assert build_data(d)[1].token_file.n_documents == 20


def test_a_store_inside_a_data_folder_or_given_to_prepare_is_named(corpus, tokenizer, tmp_path, capsys):
    """A store in a data.source folder was skipped silently (a tokenizer trained on the raw file
    beside it alone), and `prepare STORE raw.jsonl` said "STORE has no data files"."""
    from hybridpar.data import build_data

    folder = tmp_path / "mixed"
    folder.mkdir()
    assert _prepare(corpus, tokenizer, folder / "store") == 0
    (folder / "b.jsonl").write_text(json.dumps({"text": "raw text beside the store"}) + "\n")
    d = SimpleNamespace(sources=[], source=str(folder), tokenizer="", val_source="", val_fraction=0.0, seq_len=8,
                        text_field="text", cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=600,
                        on_bad_record="error", max_document_bytes=1 << 20, max_bad_records=0.01)
    with pytest.raises(DataFormatError, match=r"the data folder .*mixed holds the token store .*mixed/store, which is "
                                              r"never read as raw text: move it out of the folder; with raw files, "
                                              r"make the two a blend, each a source of its own \(data.sources"):
        build_data(d)
    capsys.readouterr()
    assert _prepare([folder / "store", folder / "b.jsonl"], tokenizer, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridpar: error: {folder / 'store'} is a token store (prepared "
                                               f"already), not raw text to prepare: train on it as it is"), err
    assert "data.sources" in err[0] and not (tmp_path / "out").exists()


def test_verify_of_neither_a_checkpoint_nor_a_store_is_one_error_line(corpus, tmp_path, capsys):
    assert main(["verify", str(corpus)]) == 2  # the usage code, not 1 ("damaged")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hybridpar: error: hybridpar verify {corpus}: a file, neither a checkpoint nor a token store; "
                   "give a checkpoint folder (checkpoints/step-00000100), a run's checkpoints/ folder or a token store "
                   "(hybridpar prepare's --out)"], err
    (tmp_path / "notes").mkdir()
    assert main(["verify", str(tmp_path / "notes")]) == 2
    assert "nor a token store; give one of those" in capsys.readouterr().err


def _case_train_on_its_cache(source: str, cache: str, run_dir: str, tokenizer: str) -> dict:
    """Two steps through data.source (the store prepared in the job's own cache): the steps trained,
    or what the rank raised."""
    from hybridpar.mesh.ranks import raised_by_every_rank
    from hybridpar.train import Trainer
    from tests.runs import make_config

    config = make_config({"source": source, "cache_dir": cache}, run_dir, steps=2,
                         **{"data.tokenizer": tokenizer, "data.val_fraction": 0.0, "model.vocab_size": 1024})
    try:
        return {"steps": len(Trainer(config).run()), "raised": None}
    except Exception as err:  # noqa: BLE001 - what the rank met goes back to the test
        return {"steps": 0, "raised": (type(err).__name__, str(err), raised_by_every_rank(err))}


@pytest.mark.slow
def test_a_damaged_store_in_a_jobs_cache_is_repaired_by_the_same_command_again(workers, corpus, tokenizer, tmp_path):
    """Training on a store it prepared in its cache said "prepare it again", and the same command
    again took the cached store unchecked and failed the same way: the damage is recorded in the
    store now, and the next start checks it and makes the damaged unit again."""
    cache, run = tmp_path / "cache", workers(1).run
    job = (str(corpus), str(cache), str(tmp_path / "run"), str(tokenizer.path))
    assert run(_case_train_on_its_cache, *job)[0] == {"steps": 2, "raised": None}
    [store] = cache.glob("store-*")
    before = TokenStore(store).array().copy()
    shards = sorted(store.glob("units/*.tokens"))
    for shard in shards:  # every shard's first chunk: whichever window the job reads first meets the damage
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(data)

    failed = run(_case_train_on_its_cache, *job)[0]
    kind, line, every_rank = failed["raised"]
    assert kind == "StoreDamagedError" and every_rank and "\n" not in line, failed
    assert line.startswith(f"token store {store} is damaged: {store}/units/"), line
    assert (f"; it is this job's data cache of data.source: run the same command again, its start checks the store and "
            f"prepares the damaged units again (hybridpar verify {store} lists every damaged chunk). Stopped before "
            f"step 1 trained") in line, line
    recorded = json.loads((store / DAMAGED).read_text())
    assert line.startswith(recorded["damage"]), recorded

    assert run(_case_train_on_its_cache, *job)[0] == {"steps": 2, "raised": None}  # the same command, again
    assert not (store / DAMAGED).exists() and verify_store(store) == 0
    assert np.array_equal(TokenStore(store).array(), before)


def test_damage_that_cannot_be_recorded_says_to_delete_the_cached_store(corpus, tokenizer, tmp_path, monkeypatch):
    """A cache folder this process may not write in: the damage stays the error, with advice that works."""
    from hybridpar.data.store import token_store as store_module
    from hybridpar.data.store.token_store import StoreDamagedError
    from hybridpar.data.store.prepare import cached_store

    train, _ = cached_store(corpus, tokenizer, tmp_path / "cache", report=False)
    unwritable = PermissionError(13, "Permission denied")
    monkeypatch.setattr(store_module, "write_text_atomic", lambda *a: (_ for _ in ()).throw(unwritable))
    error = train.damaged(StoreDamagedError, "units/000000.train.0.tokens, byte 100: what")
    assert str(error) == (f"token store {train.folder} is damaged: units/000000.train.0.tokens, byte 100: what; it is "
                          f"this job's data cache of data.source, and the damage could not be recorded in it for the "
                          f"next start to repair: delete {train.folder} and run the same command again")
    assert not (train.folder / DAMAGED).exists()
    given = TokenStore(train.folder)  # a store the user prepared (--out): its own command repairs it
    assert str(given.damaged(StoreDamagedError, "x")).endswith(
        f"; prepare it again (the same hybridpar prepare repairs it in place; hybridpar verify {train.folder} lists "
        f"every damaged chunk)")
