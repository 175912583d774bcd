"""Every record exactly once: any cut of a file into units, links in data folders, sources named twice."""

import gzip
import json
import os
import random

import pytest

from hybridpar.data import formats, prepare_store
from hybridpar.data.formats import DataFormatError, plan_units, unit_documents
from hybridpar.data.sources import resolve_sources


def documents(source, unit_bytes=1 << 30, **kwargs) -> list[str]:
    """Every document of `source`, read unit by unit as a store's preparation reads them."""
    return ["".join(pieces) for unit in plan_units(resolve_sources(source), "text", unit_bytes)
            for pieces in unit_documents(unit, "text", **kwargs)]


def random_jsonl(rng: random.Random, n: int) -> tuple[bytes, list[str]]:
    """n records with text of random length (newlines, multi-byte characters, empty) between blank
    lines, whitespace-only lines and \\r\\n line ends; the last line with or without a newline."""
    alphabet = "ab c\n\té€😀 {}\"\\"
    lines, texts = [], []
    for _ in range(n):
        while rng.random() < 0.2:
            lines.append(rng.choice(["", "  ", "\t", "\r"]))
        text = "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 5, 40, 300])))
        texts.append(text)
        lines.append(json.dumps({"id": len(texts), "text": text}, ensure_ascii=rng.random() < 0.5))
    ends = [rng.choice(["\n", "\r\n"]) for _ in lines]
    data = "".join(line + end for line, end in zip(lines, ends))
    if rng.random() < 0.5:
        data = data[: -len(ends[-1])]
    return data.encode(), texts


def test_a_100_line_file_gives_100_documents_at_every_unit_size(tmp_path):
    """Split at every byte offset (each unit size from 1 to the file's length): each line read
    exactly once. Before, 1,024-byte units read 124 documents and 1-byte units 199."""
    texts = [f"document {i} " + "x" * (i % 7) for i in range(100)]
    path = tmp_path / "hundred.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    size = path.stat().st_size
    wrong = {u: len(d) for u in range(1, size + 1) if (d := documents(path, u)) != texts}
    assert not wrong, f"unit sizes whose documents differ (size: documents): {dict(list(wrong.items())[:10])}"


@pytest.mark.parametrize("seed", range(6))
def test_random_jsonl_at_random_unit_sizes_reads_each_record_once(tmp_path, seed):
    rng = random.Random(seed)
    data, texts = random_jsonl(rng, rng.randint(1, 40))
    path = tmp_path / "r.jsonl"
    path.write_bytes(data)
    sizes = {1, 2, 3, len(data) - 1, len(data), len(data) + 7} | {rng.randint(1, len(data)) for _ in range(30)}
    for unit_bytes in sorted(s for s in sizes if s >= 1):
        assert documents(path, unit_bytes) == texts, (seed, unit_bytes)


def test_the_token_stream_is_the_same_at_every_unit_size(tmp_path, tokenizer):
    rng = random.Random(7)
    data, texts = random_jsonl(rng, 12)
    path = tmp_path / "r.jsonl"
    path.write_bytes(data)
    whole = prepare_store(path, tokenizer, tmp_path / "whole", workers=1, report=False)
    assert whole.n_documents == len(texts) - texts.count("")  # an empty text adds nothing, not even an EOS
    for unit_bytes in (1, 13, rng.randint(14, 400), len(data) - 1):
        store = prepare_store(path, tokenizer, tmp_path / f"u{unit_bytes}", workers=1, report=False,
                              unit_bytes=unit_bytes)
        assert store.n_documents == whole.n_documents and store.array().tolist() == whole.array().tolist(), unit_bytes


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_a_last_line_without_a_newline_is_read(tmp_path, kind):
    import zstandard

    data = b'{"text": "one"}\n\n{"text": "two"}\r\n{"text": "last"}'
    compress = {"jsonl": bytes, "jsonl.gz": gzip.compress, "jsonl.zst": zstandard.ZstdCompressor().compress}[kind]
    (tmp_path / f"d.{kind}").write_bytes(compress(data))
    assert documents(tmp_path / f"d.{kind}") == ["one", "two", "last"]


def test_zstd_frames_of_every_size_are_read_whole(tmp_path, monkeypatch):
    """Many frames, small and large, ending anywhere in the reads and the decompressor's feeds."""
    import zstandard

    from hybridpar.data import streams

    monkeypatch.setattr(streams, "_READ", 1000)
    rng = random.Random(3)
    data, texts = random_jsonl(rng, 200)
    frames, at = [], 0
    while at < len(data):
        step = rng.choice([1, 7, 60, 700, 5000])
        frames.append(zstandard.ZstdCompressor(level=rng.choice([1, 3, 19])).compress(data[at: at + step]))
        at += step
    (tmp_path / "f.jsonl.zst").write_bytes(b"".join(frames))
    assert documents(tmp_path / "f.jsonl.zst") == texts
    (tmp_path / "cut.jsonl.zst").write_bytes(b"".join(frames)[:-3])
    with pytest.raises(DataFormatError, match=r"cut.jsonl.zst: the zstd stream is (cut short|damaged)"):
        documents(tmp_path / "cut.jsonl.zst")


@pytest.mark.parametrize("kind", ["parquet", "arrow", "arrow-file"])
def test_tables_at_random_unit_sizes_give_the_same_documents(tmp_path, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(5)
    texts = ["".join(rng.choice("ab \n€") for _ in range(rng.randint(0, 200))) for _ in range(300)]
    table = pa.table({"text": texts})
    path = tmp_path / f"t.{kind.split('-')[0]}"
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=23)
    else:
        with pa.OSFile(str(path), "wb") as sink:
            writer = (pa.ipc.new_file if kind == "arrow-file" else pa.ipc.new_stream)(sink, table.schema)
            for batch in table.to_batches(max_chunksize=17):
                writer.write_batch(batch)
            writer.close()
    for unit_bytes in [1, 1 << 30] + [rng.randint(2, 20_000) for _ in range(8)]:
        assert documents(path, unit_bytes) == texts, unit_bytes


def test_unit_sizes_below_one_byte_are_refused(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"the unit of work must be at least 1 byte, got {bad}"):
            plan_units(resolve_sources(tmp_path / "d.jsonl"), "text", bad)


# --- pieces ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_pieces_are_bounded_and_the_same_however_the_text_arrives(seed, monkeypatch):
    monkeypatch.setattr(formats, "PIECE_CHARS", 8)
    rng = random.Random(seed)
    kinds = ["ab cd\n ef\n\ngh\n", "word " * 50, "x" * 500, "a\n" * 30, "  \t  " * 20]
    text = "".join(rng.choice(kinds) for _ in range(40))
    whole = list(formats.cut(text))
    assert "".join(whole) == text
    assert max(map(len, whole)) <= (formats._LONGEST_PIECE + 1) * 8  # formats.MAX_PIECE_CHARS at PIECE_CHARS 8
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), 30))
        blocks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert list(formats._pieces(blocks)) == whole


def test_text_without_newlines_is_cut_before_a_space_else_anywhere(monkeypatch):
    monkeypatch.setattr(formats, "PIECE_CHARS", 10)
    words = " ".join(f"w{i:03d}" for i in range(200))
    pieces = list(formats.cut(words))
    assert "".join(pieces) == words and len(pieces) > 10
    assert all(p.startswith(" ") for p in pieces[1:]) and max(len(p) for p in pieces[:-1]) < 20  # words whole
    assert len(pieces[-1]) <= 169  # the rest, once it fits in a piece's reach
    pieces = list(formats.cut("y" * 1000))
    assert [len(p) for p in pieces] == [169] * 5 + [155]  # 10 - 1 + 16 x 10 characters each


# --- links and sources named twice -------------------------------------------------------------------

def write_documents(path, n: int) -> None:
    path.write_text("".join(json.dumps({"text": f"document {i} of {path.name}"}) + "\n" for i in range(n)))


def test_a_folder_linking_to_itself_is_read_once(tmp_path, tokenizer, capsys):
    """Before, `again -> .` was walked 41 times: 150 documents became 6,150."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_documents(folder / "docs.jsonl", 150)
    os.symlink(".", folder / "again")
    os.symlink("docs.jsonl", folder / "same.jsonl")
    os.symlink(str(folder / "docs.jsonl"), folder / "sub-link.jsonl")
    store = prepare_store(folder, tokenizer, tmp_path / "s", workers=1, report=False)
    assert store.n_documents == 150 and len(store.meta["files"]) == 1
    err = capsys.readouterr().err
    assert err.count("already read, read once") == 1, err
    assert f"{folder / 'again'} is a link to {folder}" in err
    assert f"{folder / 'same.jsonl'} is a link to {folder / 'docs.jsonl'}" in err
    resolve_sources(folder)
    assert "already read" not in capsys.readouterr().err  # said once a process


def test_a_link_to_a_file_of_another_listed_folder_is_read_once(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_documents(tmp_path / "a" / "x.jsonl", 3)
    os.symlink(tmp_path / "a" / "x.jsonl", tmp_path / "b" / "y.jsonl")
    write_documents(tmp_path / "b" / "z.jsonl", 2)
    assert [f.path.name for f in resolve_sources([tmp_path / "a", tmp_path / "b"])] == ["x.jsonl", "z.jsonl"]


@pytest.mark.parametrize("second", ["data/", "./data", "ABS", "link", "data/docs.jsonl", "data/sub", "data/.."])
def test_sources_naming_the_same_data_twice_are_refused(tmp_path, monkeypatch, second):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "sub").mkdir(parents=True)
    write_documents(tmp_path / "data" / "docs.jsonl", 2)
    write_documents(tmp_path / "data" / "sub" / "more.jsonl", 2)
    os.symlink("data", tmp_path / "link")
    second = str(tmp_path / "data") if second == "ABS" else second
    with pytest.raises(ValueError, match=rf"the data sources 'data' and '{second}' (are the same folder|overlap) "
                                         r".*: list each file or folder once"):
        resolve_sources(["data", second])


def test_blend_sources_naming_the_same_folder_twice_are_refused(tmp_path, monkeypatch):
    from hybridpar.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "web").mkdir()
    os.symlink("web", tmp_path / "web-link")
    for other in ("web/", "./web", str(tmp_path / "web"), "web-link"):
        with pytest.raises(ConfigError, match=rf"data.sources entry 2 \('code'\): the source '{other}' and 'web' "
                                              r"\(source 'web'\) are the same folder"):
            load_config(None, [f"--data.sources=web=web@1,code={other}@1"])


def test_files_that_are_not_data_are_named_once(tmp_path, capsys):
    write_documents(tmp_path / "docs.jsonl", 2)
    for name in ("notes.md", "table.csv", ".hidden", "z.py", "w.tsv"):
        (tmp_path / name).write_text("x")
    assert len(resolve_sources(tmp_path)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".hidden" not in err, err
    assert f"data: 4 file(s) in the data folders are not data files and were skipped ({tmp_path / 'notes.md'}, " \
           f"{tmp_path / 'table.csv'}, {tmp_path / 'w.tsv'}, ...)" in err


# --- damaged arrow files -------------------------------------------------------------------------------

def test_a_truncated_arrow_file_is_one_line_at_planning_and_at_reading(tmp_path, tokenizer, capsys):
    import pyarrow as pa

    from hybridpar.cli import main

    table = pa.table({"text": [f"document {i} " * 20 for i in range(400)]})
    path = tmp_path / "d.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream(sink, table.schema)
        for batch in table.to_batches(max_chunksize=50):
            writer.write_batch(batch)
        writer.close()
    whole = path.read_bytes()
    units = plan_units(resolve_sources(path), "text", 1)
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataFormatError, match=rf"{path}: the arrow file is cut short or damaged after 4 record "
                                              r"batches \(.*\); save it again"):
        [list(d) for d in unit_documents(units[-1], "text")]
    assert main(["prepare", str(path), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{path}: the arrow file is cut short or damaged" in err, err



def test_a_damaged_parquet_row_group_is_one_line_at_reading(tmp_path, tokenizer, capsys):
    """The footer reads fine, so planning passes; the damaged page is met when its row group is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridpar.cli import main

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"hello world {i} " * 50 for i in range(2000)]}), path, row_group_size=500)
    page = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    for k in range(page + 10, page + 200):  # the page header of row group 1
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))
    units = plan_units(resolve_sources(path), "text", 1)
    assert [list(d) for d in unit_documents(units[0], "text")]  # row group 0 is whole
    with pytest.raises(DataFormatError, match=rf"{path}: row group 1 of 4 is damaged \(.*\); copy or write the file"):
        [list(d) for d in unit_documents(units[1], "text")]
    assert main(["prepare", str(path), "--tokenizer", str(tokenizer.path), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if not line.startswith("preparing ")]  # the progress line
    assert said == [f"hybridpar: error: {path}: row group 1 of 4 is damaged ("
                    + said[0].split(" is damaged (", 1)[-1]] and "Traceback" not in err, err
