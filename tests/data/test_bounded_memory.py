"""Bounded memory whatever the input: a zstd bomb, a document without newlines, a record over
data.max_document_bytes (refused naming its size, or skipped and counted), each measured."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridpar.data import TokenStore, prepare_store
from hybridpar.data.formats import DataFormatError
from tests.data.test_exactly_once import documents

REPO = Path(__file__).resolve().parents[2]
# The bound these tests hold a preparation process to (docs/data.md, "Memory"): the interpreter,
# numpy and the reader take about 40 MB; before, the bomb took more than 2 GB (a MemoryError under
# a 4 GB limit) and the 200 MB document about 10 GB.
PEAK_MB = 200

# One process reads a source as a preparation worker does, with a tokenizer that costs nothing (the
# reader's memory is measured, not the tokenizer's: bench/data.py measures a real one), and prints
# its documents, its tokens and its peak resident set.
_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from hybridpar.data.store.prepare import prepare_store

    class Cheap:
        vocab_size, eos_id, sha256, path = 256, 0, "cheap", "cheap"
        def encode_batch_numpy(self, texts):
            return [np.full(len(t) // 64 + 1, 7, dtype=np.int32) for t in texts]

    try:
        store = prepare_store(sys.argv[1], Cheap(), sys.argv[2], workers=1, report=False)
        print(store.n_documents, store.n_tokens)
    except Exception as err:
        print("error:", err)
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's resident set (pytest's)
    print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) // 1024)
""")


def prepare_in_a_process(source: Path, out: Path) -> tuple[str, int]:
    """(what the preparation said: "documents tokens" or "error: ...", the process's peak RSS in MB)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said, peak = done.stdout.strip().rsplit("\n", 1)
    return said, int(peak)


@pytest.mark.slow
def test_a_zstd_bomb_streams_in_bounded_memory(tmp_path):
    """64 KB that expand to 2 GiB of newlines, then one record: read whole (about 7 s), its one
    document found. Before, one decompress call made the 2 GiB at once."""
    import zstandard

    bomb = tmp_path / "bomb.jsonl.zst"
    with open(bomb, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as writer:
        newlines = b"\n" * (64 << 20)
        for _ in range(32):
            writer.write(newlines)
        writer.write(b'{"text": "1 2 3 after the bomb"}\n')
    assert bomb.stat().st_size < 100_000
    said, peak = prepare_in_a_process(bomb, tmp_path / "s")
    assert said == "1 2" and peak < PEAK_MB, (said, peak)  # one document: 1 token and EOS


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst"])
def test_decompression_holds_a_few_mib_at_a_time(tmp_path, kind):
    """64 MiB of newlines, then a record: Python's allocations stay under 20 MB (a fast check of
    what the slow test above measures in a process)."""
    import tracemalloc
    import zlib

    import zstandard

    newlines = b"\n" * (64 << 20)
    if kind == "jsonl.gz":
        packer = zlib.compressobj(1, zlib.DEFLATED, 31)
        data = packer.compress(newlines) + packer.compress(b'{"text": "after"}') + packer.flush()
    else:
        data = zstandard.ZstdCompressor().compress(newlines + b'{"text": "after"}')
    (tmp_path / f"b.{kind}").write_bytes(data)
    del newlines
    tracemalloc.start()
    try:
        found = documents(tmp_path / f"b.{kind}")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found == ["after"] and peak < 20e6, peak


@pytest.mark.slow
def test_a_200_mb_document_without_newlines(tmp_path):
    """As .txt it is read in bounded blocks and pieces; as a .jsonl record it is over the default
    data.max_document_bytes (64 MiB): refused in one line naming the file, the line and its size,
    measured as it streams (before, the line was joined and parsed whole: about 10 GB)."""
    words = ("lorem ipsum dolor sit amet " * 40_000).encode()  # a MB of words, no newline
    text, record = tmp_path / "one.txt", tmp_path / "one.jsonl"
    with open(text, "wb") as f:
        for _ in range(200):
            f.write(words)
    with open(record, "wb") as f:
        f.write(b'{"text": "')
        for _ in range(200):
            f.write(words)
        f.write(b'"}\n{"text": "next"}\n')
    said, peak = prepare_in_a_process(text, tmp_path / "t")
    count, tokens = map(int, said.split())
    assert count == 1 and tokens > 200 * len(words) // 64 and peak < PEAK_MB, (said, peak)
    said, peak = prepare_in_a_process(record, tmp_path / "j")
    size = 200 * len(words) + len('{"text": ""}')
    assert said == (f"error: {record}:1: a record of {size:,} bytes, over data.max_document_bytes = {64 << 20:,}; "
                    "raise data.max_document_bytes (hybridpar prepare --max-document-bytes), or set "
                    "data.on_bad_record = \"skip\" (hybridpar prepare --on-bad-record skip) to skip such records "
                    "(they are counted)"), said
    assert peak < PEAK_MB, peak


# --- data.max_document_bytes -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_a_jsonl_record_over_the_limit_is_named_or_skipped(tmp_path, kind, monkeypatch):
    import gzip

    import zstandard

    from hybridpar.data import streams

    monkeypatch.setattr(streams, "_READ", 64)  # the long line crosses many reads
    long_line = json.dumps({"text": "y" * 1000})
    data = "\n".join(['{"text": "a"}', "", long_line, '{"text": "b"}', long_line]).encode()
    compress = {"jsonl": bytes, "jsonl.gz": gzip.compress, "jsonl.zst": zstandard.ZstdCompressor().compress}[kind]
    path = tmp_path / f"d.{kind}"
    path.write_bytes(compress(data))
    with pytest.raises(DataFormatError, match=rf"d.{kind}:3: a record of 1,012 bytes, over "
                                              r"data.max_document_bytes = 1,000; raise data.max_document_bytes"):
        documents(path, max_document_bytes=1000)
    assert documents(path, max_document_bytes=1012) == ["a", "y" * 1000, "b", "y" * 1000]
    assert documents(path, max_document_bytes=1000, on_bad_record="skip") == ["a", "b"]
    if kind == "jsonl":  # the line in the middle of a unit, or crossing into the next
        for unit_bytes in (1, 20, 40, 700, 1100):
            assert documents(path, unit_bytes, max_document_bytes=1000, on_bad_record="skip") == ["a", "b"]


def _table(path: Path, kind: str, texts: list) -> Path:
    """A one-column table of `texts` at path.kind (parquet, or an arrow stream)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table, path = pa.table({"text": texts}), path.with_suffix(f".{kind}")
    if kind == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    return path


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_table_record_over_the_limit_is_named_or_skipped(tmp_path, kind):
    path = _table(tmp_path / "t", kind, ["a", "z" * 500, None, "b"])
    with pytest.raises(DataFormatError, match=rf"t.{kind}: row 2: a record of 500 bytes, over "
                                              r"data.max_document_bytes = 499"):
        documents(path, max_document_bytes=499)
    assert documents(path, max_document_bytes=499, on_bad_record="skip") == ["a", "b"]


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_table_record_at_the_limit_is_read_and_one_byte_over_is_not(tmp_path, kind):
    """As the jsonl path's: the limit is the largest record read. Alone the record at the limit is read
    with its column whole; beside one a byte over, row by row (each row's size against the limit)."""
    at = _table(tmp_path / "at", kind, ["a", "z" * 500, "b"])
    assert documents(at, max_document_bytes=500) == ["a", "z" * 500, "b"]
    both = _table(tmp_path / "both", kind, ["a", "z" * 500, "y" * 501, "b"])
    with pytest.raises(DataFormatError, match=rf"both.{kind}: row 3: a record of 501 bytes, over "
                                              r"data.max_document_bytes = 500"):
        documents(both, max_document_bytes=500)
    assert documents(both, max_document_bytes=500, on_bad_record="skip") == ["a", "z" * 500, "b"]
    assert documents(both, max_document_bytes=501) == ["a", "z" * 500, "y" * 501, "b"]


def test_the_limit_is_a_key_a_flag_and_part_of_the_plan(tmp_path, tokenizer, capsys):
    from hybridpar.cli import main
    from hybridpar.config import ConfigError, load_config

    assert load_config(None, []).data.max_document_bytes == 64 << 20
    with pytest.raises(ConfigError, match="data.max_document_bytes must be >= 1, got 0"):
        load_config(None, ["--data.max_document_bytes=0"])
    (tmp_path / "d.jsonl").write_text('{"text": "short"}\n' + json.dumps({"text": "long " * 100}) + "\n")
    args = ["prepare", str(tmp_path / "d.jsonl"), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "s")]
    assert main(args + ["--max-document-bytes", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the start, then the error in one line
    assert len(err) == 2 and f"{tmp_path / 'd.jsonl'}:2: a record of 512 bytes, over data.max_document_bytes = 100" \
        in err[1], err
    assert main(args + ["--max-document-bytes", "100", "--on-bad-record", "skip", "--max-bad-records", "1"]) == 0
    store = TokenStore(tmp_path / "s")
    assert store.n_documents == 1 and store.meta["files"][0]["skipped"] == 1
    plan = json.loads((tmp_path / "s" / "plan.json").read_text())
    assert plan["max_document_bytes"] == 100
    with pytest.raises(ValueError, match=r"holds a store of other input \(max_document_bytes differ"):
        prepare_store(tmp_path / "d.jsonl", tokenizer, tmp_path / "s", on_bad_record="skip", report=False)


def test_the_configs_limit_reaches_the_store_a_run_prepares(tmp_path, tokenizer):
    from hybridpar.config import load_config
    from hybridpar.data import build_data

    (tmp_path / "d.jsonl").write_text('{"text": "short"}\n' + json.dumps({"text": "long " * 100}) + "\n")
    flags = [f"--data.source={tmp_path / 'd.jsonl'}", f"--data.tokenizer={tokenizer.path}", "--data.val_fraction=0",
             f"--data.cache_dir={tmp_path / 'cache'}", "--data.max_document_bytes=100"]
    with pytest.raises(DataFormatError, match=r"d.jsonl:2: a record of 512 bytes, over data.max_document_bytes = 100"):
        build_data(load_config(None, flags).data)
    _, windows, _ = build_data(load_config(None, flags[:-1] + ["--data.seq_len=4"]).data)
    assert windows.token_file.n_documents == 2
