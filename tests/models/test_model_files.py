"""Strict model files: Meta's params.json (read alone or in a checkpoint folder) and Hugging Face's
config.json refuse a missing shape field, a field of the wrong JSON type, an unknown field and a
value out of range, naming the field, before any model is built; Meta's published files load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.mesh.ranks import raised_by_every_rank
from hybridpar.models.args import ModelArgs
from tests.models.meta_files import PUBLISHED_PARAMS

SMALL = {"dim": 64, "n_layers": 2, "n_heads": 8, "vocab_size": 128}  # the shape fields, nothing else


def _from_params_json(folder: Path) -> ModelArgs:
    return ModelArgs.from_params_json(folder / "params.json")


def _meta_folder_params(folder: Path) -> ModelArgs:
    from hybridpar.checkpoint.meta_json import read_params  # read_meta_params' reader of params.json

    return ModelArgs.from_dict(read_params(folder))


READERS = {"from_params_json": _from_params_json, "meta_folder": _meta_folder_params}


def _write(folder: Path, params) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps(params))
    return folder


def _error(reader, folder: Path) -> str:
    with pytest.raises(ValueError) as info:
        READERS[reader](folder)
    assert raised_by_every_rank(info.value), "every rank reads the same file: the CLI prints the error once"
    assert str(folder / "params.json") in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_meta_published_params_json_loads(tmp_path, reader, name):
    args = READERS[reader](_write(tmp_path, PUBLISHED_PARAMS[name]))
    preset = ModelArgs.from_preset(name)  # Meta's published shapes (test_llama checks their sizes)
    fields = ("dim", "n_layers", "n_heads", "kv_heads", "ffn_hidden_dim", "rope_theta", "use_scaled_rope")
    assert [getattr(args, f) for f in fields] == [getattr(preset, f) for f in fields]
    if name.startswith("llama2"):  # vocab_size -1: the tokenizer decides, as Meta's code has it
        assert args.vocab_size == -1
        args = ModelArgs.from_dict(vars(args), vocab_size=32000)
    args.check(8)


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("field", ["dim", "n_layers", "n_heads", "vocab_size"])
def test_a_missing_shape_field_is_refused(tmp_path, reader, field):
    # Without dim, Meta's default 4096 would build 405.8M parameters here instead of 0.15M (the tiny
    # preset's fields: 772.8M instead of 5M).
    params = {k: v for k, v in SMALL.items() if k != field}
    message = _error(reader, _write(tmp_path, params))
    assert f"required field(s) ['{field}'] missing" in message, message


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("change,expected", [
    ({"dim": "256"}, '"dim" must be an integer, got the string "256"'),
    ({"dim": 64.0}, '"dim" must be an integer, got the number 64.0'),
    ({"n_layers": True}, '"n_layers" must be an integer, got true'),  # a bool is no integer here
    ({"n_heads": None}, '"n_heads" must be an integer, got null'),  # Meta's code allows no None there
    ({"vocab_size": [128]}, '"vocab_size" must be an integer, got a list [128]'),
    ({"norm_eps": "1e-5"}, '"norm_eps" must be a number, got the string "1e-5"'),
    ({"rope_theta": None}, '"rope_theta" must be a number, got null'),
    ({"use_scaled_rope": 1}, '"use_scaled_rope" must be true or false, got the number 1'),
    ({"n_kv_heads": "2"}, '"n_kv_heads" must be an integer or null, got the string "2"'),
    ({"ffn_dim_multiplier": False}, '"ffn_dim_multiplier" must be a number or null, got false'),
    ({"embedding_split": 1}, '"embedding_split" must be a string, got the number 1'),
    ({"tie_embeddings": "yes"}, '"tie_embeddings" must be true or false, got the string "yes"'),
])
def test_a_field_of_the_wrong_type_is_named_with_its_type(tmp_path, reader, change, expected):
    message = _error(reader, _write(tmp_path, {**SMALL, **change}))
    assert expected in message, message


@pytest.mark.parametrize("reader", sorted(READERS))
def test_an_unknown_field_is_refused(tmp_path, reader):
    message = _error(reader, _write(tmp_path, {**SMALL, "n_layer": 2}))
    assert "unknown model fields ['n_layer']; valid fields are" in message, message
    assert "Remove the unknown ones (or fix their spelling)" in message, message


@pytest.mark.parametrize("reader", sorted(READERS))
def test_null_and_integers_where_meta_allows_them(tmp_path, reader):
    # rope_theta: an integer where a number is expected
    params = {**SMALL, "n_kv_heads": None, "ffn_dim_multiplier": None, "rope_theta": 500000}
    args = READERS[reader](_write(tmp_path, params))
    assert (args.kv_heads, args.ffn_dim_multiplier, args.rope_theta) == (8, None, 500000)
    assert args.ffn_hidden_dim == ModelArgs.from_dict(SMALL).ffn_hidden_dim


@pytest.mark.parametrize("change,expected", [
    ({"dim": 0}, "dim = 0 must be positive"),
    ({"n_layers": -1}, "n_layers = -1 must be positive"),
    ({"n_heads": 0}, "n_heads = 0 must be positive"),
    ({"vocab_size": 0}, "vocab_size = 0 must be positive (or -1: the tokenizer decides)"),
    ({"n_heads": 5}, "dim = 64 is not divisible by n_heads = 5"),
    ({"n_kv_heads": 3}, "n_heads = 8 is not a multiple of n_kv_heads = 3"),
    ({"multiple_of": 0}, "multiple_of = 0 must be positive"),
    ({"norm_eps": -1e-5}, "norm_eps = -1e-05 must be a positive number"),
    ({"ffn_dim_multiplier": 0.0}, "ffn_dim_multiplier = 0.0 must be a positive number"),
    ({"max_seq_len": 0}, "max_seq_len = 0 must be positive"),
])
def test_a_value_out_of_range_is_named(tmp_path, change, expected):
    message = _error("from_params_json", _write(tmp_path, {**SMALL, **change}))
    assert expected in message, message


def test_not_an_object_and_not_json(tmp_path):
    message = _error("from_params_json", _write(tmp_path, [SMALL]))
    assert "holds a list, not a JSON object" in message, message
    (tmp_path / "params.json").write_text('{"dim": 64,')
    assert "is not readable JSON" in _error("from_params_json", tmp_path)


# --- Hugging Face's config.json ---------------------------------------------------------------------

GONE = object()  # a field removed from config.json


def _hf_error(tmp_path: Path, **changes) -> str:
    from hybridpar.checkpoint.hf_read import HFImportError, read_hf_config

    with pytest.raises(HFImportError) as info:
        read_hf_config(_write_hf(tmp_path, **changes))
    assert raised_by_every_rank(info.value), "every rank reads the same file: the CLI prints the error once"
    assert str(tmp_path / "config.json") in str(info.value), str(info.value)
    return str(info.value)


def _write_hf(folder: Path, **changes) -> Path:
    from hybridpar.checkpoint.hf import hf_config

    config = {**hf_config(ModelArgs.from_preset("debug_gqa")), **changes}  # as hybridpar's export writes it
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not GONE}))
    return folder


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"])
def test_config_json_without_a_shape_field_is_refused(tmp_path, field):
    message = _hf_error(tmp_path, **{field: GONE})
    assert f'"{field}" is missing' in message, message


@pytest.mark.parametrize("change,expected", [
    ({"hidden_size": "64"}, '"hidden_size" must be an integer, got the string "64"'),
    ({"num_hidden_layers": True}, '"num_hidden_layers" must be an integer, got true'),
    ({"num_key_value_heads": 2.0}, '"num_key_value_heads" must be an integer, got the number 2.0'),
    ({"head_dim": "8"}, '"head_dim" must be an integer, got the string "8"'),
    ({"rms_norm_eps": "1e-5"}, '"rms_norm_eps" must be a number, got the string "1e-5"'),
    ({"tie_word_embeddings": "false"}, '"tie_word_embeddings" must be true or false, got the string "false"'),
    ({"attention_bias": "false"}, '"attention_bias" must be true or false, got the string "false"'),
    ({"rope_scaling": [8.0]}, '"rope_scaling" must be an object, got a list [8.0]'),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4,
                       "original_max_position_embeddings": 8192}}, 'rope_scaling: "factor" must be a number'),
    ({"num_hidden_layers": 0}, "n_layers = 0 must be positive (num_hidden_layers in config.json)"),
])
def test_config_json_field_of_the_wrong_type_or_range_is_named(tmp_path, change, expected):
    message = _hf_error(tmp_path, **change)
    assert expected in message, message


def test_config_json_null_where_transformers_allows_it(tmp_path):
    from hybridpar.checkpoint.hf_read import read_hf_config

    nulls = dict(num_key_value_heads=None, head_dim=None, rope_scaling=None, tie_word_embeddings=None,
                 attention_bias=None, rope_theta=500000)  # and an integer where a number is expected
    args = read_hf_config(_write_hf(tmp_path, **nulls))
    assert (args.kv_heads, args.rope_scaling, args.tie_embeddings, args.rope_theta) == (8, None, False, 500000.0)


# --- every way in reads through these checks, before any model is built -----------------------------


@pytest.fixture
def no_model(monkeypatch):
    from hybridpar.models.llama import Transformer

    def refuse(*args, **kwargs):
        raise AssertionError("a Transformer was built from a model file that should have been refused")

    monkeypatch.setattr(Transformer, "__init__", refuse)


def test_checkpoints_of_every_format_are_refused_before_a_model_is_built(tmp_path, no_model):
    """load_model: what `hybridpar convert` and `hybridpar generate --checkpoint` read (and
    checkpoint.init_from, through the same read_args)."""
    from hybridpar.checkpoint.convert import load_model

    meta = _write(tmp_path / "meta", {**SMALL, "dim": "256"})
    (meta / "consolidated.00.pth").write_bytes(b"")  # never opened: params.json is read first
    (tmp_path / "hf").mkdir()
    hf = _write_hf(tmp_path / "hf", hidden_size="64")
    (hf / "model.safetensors").write_bytes(b"")
    dcp = _write(tmp_path / "dcp", {**vars(ModelArgs.from_preset("debug")), "n_layers": None})
    (dcp / ".metadata").write_bytes(b"")
    for folder, expected in [(meta, '"dim" must be an integer, got the string "256"'),
                             (hf, '"hidden_size" must be an integer, got the string "64"'),
                             (dcp, '"n_layers" must be an integer, got null')]:
        with pytest.raises(ValueError) as info:
            load_model(folder, parallel=None)
        assert expected in str(info.value) and raised_by_every_rank(info.value), str(info.value)


@pytest.mark.parametrize("name,content,expected", [
    ("params.json", {**SMALL, "dim": "256"}, '"dim" must be an integer, got the string "256"'),
    ("config.json", {"model_type": "llama", "hidden_size": 64}, '"num_attention_heads" is missing'),
])
def test_plan_refuses_a_bad_model_file_in_one_line(tmp_path, capsys, no_model, name, content, expected):
    from hybridpar.cli import main

    path = tmp_path / name
    path.write_text(json.dumps(content))
    assert main(["plan", "--model", str(path), "--gpus", "8", "--gpu-mem-gb", "80"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridpar: error: {path}: {expected}"), err
