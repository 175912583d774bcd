"""Strict model files: Meta's params.json (read alone or in a checkpoint folder) and Hugging Face's
config.json refuse a missing shape field, a field of the wrong JSON type, an unknown field and a
value out of range, naming the field, before any model is built; Meta's published files load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridpar.ranks import raised_by_every_rank
from models.llama import ModelArgs
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
    # Without dim, Meta's default 4096 would build a 772.8M-parameter model instead of this one.
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
