"""Meta's consolidated checkpoints: export at any MP, import at any mp, Meta-style code as the oracle,
and a clear error for every way a checkpoint folder can be broken."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from models.llama import ModelArgs, Transformer
from tests.distributed import parallel_dims, rel_err

BOUND = 1e-5
SEQ = 12
# Fields params.json carries; max_seq_len / max_batch_size stay out (Meta passes them separately).
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
                "norm_eps", "rope_theta", "use_scaled_rope")


def _tokens(args: ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _weight_errors(actual: dict, expected: dict) -> dict:
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    return {f"weight.{k}": rel_err(actual[k], expected[k]) for k in expected}


# Meta's split dimensions, written out here rather than taken from the module under test.
META_SPLIT = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1,
              "attention_norm": None, "ffn_norm": None, "norm": None}


def _meta_split(name: str, llama2: bool):
    if name == "tok_embeddings.weight":
        return 1 if llama2 else 0  # ParallelEmbedding (Llama 2) splits dim, VocabParallelEmbedding rows
    return META_SPLIT[name.split(".")[-2]]


def _check_files(folder: Path, expected: dict, args: ModelArgs, mp_out: int) -> None:
    """The files themselves, read with nothing but torch.load: Meta's names, split dims and shards."""
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["params.json"] + [f"consolidated.{j:02d}.pth" for j in range(mp_out)]
    )
    llama2 = args.resolved_embedding_split == "dim"
    for j in range(mp_out):
        shard = torch.load(folder / f"consolidated.{j:02d}.pth", weights_only=True, map_location="cpu")
        assert set(shard) == set(expected) | ({"rope.freqs"} if llama2 else set())
        for name, full in expected.items():
            d = _meta_split(name, llama2)
            want = full if d is None else full.chunk(mp_out, dim=d)[j]
            assert torch.equal(shard[name], want), f"{name} in file {j}"
            # A view would drag the whole storage into the file: each entry owns exactly its bytes.
            assert shard[name].untyped_storage().nbytes() == want.numel() * want.element_size(), name
        if llama2:
            theta = args.rope_theta
            freqs = 1.0 / theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim)
            assert shard["rope.freqs"].shape == (args.head_dim // 2,)
            torch.testing.assert_close(shard["rope.freqs"], freqs)
    params = json.loads((folder / "params.json").read_text())
    assert "max_seq_len" not in params and "embedding_split" not in params
    assert params["vocab_size"] == (-1 if llama2 else args.vocab_size)


# --- round trip: export at one MP, import at another ------------------------------------------


def _case_round_trip(preset: str, src_mp: int, mp_out: int, dst_mp: int, folder: str):
    from hybridpar.checkpoint import meta_write
    from hybridpar.checkpoint.meta import load_meta_checkpoint, read_meta_params, save_meta_checkpoint
    from hybridpar.parallel.state import full_state_dict

    folder = Path(folder)
    args = ModelArgs.from_preset(preset)
    src_parallel, dst_parallel = parallel_dims(mp=src_mp), parallel_dims(mp=dst_mp)
    torch.manual_seed(0)
    src = Transformer(args, src_parallel)
    expected = full_state_dict(src)
    tokens = _tokens(args)
    with torch.no_grad():
        expected_logits = src(tokens, gather_logits=True)

    # Record which rank writes which file: file j belongs to rank j % world_size. Each file is
    # written through files.atomic_output (a temporary name, renamed when complete): record its path.
    written, real_output = [], meta_write.atomic_output
    meta_write.atomic_output = lambda path, *a, **k: (written.append(Path(path).name), real_output(path, *a, **k))[1]
    try:
        save_meta_checkpoint(src, folder, src_parallel, mp_out)
    finally:
        meta_write.atomic_output = real_output
    if torch.distributed.get_rank() == 0:
        _check_files(folder, expected, args, mp_out)

    loaded_args = read_meta_params(folder, max_seq_len=args.max_seq_len)
    assert {f: getattr(loaded_args, f) for f in SHAPE_FIELDS} == {f: getattr(args, f) for f in SHAPE_FIELDS}
    assert loaded_args.embedding_split == args.resolved_embedding_split
    torch.manual_seed(1)  # other weights: the load must overwrite every one
    dst = Transformer(loaded_args, dst_parallel)
    load_meta_checkpoint(folder, dst, dst_parallel)
    with torch.no_grad():
        logits = dst(tokens, gather_logits=True)
    return written, _weight_errors(full_state_dict(dst), expected), {"logits": rel_err(logits, expected_logits)}


@pytest.mark.parametrize(
    "preset,src_mp,mp_out,dst_mp",
    [
        ("debug", 2, 4, 1), ("debug", 4, 1, 2), ("debug", 1, 2, 4),
        ("debug_llama2", 2, 4, 1), ("debug_llama2", 4, 1, 2), ("debug_llama2", 1, 2, 4),
        # n_kv_heads = 2: import at mp 4 replicates the kv heads (ReplicatedHeadLinear), and export
        # from mp 4 gathers replicated weights.
        ("debug_gqa", 2, 1, 4), ("debug_gqa", 4, 2, 1), ("debug_gqa", 1, 2, 4),
    ],
)
def test_round_trip(workers, check_close, tmp_path, preset, src_mp, mp_out, dst_mp):
    results = workers(4).run(_case_round_trip, preset, src_mp, mp_out, dst_mp, str(tmp_path / "ckpt"))
    for rank, (written, _, _) in enumerate(results):
        assert written == [f"consolidated.{j:02d}.pth" for j in range(mp_out) if j % 4 == rank]
    check_close(f"{preset} mp{src_mp}->MP{mp_out}->mp{dst_mp} weights", [w for _, w, _ in results], 0.0)
    check_close(f"{preset} mp{src_mp}->MP{mp_out}->mp{dst_mp} logits", [logit for _, _, logit in results], BOUND)
    assert not list(tmp_path.glob(".*")), "the temporary folder was left behind"


def _case_fsdp_export(folder: str):
    from hybridpar.checkpoint.meta import load_meta_checkpoint, read_meta_params, save_meta_checkpoint
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.parallel.state import full_state_dict

    args = ModelArgs.from_preset("debug_gqa")
    parallel = parallel_dims(mp=2, dp_shard=2)
    torch.manual_seed(0)
    model = Transformer(args, parallel)
    expected = full_state_dict(model)
    tokens = _tokens(args)
    with torch.no_grad():
        expected_logits = model(tokens, gather_logits=True)
    apply_fsdp(model, parallel)  # hybrid_shard, bf16 compute: the stored parameters stay fp32
    model(tokens).sum().backward()  # leave FSDP in its after-step state
    placements = str(model.layers[0].attention.wq.weight.placements)
    save_meta_checkpoint(model, folder, parallel, 2)

    p1 = parallel_dims(mp=1)
    plain = Transformer(read_meta_params(folder, max_seq_len=args.max_seq_len), p1)
    load_meta_checkpoint(folder, plain, p1)
    with torch.no_grad():
        logits = plain(tokens, gather_logits=True)
    return placements, _weight_errors(full_state_dict(plain), expected), {"logits": rel_err(logits, expected_logits)}


def test_export_from_fsdp_wrapped_model(workers, check_close, tmp_path):
    results = workers(4).run(_case_fsdp_export, str(tmp_path / "ckpt"))
    # The parameters really were FSDP's: sharded over dp_shard on top of the mp split.
    assert "_StridedShard" in results[0][0], results[0][0]
    check_close("fsdp mp2xdp2 -> MP2 -> mp1 weights", [w for _, w, _ in results], 0.0)
    check_close("fsdp mp2xdp2 -> MP2 -> mp1 logits", [logit for _, _, logit in results], BOUND)


def _case_bf16_export(folder: str):
    from hybridpar.checkpoint.meta import load_meta_checkpoint, read_meta_params, save_meta_checkpoint
    from hybridpar.parallel.state import full_state_dict

    args = ModelArgs.from_preset("debug_llama2")
    parallel = parallel_dims(mp=2)
    torch.manual_seed(0)
    model = Transformer(args, parallel)
    expected = {k: v.to(torch.bfloat16).float() for k, v in full_state_dict(model).items()}
    save_meta_checkpoint(model, folder, parallel, 2, dtype=torch.bfloat16)  # as Meta's releases
    dtypes = {v.dtype for v in torch.load(Path(folder, "consolidated.01.pth"), weights_only=True).values()}
    p1 = parallel_dims(mp=1)
    plain = Transformer(read_meta_params(folder), p1)  # rope.freqs checked at bf16 precision
    load_meta_checkpoint(folder, plain, p1)
    return dtypes, _weight_errors(full_state_dict(plain), expected)


def test_bf16_export(workers, check_close, tmp_path):
    results = workers(4).run(_case_bf16_export, str(tmp_path / "ckpt"))
    assert results[0][0] == {torch.bfloat16}
    check_close("bf16 MP2 -> mp1 weights (vs bf16-rounded)", [w for _, w in results], 0.0)


# --- Meta-style code as the oracle --------------------------------------------------------------


def _case_meta_oracle(preset: str, overrides: dict, llama_version: int, folder: str):
    from hybridpar.checkpoint.meta import load_meta_checkpoint, read_meta_params, save_meta_checkpoint
    from hybridpar.compat.fairscale import use_mesh
    from tests.checkpoint import meta_reference

    args = ModelArgs.from_preset(preset, **overrides)
    tokens = _tokens(args)
    source_parallel = parallel_dims(mp=4)
    torch.manual_seed(0)
    source = Transformer(args, source_parallel)
    save_meta_checkpoint(source, folder, source_parallel, 2)

    # Meta's way: each of the 2 model-parallel ranks loads its own consolidated file.
    reference_parallel = parallel_dims(mp=2)
    with use_mesh(reference_parallel):
        reference = meta_reference.build(folder, llama_version=llama_version, vocab_size=args.vocab_size)
        expected = reference(tokens)

    errors = {}
    for mp in (1, 2, 4):
        parallel = parallel_dims(mp=mp)
        model = Transformer(read_meta_params(folder, max_seq_len=args.max_seq_len), parallel)
        load_meta_checkpoint(folder, model, parallel)
        with torch.no_grad():
            errors[f"mp{mp}"] = rel_err(model(tokens, gather_logits=True), expected)
    return errors


@pytest.mark.parametrize(
    "preset,overrides,llama_version",
    [
        ("debug_llama2", {}, 2),
        ("debug", {}, 3),
        # Llama 3.1 shaped: GQA and scaled RoPE frequencies; 2 kv heads at mp 2 is one per rank...
        ("debug_gqa", {}, 3),
        # ...so also 4 kv heads, two per rank: which query heads share which kv head matters here.
        ("debug_gqa", {"n_kv_heads": 4}, 3),
        # Llama 3.2 shaped (RoPE factor aside: Meta's code fixes 8): Meta's code loads the tied
        # model's output.weight copy, and builds the feed-forward size from params.json's fields.
        ("debug", {"tie_embeddings": True, "ffn_hidden_size": 100}, 3),
    ],
    ids=["llama2", "llama3", "llama3.1-gqa2", "llama3.1-gqa4", "llama3.2-tied-ffn100"],
)
def test_meta_reference_code_agrees(workers, check_close, tmp_path, preset, overrides, llama_version):
    results = workers(4).run(_case_meta_oracle, preset, overrides, llama_version, str(tmp_path / "ckpt"))
    check_close(f"{preset}{overrides or ''} Meta-style reference at mp2 vs hybridpar mp1/2/4", results, BOUND)


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
    assert "unknown field(s) ['rope_scaling']" in message and "Remove the unknown" in message, message


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

SOURCES = [Path(__file__).parents[2] / "hybridpar" / "checkpoint" / "meta.py", Path(__file__).parent / "meta_reference.py",
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
