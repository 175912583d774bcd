"""Bad records of every kind are refused in one line naming the file and the line or row, or skipped
and counted with `on_bad_record = "skip"`, up to data.max_bad_records: text no tokenizer can take (a
lone UTF-16 surrogate, common in scraped text, through every tokenizer kind and every format it can
arrive in), a line that is not UTF-8 JSON; a refused preparation leaves nothing behind."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hybridpar.data.store.token_store import TokenStore
from hybridpar.data.store.prepare import prepare_store
from hybridpar.data.streams import DataFormatError

GOOD = [f"document {i} says something plain" for i in range(200)]  # 1 bad record in 201: under the 1% cap
SURROGATE_LINE = '{"text": "scraped \\ud83d text"}'  # valid JSON, a lone surrogate once loaded


def _jsonl_bytes(bad_line: bytes, at: int = 1) -> bytes:
    lines = [json.dumps({"text": t}).encode() for t in GOOD]
    return b"\n".join(lines[:at] + [bad_line] + lines[at:]) + b"\n"


def _invalid_utf8_column(texts: list[bytes]):
    """A string column holding bytes that are not UTF-8 (a surrogate's own bytes, ED A0 BD): what a
    writer that does not validate leaves in a parquet or arrow file (pyarrow refuses to make one)."""
    import pyarrow as pa

    raw = pa.array(texts, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


def _bad_source(kind: str, folder: Path) -> tuple[Path, str]:
    """(a source of GOOD with one bad record second, the pattern naming where that record is)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    surrogate = SURROGATE_LINE.encode()
    texts = [GOOD[0].encode(), b"scraped \xed\xa0\xbd text", *(t.encode() for t in GOOD[1:])]
    if kind == "jsonl.gz":
        (folder / "d.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(surrogate)))
        return folder / "d.jsonl.gz", r"d.jsonl.gz:2: 'text' holds a lone UTF-16 surrogate \(\\ud83d at character 8\)"
    if kind == "jsonl.zst":
        (folder / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(surrogate)))
        return folder / "d.jsonl.zst", r"d.jsonl.zst:2: 'text' holds a lone UTF-16 surrogate"
    if kind == "jsonl, its bytes":  # the surrogate's bytes in the line, not its escape
        (folder / "d.jsonl").write_bytes(_jsonl_bytes(b'{"text": "scraped \xed\xa0\xbd text"}'))
        return folder / "d.jsonl", r"d.jsonl:2: not UTF-8 text \(invalid continuation byte at byte 18\)"
    if kind == "parquet":
        pq.write_table(pa.table({"text": _invalid_utf8_column(texts)}), folder / "d.parquet", row_group_size=50)
        return folder / "d.parquet", r"d.parquet: row 2: 'text' is not UTF-8 text \(invalid continuation byte"
    # a datasets folder (save_to_disk's layout): its arrow file in the stream format
    saved = folder / "saved"
    saved.mkdir()
    table = pa.table({"text": _invalid_utf8_column(texts)})
    with pa.ipc.new_stream(saved / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=50)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (saved / "dataset_info.json").write_text("{}")
    return saved, r"data-00000-of-00001.arrow: row 2: 'text' is not UTF-8 text"


def _expected(tokenizer, documents) -> list[int]:
    return [i for d in documents for i in tokenizer.encode(d, eos=True)]


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "huggingface"])
def test_a_lone_surrogate_is_a_bad_record_whatever_the_tokenizer(kind, tmp_path, tokenizer, tiktoken_tokenizer,
                                                                 hf_tokenizer):
    """sentencepiece and tokenizers raised a TypeError naming nothing; tiktoken took the text (as
    U+FFFD): the record is refused alike, or skipped and counted, whatever the tokenizer."""
    chosen = {"sentencepiece": tokenizer, "tiktoken": tiktoken_tokenizer, "huggingface": hf_tokenizer}[kind]
    source = tmp_path / "scraped.jsonl"
    source.write_bytes(_jsonl_bytes(SURROGATE_LINE.encode()))
    with pytest.raises(DataFormatError, match=r"scraped.jsonl:2: 'text' holds a lone UTF-16 surrogate .* or set "
                                              r"data.on_bad_record = \"skip\" \(hybridpar prepare --on-bad-record skip\)"):
        prepare_store(source, chosen, tmp_path / "store", workers=1, report=False)
    assert not (tmp_path / "store").exists()  # nothing half-written: no plan.json, no lock
    store = prepare_store(source, chosen, tmp_path / "store", workers=1, report=False, on_bad_record="skip")
    assert store.meta["files"][0]["skipped"] == 1 and store.n_documents == len(GOOD)
    assert store.meta["files"][0]["first_bad"].startswith(f"{source}:2: 'text' holds a lone UTF-16 surrogate")
    assert store.array().tolist() == _expected(chosen, GOOD)


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst", "jsonl, its bytes", "parquet", "datasets"])
def test_a_lone_surrogate_is_named_in_every_format(kind, tmp_path, tokenizer):
    source, where = _bad_source(kind, tmp_path)
    with pytest.raises(DataFormatError, match=where):
        prepare_store(source, tokenizer, tmp_path / "store", workers=1, report=False)
    assert not (tmp_path / "store").exists()
    store = prepare_store(source, tokenizer, tmp_path / "store", workers=1, report=False, on_bad_record="skip")
    assert store.meta["files"][0]["skipped"] == 1 and store.array().tolist() == _expected(tokenizer, GOOD)


def test_the_command_says_a_bad_record_in_one_line_and_leaves_nothing(tmp_path, tokenizer, capsys):
    from hybridpar.cli import main

    source = tmp_path / "scraped.jsonl"
    source.write_bytes(_jsonl_bytes(SURROGATE_LINE.encode()))
    args = ["prepare", str(source), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "store"),
            "--workers", "2", "--unit-mb", "0.02"]  # several units, in worker processes
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"hybridpar: error: {source}:2: 'text' holds a lone UTF-16 surrogate") \
        and "--on-bad-record skip" in err[-1] and not any("Traceback" in line for line in err), err
    assert not (tmp_path / "store").exists()
    assert main(args + ["--on-bad-record", "skip"]) == 0
    said = capsys.readouterr()
    assert f"{tmp_path / 'store'}: complete, " in said.out and "(1 bad records skipped)" in said.out, said
    assert f"{source}: 1 bad records skipped of 201 (the first: {source}:2: 'text' holds" in said.err, said.err


def test_a_garbage_line_is_skipped_and_counted_and_the_cap_names_a_wrong_format(tmp_path, tokenizer, capsys):
    """One line of binary garbage in a large .jsonl stopped `prepare` even with skip; skipped now,
    counted in the manifest and the summary; a file that is mostly not JSON is refused in one line
    (the count, the cap, the first bad line, the flag), and passes with the cap raised."""
    from hybridpar.cli import main

    source = tmp_path / "big.jsonl"
    source.write_bytes(_jsonl_bytes(b"\x00\x9c\xff binary \x00 garbage", at=50))
    args = ["prepare", str(source), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "s"), "--workers", "1"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hybridpar: error: {source}:51: not UTF-8 text (invalid start byte at byte 1); every line of a .jsonl file "
        "must be one JSON object, in UTF-8, or set data.on_bad_record = \"skip\" (hybridpar prepare --on-bad-record "
        "skip) to skip such records (they are counted)")
    assert main(args + ["--on-bad-record", "skip"]) == 0
    assert "(1 bad records skipped)" in capsys.readouterr().out
    assert TokenStore(tmp_path / "s").meta["files"][0]["skipped"] == 1

    wrong = tmp_path / "actually.csv.jsonl"  # a CSV under a .jsonl name: every line bad
    wrong.write_text("id,text\n" + "".join(f"{i},{t}\n" for i, t in enumerate(GOOD[:50])))
    args = ["prepare", str(wrong), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "w"), "--workers", "1",
            "--on-bad-record", "skip"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"hybridpar: error: {wrong}: 51 of 51 records are bad, over data.max_bad_records = 0.01 of a file's records "
        f"(the first: {wrong}:1: not valid JSON (Expecting value: line 1 column 1 (char 0))); fix the file, or raise "
        "the cap (hybridpar prepare --max-bad-records) to skip them")
    assert not (tmp_path / "w").exists()
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in GOOD[:40]) + "no\nnor\n")
    mixed = ["prepare", str(tmp_path / "mixed.jsonl"), "--tokenizer", str(tokenizer.path), "--workers", "1",
             "--on-bad-record", "skip", "--out"]
    assert main(mixed + [str(tmp_path / "m")]) == 2
    assert "2 of 42 records are bad, over data.max_bad_records = 0.01" in capsys.readouterr().err
    assert main(mixed + [str(tmp_path / "m"), "--max-bad-records", "1"]) == 2  # a number: 1 bad record a file
    assert main(mixed + [str(tmp_path / "m"), "--max-bad-records", "2"]) == 0
    assert main(mixed + [str(tmp_path / "m2"), "--max-bad-records", "0.05"]) == 0  # a share: 2 of 42 is under 5%
    assert TokenStore(tmp_path / "m").meta["files"][0]["skipped"] == 2


def test_the_cap_is_a_key_of_the_data_section_that_reaches_a_runs_store(tmp_path, tokenizer):
    from hybridpar.config import ConfigError, load_config
    from hybridpar.data import build_data

    assert load_config(None, []).data.max_bad_records == 0.01
    with pytest.raises(ConfigError, match=r"data.max_bad_records must be >= 0, got -1"):
        load_config(None, ["--data.max_bad_records=-1"])
    source = tmp_path / "d.jsonl"
    source.write_text('{"text": "one"}\n{"text": "two"}\n{"no text": 1}\n')
    flags = [f"--data.source={source}", f"--data.tokenizer={tokenizer.path}", "--data.val_fraction=0",
             f"--data.cache_dir={tmp_path / 'cache'}", "--data.on_bad_record=skip", "--data.seq_len=4"]
    with pytest.raises(DataFormatError, match=r"d.jsonl: 1 of 3 records are bad, over data.max_bad_records = 0.01 of "
                                              r"a file's records \(the first: .*d.jsonl:3: no 'text' field"):
        build_data(load_config(None, flags).data)
    assert not list((tmp_path / "cache").glob("store-*"))  # the refused store is not left in the cache
    _, windows, _ = build_data(load_config(None, flags + ["--data.max_bad_records=1"]).data)
    assert windows.token_file.n_documents == 2


def _case_train_on_a_scraped_source(source: str, cache: str, run_dir: str, tokenizer: str, skip: bool) -> dict:
    """Train a step at 2 ranks on a .jsonl holding a lone surrogate: what each rank raised, and the
    cache's store folders afterwards (a trained tokenizer when `tokenizer` is "")."""
    import os

    from hybridpar.mesh.ranks import raised_by_every_rank
    from hybridpar.train import Trainer
    from tests.runs import make_config

    config = make_config({"source": source, "cache_dir": cache}, run_dir, dp=2, steps=1,
                         **{"data.tokenizer": tokenizer, "data.val_fraction": 0.0, "model.vocab_size": 1024,
                            "data.on_bad_record": "skip" if skip else "error"})
    try:
        steps = len(Trainer(config).run())
        raised = None
    except Exception as err:  # noqa: BLE001 - what the rank met goes back to the test
        steps, raised = 0, (type(err).__name__, str(err), raised_by_every_rank(err))
    stores = sorted(name for name in os.listdir(cache) if name.startswith("store-")) if os.path.isdir(cache) else []
    return {"steps": steps, "raised": raised, "stores": stores}


@pytest.mark.slow
@pytest.mark.parametrize("trained", [False, True], ids=["given-tokenizer", "trained-tokenizer"])
def test_a_scraped_source_at_two_ranks_is_one_line_then_skipped(trained, workers, tmp_path, tokenizer, corpus_sample):
    """Through data.source at 2 ranks every rank printed "internal error": each raises the same
    one-line refusal now (said once, by rank 0), the cache keeps no unfinished store, and with
    data.on_bad_record = "skip" the run trains."""
    source = tmp_path / "scraped.jsonl"
    lines = [json.dumps({"text": t}) for t in corpus_sample]  # enough text to train a tokenizer on
    lines.insert(150, SURROGATE_LINE)
    source.write_text("\n".join(lines) + "\n")
    given = "" if trained else str(tokenizer.path)
    run = workers(2).run
    refused = run(_case_train_on_a_scraped_source, str(source), str(tmp_path / "cache"), str(tmp_path / "r1"), given,
                  False)
    for rank in refused:
        assert rank["raised"][0] == "DataFormatError" and rank["raised"][2], refused  # every rank alike: said once
        assert rank["raised"][1].startswith(f"{source}:151: 'text' holds a lone UTF-16 surrogate"), refused
        assert rank["stores"] == [], refused
    trained_on = run(_case_train_on_a_scraped_source, str(source), str(tmp_path / "cache"), str(tmp_path / "r2"),
                     given, True)
    assert all(rank["steps"] == 1 and rank["raised"] is None for rank in trained_on), trained_on
    assert len(trained_on[0]["stores"]) == 1
