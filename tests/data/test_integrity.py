"""No byte trains unchecked: chunk checksums and the vocabulary checked as windows are read, the
manifest checked at open, `hybridpar verify` in parallel; a damaged store stops training before the
damaged batch trains, with the last good step saved; data.on_exhausted = "stop" saves where it stops."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar.data.chunks import CHUNK_BYTES
from hybridpar.data.store.token_store import MANIFEST, StoreDamagedError, StoreError, TokenStore
from hybridpar.data.store.prepare import prepare_store
from hybridpar.data.store.integrity import verify_store
from tests.runs import GLOBAL_BATCH, make_config
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store_folder(tmp_path_factory, tokenizer):
    """A store of three and a bit chunks (the last one short), made once; tests damage copies."""
    from hybridpar.data import default_corpus_documents

    root = tmp_path_factory.mktemp("integrity")
    with open(root / "docs.jsonl", "w") as f:
        for doc in default_corpus_documents(max_documents=600):
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_store(str(root / "docs.jsonl"), tokenizer, root / "store", workers=1, report=False)
    return root / "store"


@pytest.fixture
def store(store_folder, tmp_path) -> Path:
    shutil.copytree(store_folder, tmp_path / "store")
    return tmp_path / "store"


def _flip(path: Path, offset: int, value: int = None) -> None:
    data = bytearray(path.read_bytes())
    data[offset] = data[offset] ^ 1 if value is None else value
    path.write_bytes(bytes(data))


def _edit(store: Path, change) -> None:
    manifest = json.loads((store / MANIFEST).read_text())
    change(manifest)
    (store / MANIFEST).write_text(json.dumps(manifest))


def _verify(store: Path) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-m", "hybridpar", "verify", str(store)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()})
    return run.returncode, run.stdout + run.stderr


def test_a_flipped_byte_is_found_where_it_is_read_and_by_verify(store):
    shards = TokenStore(store).shards
    assert shards[0]["size"] > 2 * CHUNK_BYTES, "the test wants a shard of several chunks"
    path = store / shards[0]["name"]
    offset = CHUNK_BYTES + 1001  # in the second chunk, a token kept inside the vocabulary (its low bit)
    _flip(path, offset - 1)
    tokens = TokenStore(store).tokens
    assert tokens[0:100].shape == (100,)  # the first chunk is intact and reads
    with pytest.raises(StoreDamagedError) as caught:
        tokens[CHUNK_BYTES // 2 + 10:CHUNK_BYTES // 2 + 20]
    message = str(caught.value)
    print(f"\n{message}")
    assert "\n" not in message and f"{path}, bytes {CHUNK_BYTES}..{2 * CHUNK_BYTES - 1}: its bytes do not match" in message
    code, out = _verify(store)
    print(out)
    assert code == 1 and f"{path}, bytes {CHUNK_BYTES}..{2 * CHUNK_BYTES - 1}: its bytes do not match" in out
    assert "NOT OK: 1 damaged or missing" in out and out.count("\n") == 2


def test_tokens_outside_the_vocabulary_are_found_with_their_offset(store, store_folder, tmp_path):
    """A flip that makes a token id outside the vocabulary is a checksum mismatch like any flip; a
    store whose ids exceed its vocabulary with agreeing checksums (its vocab_size edited) names the token."""
    name = TokenStore(store).shards[0]["name"]
    _flip(store / name, 2 * 5000 + 1, 0xFF)  # token 5000's high byte: an id of 65,280 or more
    with pytest.raises(StoreDamagedError, match=r"bytes 0..65535: its bytes do not match their checksum"):
        TokenStore(store).tokens[4990:5010]
    store = shutil.copytree(store_folder, tmp_path / "edited")
    ids = TokenStore(store).array()
    first = int(np.argmax(ids >= 300))
    _edit(store, lambda m: m.update(vocab_size=300))
    with pytest.raises(StoreDamagedError, match=rf"{re.escape(name)}, byte {2 * first}: token {ids[first]} is "
                                                r"outside the vocabulary of 300"):
        TokenStore(store).array()
    code, out = _verify(store)
    assert code == 1 and f"byte {2 * first}: token {ids[first]} is outside the vocabulary of 300" in out, out


MANIFEST_DAMAGE = {
    "an edited token count": (lambda m: m["parts"]["train"].update(tokens=m["parts"]["train"]["tokens"] + 1000),
                              r"the train part records [\d,]+ tokens, its shards hold [\d,]+"),
    "an edited shard size": (lambda m: m["parts"]["train"]["shards"][0].update(tokens=7),
                             r"records 7 tokens of 2 bytes in [\d,]+ bytes"),
    "a shard name outside the store": (lambda m: m["parts"]["train"]["shards"][0].update(name="../../../etc/passwd"),
                                       r"shard name '../../../etc/passwd' is not a shard file of this store"),
    "an absolute shard name": (lambda m: m["parts"]["train"]["shards"][0].update(name="/etc/passwd"),
                               r"shard name '/etc/passwd' is not a shard file of this store"),
    "no parts": (lambda m: m.pop("parts"), r"it has no \"parts\" with a train part"),
    "parts of the wrong type": (lambda m: m.update(parts={"train": [1, 2]}), r"part 'train' is not a part"),
    "files' tokens edited": (lambda m: m["files"][0].update(tokens=1), r"its source files hold 1 tokens, its parts"),
}


@pytest.mark.parametrize("case", list(MANIFEST_DAMAGE))
def test_a_damaged_manifest_is_refused_in_one_line(store, case):
    change, expected = MANIFEST_DAMAGE[case]
    _edit(store, change)
    with pytest.raises(StoreError, match=expected) as caught:
        TokenStore(store)
    assert "\n" not in str(caught.value) and "prepare the store again" in str(caught.value)
    code, out = _verify(store)
    print(f"\n{case}: {out.strip()}")
    assert code == 1 and re.search(expected, out) and out.count("\n") == 1 and "Traceback" not in out


def test_verify_never_opens_a_file_outside_the_store(store, tmp_path, monkeypatch):
    """A name that leaves the store, for an exact copy of a shard and its sums (every count agrees):
    refused by its name alone, the copy never opened."""
    from hybridpar.data.chunks import sums_name

    name = TokenStore(store).shards[0]["name"]
    (tmp_path / "elsewhere" / "units").mkdir(parents=True)
    for n in (name, sums_name(name)):
        shutil.copy(store / n, tmp_path / "elsewhere" / n)
    outside = os.path.relpath(tmp_path / "elsewhere" / name, store)
    assert outside.startswith("../")
    _edit(store, lambda m: m["parts"]["train"]["shards"][0].update(name=outside))
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1])
    assert verify_store(store, out=open(os.devnull, "w")) == 1
    assert not any("elsewhere" in p for p in opened), opened


def test_verify_shows_its_progress(store, capsys):
    assert verify_store(store, progress_every=0) == 0
    err = capsys.readouterr().err
    print(err)
    assert re.search(rf"verifying {re.escape(str(store))}: .* of .* \(\d+%\)", err)


def test_an_old_store_is_prepared_again(store):
    _edit(store, lambda m: m.update(version=1))
    with pytest.raises(StoreError, match=r"a token store of version 1, this hybridpar reads version 2: prepare it again"):
        TokenStore(store)


def test_chunks_are_checked_once_per_process(store):
    tokens = TokenStore(store).tokens
    tokens[0:10]
    _flip(store / TokenStore(store).shards[0]["name"], 100)  # after the chunk was checked: not read again
    assert tokens[20:30].shape == (10,)
    with pytest.raises(StoreDamagedError):  # a new reader (a new process) checks it again
        TokenStore(store).tokens[20:30]


# --- training -------------------------------------------------------------------------------------

def _case_train(config):
    import contextlib
    import io

    from hybridpar.train import Trainer

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            trainer = Trainer(config)
            trainer.run()
    except Exception as err:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(err).__name__}: {err}", "every_rank": getattr(err, "every_rank", False),
                "out": out.getvalue()}
    return {"error": None, "out": out.getvalue(), "step": trainer.step}


def _trained_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted({r["step"] for r in rows if "loss" in r})


def _windows_read(n_windows: int, seed: int, step: int, rank: int, dp: int = 2) -> list[int]:
    """The windows rank `rank` of `dp` reads at `step` (1-based) of the first epoch (loader.py's rule)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    perm = torch.randperm(n_windows, generator=generator)
    per_rank = GLOBAL_BATCH // dp
    offset = (step - 1) * GLOBAL_BATCH
    return perm[offset + rank:offset + GLOBAL_BATCH:dp][:per_rank].tolist()


@pytest.fixture(scope="module")
def run_tokenizer(corpus, tmp_path_factory):
    """The tokenizer the training configs use (tests/runs.py), trained once into the shared cache."""
    from hybridpar.data.training_data import build_data

    config = make_config(corpus, tmp_path_factory.mktemp("tok"))
    return build_data(config.data)[0]


@pytest.mark.slow
def test_training_stops_before_the_damaged_batch_with_the_last_good_step_saved(
        workers, corpus, run_tokenizer, tmp_path):
    """World 2: only the rank that reads the damaged chunk meets it; every rank stops at that step,
    step - 1 is saved, the damaged step never trains, and the error names the file and the offset."""
    store = tmp_path / "store"
    prepare_store(corpus["source"], run_tokenizer, store, workers=1, report=False)
    shard = TokenStore(store).shards[-1]
    n_windows = (TokenStore(store).n_tokens - 1) // 32
    tokens_per_chunk = CHUNK_BYTES // 2
    first_token = TokenStore(store).n_tokens - shard["tokens"]
    last_chunk = (shard["tokens"] - 1) // tokens_per_chunk
    lo = first_token + last_chunk * tokens_per_chunk  # the shard's last (short) chunk: few windows touch it

    def readers(seed: int, step: int) -> list[int]:
        return [r for r in range(2) if any(w * 32 + 33 > lo for w in _windows_read(n_windows, seed, step, r))]

    def first_touch(seed: int) -> tuple[int, list[int]]:
        step = next(s for s in range(1, n_windows // GLOBAL_BATCH) if readers(seed, s))
        return step, readers(seed, step)

    seed, (stop_step, met) = next((s, first_touch(s)) for s in range(200) if first_touch(s)[0] >= 3
                                  and len(first_touch(s)[1]) == 1)
    print(f"\ndata.seed {seed}: step {stop_step} reads the damaged chunk, on rank {met} only")
    _flip(store / shard["name"], last_chunk * CHUNK_BYTES + 6)
    config = make_config(corpus, tmp_path / "run", dp=2, steps=stop_step + 3, **{
        "data.source": str(store), "data.tokenizer": run_tokenizer.path, "data.seed": seed})
    results = workers(2).run(_case_train, config)
    print(results[0]["error"])
    offset = f"bytes {last_chunk * CHUNK_BYTES}.."
    for r in results:
        assert r["error"].startswith("StoreDamagedError: token store") and r["every_rank"], r
        assert f"{store / shard['name']}, {offset}" in r["error"] and "\n" not in r["error"]
        assert f"Stopped before step {stop_step} trained; step {stop_step - 1} is saved" in r["error"]
    assert _trained_steps(tmp_path / "run") == list(range(1, stop_step))
    assert (tmp_path / "run" / "checkpoints" / f"step-{stop_step - 1:08d}").is_dir()


@pytest.mark.slow
def test_a_damaged_validation_store_stops_every_rank_with_the_step_saved(workers, corpus, run_tokenizer, tmp_path):
    """The held-out windows are read before the first evaluation's forward, and the stop is agreed as
    training's is: every rank stops after the step that trained, saved. (A validation split this small
    is one chunk, which both ranks read; the agreement itself is shown by the training test above.)"""
    store = tmp_path / "val"
    prepare_store(_small_jsonl(tmp_path / "val.jsonl", 40), run_tokenizer, store, workers=1, report=False)
    shard = TokenStore(store).shards[-1]
    _flip(store / shard["name"], shard["size"] - 3)
    config = make_config(corpus, tmp_path / "run", dp=2, steps=6, **{
        "data.source": corpus["source"], "data.tokenizer": run_tokenizer.path, "data.val_source": str(store),
        "train.eval_every": 2})
    results = workers(2).run(_case_train, config)
    print(f"\n{results[0]['error']}")
    for r in results:
        assert r["error"].startswith("StoreDamagedError: token store") and r["every_rank"], r
        assert f"{store / shard['name']}, bytes" in r["error"] and "step 2 is saved" in r["error"]
    assert _trained_steps(tmp_path / "run") == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()


def _small_jsonl(path: Path, n: int) -> str:
    from hybridpar.data import default_corpus_documents

    with open(path, "w") as f:
        for doc in default_corpus_documents(max_documents=n):
            f.write(json.dumps({"text": doc}) + "\n")
    return str(path)


def _stops_exhausted_with_the_step_saved(workers, config, last: int, name: str, run) -> None:
    """The run at world 2 stops at step `last`, saying source `name` is exhausted, every step up to it
    trained and `last` saved."""
    results = workers(2).run(_case_train, config)
    print(results[0]["out"].splitlines()[-1])
    assert [r["error"] for r in results] == [None, None] and results[0]["step"] == last
    assert f"hybridpar: stopped at step {last}: data source '{name}' is exhausted" in results[0]["out"]
    assert _trained_steps(run) == list(range(1, last + 1))
    assert (run / "checkpoints" / f"step-{last:08d}").is_dir()


@pytest.mark.slow
def test_a_single_source_that_runs_out_stops_with_its_last_step_saved(workers, corpus, run_tokenizer, tmp_path):
    from hybridpar.data.training_data import build_data

    source = _small_jsonl(tmp_path / "small.jsonl", 12)
    config = make_config(corpus, tmp_path / "run", dp=2, steps=40, **{
        "data.source": source, "data.tokenizer": run_tokenizer.path, "data.on_exhausted": "stop",
        "checkpoint.resume": True})
    n_windows = len(build_data(config.data)[1])
    last = (n_windows // 2) // (GLOBAL_BATCH // 2)  # the steps of one epoch
    assert 2 <= last < 40
    print(f"\n{n_windows} windows")
    _stops_exhausted_with_the_step_saved(workers, config, last, source, tmp_path / "run")
    again = workers(2).run(_case_train, config)[0]  # resumed: says so at once, trains nothing, saves nothing new
    lines = [line for line in again["out"].splitlines() if "is exhausted" in line]
    print(lines)
    assert again["error"] is None and again["step"] == last and len(lines) == 1
    assert "set data.on_exhausted = \"repeat\"" in lines[0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [f"step-{last:08d}"]


@pytest.mark.slow
def test_a_blend_source_that_runs_out_stops_with_its_last_step_saved(workers, corpus, run_tokenizer, tmp_path):
    from hybridpar.data.blend import next_sources
    from hybridpar.data.training_data import build_data

    small, large = _small_jsonl(tmp_path / "small.jsonl", 10), _small_jsonl(tmp_path / "large.jsonl", 60)
    config = make_config(corpus, tmp_path / "run", dp=2, steps=40, **{
        "data.source": "default", "data.sources": f"small={small}@0.5,large={large}@0.5",
        "data.tokenizer": run_tokenizer.path, "data.on_exhausted": "stop"})
    n_small = len(build_data(make_config(corpus, tmp_path / "n", **{"data.source": small,
                                                                     "data.tokenizer": run_tokenizer.path}).data)[1])
    counts, step = [0, 0], 0
    while counts[0] <= n_small:  # the step whose sequences pass the end of the small source
        next_sources([0.5, 0.5], counts, GLOBAL_BATCH)
        step += 1
    last = step - 1
    assert last >= 2
    _stops_exhausted_with_the_step_saved(workers, config, last, "small", tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["an edited token count", "a shard name outside the store", "no parts"])
def test_training_refuses_a_damaged_manifest_in_one_line(workers, corpus, run_tokenizer, tmp_path, case):
    store = tmp_path / "store"
    prepare_store(corpus["source"], run_tokenizer, store, workers=1, report=False)
    change, expected = MANIFEST_DAMAGE[case]
    _edit(store, change)
    config = make_config(corpus, tmp_path / "run", dp=2, **{"data.source": str(store),
                                                             "data.tokenizer": run_tokenizer.path})
    results = workers(2).run(_case_train, config)
    print(f"\n{results[0]['error']}")
    for r in results:
        assert r["error"].startswith("ManifestDamagedError: ") and r["every_rank"] and re.search(expected, r["error"]), r
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_single_source_loader_stops_at_the_end_of_its_epoch_where_it_was(store):
    from hybridpar.data.loader import PackedDataset, SourceExhaustedError, build_dataloader

    dataset = PackedDataset(TokenStore(store), 32)
    loaders = [build_dataloader(dataset, dp_rank=r, dp_size=2, micro_batch_size=100, seed=0, on_exhausted="stop",
                                   name="corpus") for r in range(2)]
    epoch = len(dataset) // 2 // 100
    for _ in range(epoch):
        [next(loader) for loader in loaders]
    for loader in loaders:  # both ranks at the same batch
        position = loader.state_dict()
        with pytest.raises(SourceExhaustedError, match=rf"data source 'corpus' is exhausted: it ran out after "
                                                       rf"{epoch * 200:,} sequences"):
            next(loader)
        assert loader.state_dict() == position
    repeating = build_dataloader(dataset, dp_rank=0, dp_size=2, micro_batch_size=100, seed=0)
    for _ in range(epoch + 1):
        next(repeating)
    assert repeating.position.epochs == [1]


def test_a_damage_met_in_a_dataloader_worker_is_one_line(store):
    """data.num_workers > 0: the worker's error arrives wrapped in its traceback; the stop's line is its last."""
    from hybridpar.data.loader import PackedDataset, build_dataloader
    from hybridpar.train import data_stop

    _flip(store / TokenStore(store).shards[0]["name"], 10)
    loader = build_dataloader(PackedDataset(TokenStore(store), 32), dp_rank=0, dp_size=1, micro_batch_size=2000,
                                 seed=0, num_workers=1)
    before = loader.state_dict()
    batches, error = data_stop.fetch(loader, 1)
    assert batches == [] and isinstance(error, StoreDamagedError) and loader.state_dict() == before
    text = str(data_stop.agreed_error(error))
    assert text.startswith("token store ") and "\n" not in text and "bytes 0..65535: its bytes do not match" in text


def test_a_damage_met_through_a_blend_is_one_line_and_keeps_its_place(store):
    """The blend's loader meets the flipped chunk like the single source's: the file and the chunk named,
    its position (the counts a checkpoint saves) back where it was."""
    from hybridpar.data.loader import PackedDataset, build_dataloader as blend_loader
    from hybridpar.train import data_stop

    path = store / TokenStore(store).shards[0]["name"]
    _flip(path, CHUNK_BYTES + 11)  # the second chunk: the first windows read, then the damage
    dataset = PackedDataset(TokenStore(store), 32)
    loader = blend_loader([("a", 0.5, dataset), ("b", 0.5, dataset)], dp_rank=0, dp_size=1, micro_batch_size=64, seed=0)
    error, steps = None, 0
    while error is None and steps * 64 <= 2 * len(dataset):  # one pass through both sources at most
        before = loader.state_dict()
        batches, error = data_stop.fetch(loader, 1)
        steps += 1
    print(f"\nmet at batch {steps}: {error}")
    assert isinstance(error, StoreDamagedError), f"read {steps} batches without meeting the damage"
    assert batches == [] and loader.state_dict() == before
    assert f"{path}, bytes {CHUNK_BYTES}..{2 * CHUNK_BYTES - 1}: its bytes do not match" in str(error), error
