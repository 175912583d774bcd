"""Meta's consolidated checkpoints, the ways a folder or a save can fail: a clear error for every
one, naming the file and what to change; and torch.load used with weights_only=True throughout."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer
from tests.distributed import parallel_dims


# --- errors -------------------------------------------------------------------------------------


def _case_export(preset: str, mp_out: int, folder: str) -> None:
    from hybridpar.checkpoint.meta import save_meta_checkpoint

    parallel = parallel_dims(mp=2)
    torch.manual_seed(0)
    save_meta_checkpoint(Transformer(ModelArgs.from_preset(preset), parallel), folder, parallel, mp_out)


@pytest.fixture(scope="module")
def meta_folders(workers, tmp_path_factory):
    """Valid checkpoints to break: debug at MP 4 (Llama 3 layout), debug_llama2 at MP 2 (Llama 2)."""
    root = tmp_path_factory.mktemp("meta")
    workers(4).run(_case_export, "debug", 4, str(root / "llama3_mp4"))
    workers(4).run(_case_export, "debug_llama2", 2, str(root / "llama2_mp2"))
    return root


@pytest.fixture
def broken(meta_folders, tmp_path):
    """broken(name) -> a fresh copy of a valid checkpoint folder to damage."""

    def copy(name: str = "llama3_mp4") -> Path:
        target = tmp_path / name
        shutil.copytree(meta_folders / name, target)
        return target

    return copy


def _read_error(folder: Path) -> str:
    from hybridpar.checkpoint.meta import MetaCheckpointError, read_meta_params

    with pytest.raises(MetaCheckpointError) as info:
        read_meta_params(folder)
    return str(info.value)


def _edit_params(folder: Path, **changes) -> None:
    params = json.loads((folder / "params.json").read_text())
    for key, value in changes.items():
        if value is None:
            del params[key]
        else:
            params[key] = value
    (folder / "params.json").write_text(json.dumps(params))


def _edit_shard(folder: Path, index: int, edit) -> None:
    path = folder / f"consolidated.{index:02d}.pth"
    state = torch.load(path, weights_only=True, map_location="cpu")
    edit(state)
    torch.save(state, path)


def test_valid_folders_read(meta_folders):
    from hybridpar.checkpoint.meta import read_meta_params

    llama3 = read_meta_params(meta_folders / "llama3_mp4")
    assert (llama3.vocab_size, llama3.embedding_split, llama3.max_seq_len) == (128, "vocab", 2048)
    # Llama 2: vocab_size -1 in params.json, the vocabulary from the tok_embeddings shape.
    assert json.loads((meta_folders / "llama2_mp2" / "params.json").read_text())["vocab_size"] == -1
    llama2 = read_meta_params(meta_folders / "llama2_mp2", max_seq_len=64)
    assert (llama2.vocab_size, llama2.embedding_split, llama2.max_seq_len) == (128, "dim", 64)


def test_missing_shard_is_named(broken):
    folder = broken()
    (folder / "consolidated.02.pth").unlink()
    message = _read_error(folder)
    assert "missing consolidated.02.pth (found consolidated.{00, 01, 03}.pth)" in message, message


def test_no_shards(broken):
    folder = broken()
    for path in folder.glob("*.pth"):
        path.unlink()
    assert f"no consolidated.NN.pth files in {folder}" in _read_error(folder)


def test_lost_trailing_shards_give_the_implied_count(broken):
    folder = broken()
    (folder / "consolidated.02.pth").unlink()
    (folder / "consolidated.03.pth").unlink()
    message = _read_error(folder)
    assert "found 2 consolidated file(s)" in message and "has 16 rows" in message, message
    assert "dim = 64, which implies 64 / 16 = 4 files" in message, message


def test_truncated_file_is_named(broken):
    folder = broken()
    path = folder / "consolidated.01.pth"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = _read_error(folder)
    assert f"{path} cannot be read (" in message and "truncated or corrupt" in message, message
    # Named from the zip's own records: the first tensor whose bytes the file lacks.
    assert f"cut short: it has {path.stat().st_size} bytes, but the bytes of " in message, message


def test_lost_zip_directory_is_named(broken):
    folder = broken()
    path = folder / "consolidated.02.pth"
    path.write_bytes(path.read_bytes()[:-10])  # every tensor there, the directory written last is not
    message = _read_error(folder)
    assert "every tensor's bytes are there, but the zip directory torch.save writes last is cut off" in message, message


def test_unsafe_pickle_is_refused_as_such(broken, tmp_path):
    """A tensor replaced by a call that makes a marker and returns the tensor: run, the file would
    load as a well-formed {name: tensor}; neither the pre-check's skeleton unpickler nor the load may run it."""
    from hybridpar.checkpoint.meta import MetaCheckpointError, read_meta_params
    from tests.untrusted import TOUCH_THEN, RunsCode, never_ran

    folder, marker = broken(), tmp_path / "marker"
    path = folder / "consolidated.00.pth"
    state = torch.load(path, weights_only=True)
    name = next(iter(state))
    state[name] = RunsCode(marker, state[name])
    torch.save(state, path)
    message = str(never_ran(marker, lambda: read_meta_params(folder), MetaCheckpointError))
    assert f"{path}: unsafe pickle refused: loading it would import and run {TOUCH_THEN}" in message, message
    assert "truncated" not in message, message


def test_garbage_file_is_named(broken):
    folder = broken()
    path = folder / "consolidated.03.pth"
    path.write_bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes())
    message = _read_error(folder)
    assert f"{path} cannot be read (" in message and "truncated or corrupt" in message, message


def test_damaged_tensor_bytes_caught_by_checksums(broken):
    import zipfile

    from hybridpar.checkpoint.meta import MetaCheckpointError, read_meta_params

    folder = broken()
    path = folder / "consolidated.01.pth"
    entry = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("/data/0"))
    data = bytearray(path.read_bytes())
    start = entry.header_offset + 30 + len(entry.filename) + entry.file_size // 2  # inside the tensor bytes
    data[start : start + 16] = bytes(b ^ 0xFF for b in data[start : start + 16])
    path.write_bytes(bytes(data))
    read_meta_params(folder)  # memory-mapped: the payload is not read, so this cannot notice
    with pytest.raises(MetaCheckpointError) as info:
        read_meta_params(folder, verify_checksums=True)
    assert f"{path}: entry" in str(info.value) and "fails its CRC-32 check" in str(info.value), str(info.value)


@pytest.mark.parametrize("field", ["dim", "n_heads", "vocab_size"])
def test_params_json_missing_field(broken, field):
    folder = broken()
    _edit_params(folder, **{field: None})
    message = _read_error(folder)
    assert f"required field(s) ['{field}'] missing" in message and "params.json" in message, message


def test_params_json_unknown_field(broken):
    folder = broken()
    _edit_params(folder, rope_scaling=8.0)
    message = _read_error(folder)
    assert "unknown model fields ['rope_scaling']" in message and "Remove the unknown" in message, message


def test_params_json_not_json(broken):
    folder = broken()
    (folder / "params.json").write_text('{"dim": 64,')
    assert "params.json is not readable JSON" in _read_error(folder)


def test_shape_disagreeing_with_params_json(broken):
    folder = broken()
    _edit_params(folder, n_kv_heads=4)  # the files hold 8 kv heads
    message = _read_error(folder)
    assert f"layers.0.attention.wk.weight in {folder / 'consolidated.00.pth'} has shape [16, 64]" in message, message
    assert "params.json implies [8, 64] (full [32, 64] split on dim 0 into 4 files)" in message, message


def test_tensor_with_wrong_shape_in_one_file(broken):
    folder = broken()
    _edit_shard(folder, 1, lambda s: s.update({"layers.1.feed_forward.w1.weight": torch.zeros(40, 64)}))
    message = _read_error(folder)
    assert f"layers.1.feed_forward.w1.weight in {folder / 'consolidated.01.pth'} has shape [40, 64]" in message, message
    assert "implies [48, 64] (full [192, 64] split on dim 0 into 4 files)" in message, message


def test_missing_and_unexpected_keys(broken):
    folder = broken()
    _edit_shard(folder, 2, lambda s: s.pop("layers.1.ffn_norm.weight"))
    message = _read_error(folder)
    assert "consolidated.02.pth" in message and "missing keys ['layers.1.ffn_norm.weight']" in message, message
    folder = broken("llama2_mp2")
    _edit_shard(folder, 0, lambda s: s.update({"layers.2.ffn_norm.weight": torch.ones(64)}))
    message = _read_error(folder)
    assert "consolidated.00.pth" in message and "unexpected keys ['layers.2.ffn_norm.weight']" in message, message


def test_vocab_size_disagreeing_with_embeddings(broken):
    folder = broken()
    _edit_params(folder, vocab_size=100)
    message = _read_error(folder)
    assert "vocab_size = 100" in message and "holds 128 tokens" in message, message


def test_rope_freqs_checked(broken):
    folder = broken("llama2_mp2")
    _edit_params(folder, rope_theta=500000.0)
    message = _read_error(folder)
    assert f"rope.freqs in {folder / 'consolidated.00.pth'} differs" in message and "rope_theta = 500000.0" in message, message


def _case_save_and_load_errors(folder: str) -> list:
    from hybridpar.checkpoint.meta import MetaCheckpointError, load_meta_checkpoint, save_meta_checkpoint
    from hybridpar.parallel.fsdp import apply_fsdp

    messages = []

    def expect_error(fn, *args):
        try:
            fn(*args)
        except MetaCheckpointError as err:
            messages.append(str(err))
        else:
            raise AssertionError(f"{fn.__name__}{args} raised nothing")

    parallel = parallel_dims(mp=2)
    gqa = Transformer(ModelArgs.from_preset("debug_gqa"), parallel)
    expect_error(save_meta_checkpoint, gqa, folder + "/gqa", parallel, 4)  # n_kv_heads = 2
    debug = Transformer(ModelArgs.from_preset("debug"), parallel)
    save_meta_checkpoint(debug, folder + "/debug", parallel, 2)
    expect_error(save_meta_checkpoint, debug, folder + "/debug", parallel, 2)  # exists
    save_meta_checkpoint(debug, folder + "/debug", parallel, 1, overwrite=True)
    assert len(list(Path(folder, "debug").glob("*.pth"))) == 1
    deeper = Transformer(ModelArgs.from_preset("debug", n_layers=3), parallel)
    expect_error(load_meta_checkpoint, folder + "/debug", deeper, parallel)
    fewer_kv = Transformer(ModelArgs.from_preset("debug", n_kv_heads=4), parallel)
    expect_error(load_meta_checkpoint, folder + "/debug", fewer_kv, parallel)
    other_theta = Transformer(ModelArgs.from_preset("debug", rope_theta=20000.0), parallel)
    expect_error(load_meta_checkpoint, folder + "/debug", other_theta, parallel)
    expect_error(load_meta_checkpoint, folder + "/debug", apply_fsdp(debug, parallel), parallel)
    return messages


def test_save_and_load_errors(workers, tmp_path):
    results = workers(4).run(_case_save_and_load_errors, str(tmp_path))
    assert all(r == results[0] for r in results), "every rank raises the same error"
    kv, exists, layers, shape, theta, fsdp = results[0]
    assert "mp_out = 4: n_kv_heads = 2 is not divisible by it" in kv, kv
    assert "debug already exists" in exists and "overwrite=True" in exists, exists
    assert "the model does not match the checkpoint" in layers and "model keys the checkpoint lacks ['layers.2." in layers, layers
    assert "layers.0.attention.wk.weight: the model's full shape is [32, 64]" in shape and "holds [64, 64]" in shape, shape
    assert "rope_theta = 10000.0 (model: 20000.0)" in theta, theta
    assert "load before apply_fsdp" in fsdp, fsdp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["debug"], "no temporary folder left behind"


def _case_save_fails_on_rank1(folder: str) -> str:
    """Rank 1 cannot write its consolidated file (a full disk)."""
    import contextlib

    import torch.distributed as dist

    from hybridpar.checkpoint import meta_write
    from hybridpar.checkpoint.meta import save_meta_checkpoint

    @contextlib.contextmanager
    def full_disk(path, mode="wb"):
        raise OSError(28, "No space left on device", str(path))
        yield

    parallel = parallel_dims(mp=2)
    model = Transformer(ModelArgs.from_preset("debug"), parallel)
    real = meta_write.atomic_output
    if dist.get_rank() == 1:
        meta_write.atomic_output = full_disk
    try:
        save_meta_checkpoint(model, folder, parallel, 2)
    except Exception as err:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(err).__name__}: {err}"
    finally:
        meta_write.atomic_output = real  # the worker processes serve later tests
    return "no error"


def test_a_rank_that_cannot_write_fails_every_rank_and_leaves_nothing(workers, tmp_path):
    folder = tmp_path / "meta"
    results = workers(4).run(_case_save_fails_on_rank1, str(folder))
    own = f"OSError: [Errno 28] No space left on device: '{folder}.partial/consolidated.01.pth'"
    assert results[1] == own, results
    assert results[0] == results[2] == results[3] == f"MetaCheckpointError: rank 1 could not write {folder}: {own}"
    assert list(tmp_path.iterdir()) == [], "neither the folder nor its staging folder is left"


# --- torch.load hygiene -------------------------------------------------------------------------

SOURCES = [Path(__file__).parents[2] / "hybridpar" / "checkpoint" / "meta.py",
           *(Path(__file__).parent / name for name in ("meta_reference.py", "test_meta.py", "test_meta_fields.py")),
           Path(__file__)]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_torch_load_always_weights_only(path):
    calls = [
        node for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
    ]
    assert calls, f"no torch.load in {path.name}?"
    for call in calls:
        flags = {k.arg: k.value for k in call.keywords}
        assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, (
            f"{path.name}:{call.lineno}: torch.load without weights_only=True"
        )


def test_reading_memory_maps_weights_only(meta_folders, monkeypatch):
    from hybridpar.checkpoint.meta import read_meta_params

    seen, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: (seen.append(k), real_load(*a, **k))[1])
    read_meta_params(meta_folders / "llama3_mp4")
    assert len(seen) == 4 and all(k.get("weights_only") is True and k.get("mmap") is True for k in seen), seen
