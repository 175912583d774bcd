"""Token stores: every corpus format gives the tokens the .jsonl gives, whatever the workers or parts
that prepared it, after a kill too; bad input is one clear error; `data.source` takes a store."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybridpar.data import default_corpus_documents
from hybridpar.data.formats import plan_units
from hybridpar.data.sources import resolve_sources
from hybridpar.data.store.token_store import MANIFEST, TokenStore
from hybridpar.data.store.prepare import prepare_store
from hybridpar.data.store.integrity import verify_store
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
UNIT = 40_000  # bytes a unit: several units per file


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return list(default_corpus_documents(max_documents=1200))


@pytest.fixture(scope="module")
def formats(tmp_path_factory, documents) -> dict[str, Path]:
    """The same documents in every format the store reads (with an id column beside the text)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root = tmp_path_factory.mktemp("formats")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(documents)).encode()
    (root / "docs.jsonl").write_bytes(lines)
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    half = len(documents) // 2
    (root / "parquet").mkdir()
    for n, part in enumerate((documents[:half], documents[half:])):  # two files, several row groups each
        table = pa.table({"id": list(range(len(part))), "text": part})
        pq.write_table(table, root / "parquet" / f"train-0000{n}-of-00002.parquet", row_group_size=97)
    datasets.Dataset.from_dict({"text": documents, "id": list(range(len(documents)))}).save_to_disk(
        str(root / "saved"), max_shard_size="200KB")
    return {"jsonl": root / "docs.jsonl", "jsonl.gz": root / "docs.jsonl.gz", "jsonl.zst": root / "docs.jsonl.zst",
            "parquet": root / "parquet", "datasets": root / "saved"}


@pytest.fixture(scope="module")
def reference(documents, tokenizer) -> np.ndarray:
    """The tokens of the documents as the tokenizer makes them, EOS after each."""
    return np.array([i for d in documents for i in tokenizer.encode(d, eos=True)], dtype=np.uint16)


def _tokens(store: TokenStore) -> np.ndarray:
    return np.asarray(store.tokens[0:store.n_tokens])


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "datasets"])
def test_every_format_gives_the_same_tokens(formats, reference, tokenizer, tmp_path, kind):
    store = prepare_store(formats[kind], tokenizer, tmp_path / "store", workers=1, unit_bytes=UNIT, report=False)
    units = len(json.loads((tmp_path / "store" / "plan.json").read_text())["units"])
    print(f"\n{kind}: {store.n_tokens:,} tokens from {units} units, {len(store.shards)} shards")
    assert np.array_equal(_tokens(store), reference)
    assert store.n_documents == sum(f["documents"] for f in store.meta["files"]) == 1200
    assert verify_store(tmp_path / "store") == 0


def test_workers_and_parts_make_the_same_store(formats, reference, tokenizer, tmp_path):
    source = [formats["parquet"], formats["jsonl"]]
    stores = {w: prepare_store(source, tokenizer, tmp_path / f"w{w}", workers=w, unit_bytes=UNIT, report=False)
              for w in (1, 2, 3)}
    manifests = {w: json.loads((tmp_path / f"w{w}" / MANIFEST).read_text()) for w in stores}
    for w in (2, 3):
        assert manifests[w]["parts"] == manifests[1]["parts"], w  # same shards, sizes and checksums
        assert np.array_equal(_tokens(stores[w]), _tokens(stores[1]))
    assert np.array_equal(_tokens(stores[1]), np.concatenate([reference, reference]))
    # Two parts, as two nodes of a Slurm array would: the first leaves the store incomplete, the
    # last to finish writes the manifest.
    assert prepare_store(source, tokenizer, tmp_path / "parts", workers=1, part=(0, 2), unit_bytes=UNIT,
                         report=False) is None
    assert not (tmp_path / "parts" / MANIFEST).exists()
    last = prepare_store(source, tokenizer, tmp_path / "parts", workers=1, part=(1, 2), unit_bytes=UNIT, report=False)
    assert json.loads((tmp_path / "parts" / MANIFEST).read_text())["parts"] == manifests[1]["parts"]
    assert np.array_equal(_tokens(last), _tokens(stores[1]))


def _hybridpar(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
    return subprocess.Popen([sys.executable, "-m", "hybridpar", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


@pytest.mark.slow
def test_the_command_killed_midway_finishes_the_same_store(formats, tokenizer, tmp_path, documents):
    """SIGKILL while units are being written; the same command again completes the store, equal to
    one uninterrupted pass; `hybridpar verify` checks it and finds a changed byte."""
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for _ in range(6):
            for d in documents:
                f.write(json.dumps({"text": d}) + "\n")
    once = prepare_store(big, tokenizer, tmp_path / "once", workers=1, unit_bytes=UNIT, report=False)
    args = ["prepare", str(big), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "store"), "--workers", "2",
            "--unit-mb", str(UNIT / 2**20)]
    proc = _hybridpar(*args)
    units = tmp_path / "store" / "units"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(units.glob("*.json"))) < 2 and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the parent; its workers stop when their pipe closes
    proc.wait()
    done_before = len(list(units.glob("*.json")))
    print(f"\nkilled with {done_before} units done")
    assert not (tmp_path / "store" / MANIFEST).exists()  # never looks complete
    again = subprocess.run([sys.executable, "-m", "hybridpar", *args], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "complete" in again.stdout
    store = TokenStore(tmp_path / "store")
    assert json.loads((tmp_path / "store" / MANIFEST).read_text())["parts"] == once.meta["parts"]
    verified = subprocess.run([sys.executable, "-m", "hybridpar", "verify", str(tmp_path / "store")],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": child_pythonpath()})
    assert verified.returncode == 0 and "all ok" in verified.stdout, verified.stdout
    shard = tmp_path / "store" / store.shards[1]["name"]
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    assert verify_store(tmp_path / "store") == 1


# --- bad input ------------------------------------------------------------------------------------

def test_bad_records_are_named_or_skipped_and_counted(tmp_path, tokenizer, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a first document", None, "a third one"]}), tmp_path / "nulls.parquet")
    with pytest.raises(ValueError, match=r"nulls.parquet: row 2: 'text' is null; fix the record, or set "
                                         r"data.on_bad_record = \"skip\""):
        prepare_store(tmp_path / "nulls.parquet", tokenizer, tmp_path / "s1", workers=1, report=False)
    assert not (tmp_path / "s1" / MANIFEST).exists()
    store = prepare_store(tmp_path / "nulls.parquet", tokenizer, tmp_path / "s2", workers=1, on_bad_record="skip",
                          max_bad_records=1)
    assert store.meta["files"][0]["skipped"] == 1 and store.n_documents == 2
    assert f"{tmp_path / 'nulls.parquet'}: 1 bad records skipped" in capsys.readouterr().err
    pq.write_table(pa.table({"content": ["x"], "id": [1]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"other.parquet has no column 'text' \(its columns: content, id\); set "
                                         r"data.text_field"):
        prepare_store(tmp_path / "other.parquet", tokenizer, tmp_path / "s3", workers=1, report=False)
    (tmp_path / "rec.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"rec.jsonl:2: no 'text' field \(it has: body\)"):
        prepare_store(tmp_path / "rec.jsonl", tokenizer, tmp_path / "s4", workers=1, report=False)
    # deep in a file read in several units, the line is still named by its number in the file
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(3000)]
    lines[2718] = json.dumps({"text": None})
    (tmp_path / "long.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"long.jsonl:2719: 'text' is null"):
        prepare_store(tmp_path / "long.jsonl", tokenizer, tmp_path / "s5", workers=1, report=False, unit_bytes=UNIT)
    assert len(plan_units(resolve_sources(tmp_path / "long.jsonl"), "text", UNIT)) > 5
    assert not (tmp_path / "s5").exists()  # refused: nothing of it is left


@pytest.mark.parametrize("kind", ["jsonl.zst", "jsonl.gz"])
def test_a_truncated_compressed_file_names_how_far_it_got(formats, tokenizer, tmp_path, kind):
    data = formats[kind].read_bytes()
    cut = tmp_path / f"cut.{kind}"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"cut.{kind}: the \w+ stream is (damaged|cut short) .*bytes of text"):
        prepare_store(cut, tokenizer, tmp_path / "s", workers=1, report=False)
    assert not (tmp_path / "s" / MANIFEST).exists()


def test_a_folder_holding_another_store_is_refused(formats, tokenizer, tmp_path):
    prepare_store(formats["jsonl"], tokenizer, tmp_path / "s", workers=1, report=False)
    with pytest.raises(ValueError, match=r"holds a store of other input \(sources differ\)"):
        prepare_store(formats["jsonl.gz"], tokenizer, tmp_path / "s", workers=1, report=False)


def test_data_source_takes_a_store_made_with_the_run_tokenizer(formats, tokenizer, tmp_path, bpe_files):
    from types import SimpleNamespace

    from hybridpar.data import build_data

    store = prepare_store(formats["jsonl"], tokenizer, tmp_path / "s", workers=1, report=False)
    d = SimpleNamespace(sources=[], source=str(tmp_path / "s"), tokenizer="", val_source="", val_fraction=0.0, seq_len=16,
                        text_field="text", cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=600,
                        on_bad_record="error", max_document_bytes=1 << 20, max_bad_records=0.01)
    found, dataset, validation = build_data(d)
    assert found.sha256 == tokenizer.sha256 and validation is None
    assert np.array_equal(dataset[3].numpy(), _tokens(store)[48:65].astype(np.int64))
    with pytest.raises(ValueError, match=r"was made with another tokenizer .* set data.tokenizer to the store's"):
        build_data(SimpleNamespace(**{**vars(d), "tokenizer": str(bpe_files[0])}))
    with pytest.raises(ValueError, match=r"prepared without a validation split: prepare it with --val-fraction 0.1"):
        build_data(SimpleNamespace(**{**vars(d), "val_fraction": 0.1}))


def test_the_documented_data_commands_parse():
    """Every hybridpar command docs/data.md shows is taken by the parser; a train command's config
    and overrides load (blends checked). (tests/test_docs.py checks every page's commands; this one
    also holds the data commands to the data commands' own entry points.)"""
    import shlex

    from hybridpar.cli import build_parser
    from hybridpar.config import find_config, load_config

    docs, fenced = [], False
    for line in (ROOT / "docs" / "data.md").read_text().splitlines():
        fenced = line.startswith("```bash") or (fenced and not line.startswith("```"))
        if fenced and line.startswith("torchrun ") and " -m hybridpar " in line:  # (tests/test_docs.py: its mesh)
            line = "hybridpar " + line.split(" -m hybridpar ", 1)[1]
        if fenced and line.startswith("hybridpar "):
            docs.append(line.split("#")[0].strip())
    assert len(docs) >= 8, docs
    for line in docs:
        args, extra = build_parser().parse_known_args(shlex.split(line)[1:])
        if args.func.__name__ == "cmd_train":
            load_config(find_config(args.config), extra)
        else:
            assert not extra and args.func.__name__ in ("cmd_prepare", "cmd_verify"), line


# --- inside a training job -----------------------------------------------------------------------

TIMEOUT = 4.0  # the job's parallel.init_timeout and diagnostics.train_timeout


def _case_slow_preparation(source: str, cache: str, run_dir: str) -> dict:
    """Train 2 steps on a source the job must prepare, every tokenizer batch slowed to 1.5 s (a
    test-side fault), so that preparing takes longer than the job's set-up and step timeouts
    together (while each batch moves the preparation on within them)."""
    import time

    from hybridpar.data.tokenizer import Tokenizer
    from hybridpar.train import Trainer
    from tests.runs import make_config

    config = make_config({"source": source, "cache_dir": cache}, run_dir, dp=2, steps=2,
                         **{"parallel.init_timeout": TIMEOUT, "diagnostics.train_timeout": TIMEOUT})
    original = Tokenizer.encode_batch_numpy

    def slow(self, texts):
        time.sleep(1.5)
        return original(self, texts)

    Tokenizer.encode_batch_numpy = slow
    started = time.monotonic()
    try:
        trainer = Trainer(config)
        set_up = time.monotonic() - started
        history = trainer.run()
    finally:
        Tokenizer.encode_batch_numpy = original
    return {"steps": len(history), "set_up": set_up, "hang_report": (Path(run_dir) / "hang_report.json").exists()}


@pytest.mark.slow
def test_a_long_preparation_in_the_job_is_not_a_hang(workers, documents, tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents * 2))
    results = workers(2).run(_case_slow_preparation, str(source), str(tmp_path / "cache"), str(tmp_path / "run"))
    print(f"\nset-up (mostly preparing) {results[0]['set_up']:.1f} s with {TIMEOUT:g} s timeouts, then 2 steps")
    assert results[0]["set_up"] > 2 * TIMEOUT  # the preparation outlasted both timeouts
    assert all(r["steps"] == 2 and not r["hang_report"] for r in results), results
    stores = list((tmp_path / "cache").glob("store-*/store.json"))
    assert len(stores) == 1  # one store, prepared once for both ranks


@pytest.mark.slow
def test_the_sbatch_example_as_two_array_tasks(formats, tokenizer, tmp_path):
    """launch/prepare.sh run as tasks 0 and 1 of an array of two (the variables Slurm sets): the
    first leaves the store incomplete, the second completes it, equal to one pass."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "SOURCES": f"{formats['parquet']} {formats['jsonl']}",
           "TOKENIZER": str(tokenizer.path), "OUT": str(tmp_path / "store"), "WORKERS": "1",
           "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "0", "PREPARE_ARGS": "--unit-mb 0.04"}
    script = ROOT / "launch" / "prepare.sh"
    first = subprocess.run(["bash", str(script)], env={**env, "SLURM_ARRAY_TASK_ID": "0"}, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "part 0/2" in first.stderr and not (tmp_path / "store" / MANIFEST).exists()
    second = subprocess.run(["bash", str(script)], env={**env, "SLURM_ARRAY_TASK_ID": "1"}, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0 and "complete" in second.stdout, second.stderr[-3000:]
    one = prepare_store([formats["parquet"], formats["jsonl"]], tokenizer, tmp_path / "one", workers=1,
                        unit_bytes=int(0.04 * 2**20), report=False)
    assert TokenStore(tmp_path / "store").meta["parts"] == one.meta["parts"]
    missing = subprocess.run(["bash", str(script)], env={k: v for k, v in env.items() if k != "TOKENIZER"},
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "set TOKENIZER" in missing.stderr


def test_merge_writes_the_manifest_once_every_part_is_done(formats, tokenizer, tmp_path):
    source = [formats["parquet"], formats["jsonl"]]
    kwargs = dict(workers=1, unit_bytes=UNIT, report=False)
    assert prepare_store(source, tokenizer, tmp_path / "s", part=(0, 3), **kwargs) is None
    from hybridpar.cli import main

    assert main(["prepare", "--merge", "--out", str(tmp_path / "s")]) == 2  # parts 1 and 2 are missing
    assert not (tmp_path / "s" / MANIFEST).exists()
    # the other parts, as other nodes would run them, but without completing the store themselves
    from hybridpar.data.store.unit_build import build_unit
    from hybridpar.data.store.unit_plan import make_plan, part_of

    plan = make_plan(source, tokenizer, tmp_path / "s", unit_bytes=UNIT)
    for i in part_of(plan, 1, 3) + part_of(plan, 2, 3):
        build_unit(plan, i, tokenizer)
    assert main(["prepare", "--merge", "--out", str(tmp_path / "s")]) == 0
    one = prepare_store(source, tokenizer, tmp_path / "one", **kwargs)
    assert TokenStore(tmp_path / "s").meta["parts"] == one.meta["parts"]


def test_a_units_first_line_number_counts_the_lines_before_it(tmp_path):
    """streams.lines_before against a direct count of line starts, at every byte offset."""
    from hybridpar.data.streams import lines_before as _lines_before

    data = b"ab\n\ncde\nf\n\nghij"
    (tmp_path / "f.jsonl").write_bytes(data)
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    assert [_lines_before(tmp_path / "f.jsonl", off) for off in range(len(data) + 1)] == \
        [sum(s < off for s in starts) for off in range(len(data) + 1)]
