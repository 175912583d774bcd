"""Meta's format and hybridpar's own fields: the feed-forward size stated through multiple_of and
ffn_dim_multiplier, hybridpar.json (RoPE factors, tied embeddings), and tied checkpoints written and
recognised as Meta's Llama 3.2 release has them (output.weight a copy of tok_embeddings.weight)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hybridpar.models.args import ModelArgs, preset_names
from hybridpar.models.llama import Transformer
from tests.distributed import parallel_dims, rel_err

BOUND = 1e-5
# Every key Meta's ModelArgs has but the two Meta's Llama.build passes as keywords.
META_KEYS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
             "norm_eps", "rope_theta", "use_scaled_rope"}
# Llama 3.2 shaped, at debug size: tied embeddings, RoPE factor 32, a feed-forward size of its own.
TIED = dict(tie_embeddings=True, rope_scaling_factor=32.0, ffn_hidden_size=100)


# --- the feed-forward size in params.json (one process) ----------------------------------------------

FFN_CHOICES = [  # dim, feed-forward size, the (multiple_of, ffn_dim_multiplier) params.json gets
    (4096, 14336, (1024, 1.3)),  # Llama 3 8B (Meta's params.json says the same)
    (8192, 28672, (1024, 1.3)),  # Llama 3 70B
    (16384, 53248, (1024, 1.2)),  # Llama 3.1 405B
    (2048, 8192, (1024, 1.5)),  # Llama 3.2 1B
    (3072, 8192, (256, None)),  # Llama 3.2 3B: two thirds of 4 * dim already
    (4096, 11008, (256, None)),  # Llama 2 7B
    (5120, 13824, (256, None)),  # Llama 2 13B
    (128, 192, (64, 0.5)),
    (64, 96, (32, 0.5)),
    (64, 100, (4, 0.59)),
]


@pytest.mark.parametrize("dim,size,expected", FFN_CHOICES, ids=[f"{d}-{s}" for d, s, _ in FFN_CHOICES])
def test_ffn_hidden_size_stated_with_metas_fields(dim, size, expected):
    """As a Hugging Face import gives it: intermediate_size, multiple_of and the multiplier the defaults."""
    from hybridpar.checkpoint.meta import meta_params_json
    from tests.checkpoint.meta_reference import ModelArgs as MetaModelArgs
    from tests.checkpoint.meta_reference import feed_forward_size

    args = ModelArgs(dim=dim, n_heads=8, n_kv_heads=8, vocab_size=128256, rope_theta=500000.0, ffn_hidden_size=size)
    params = json.loads(json.dumps(meta_params_json(args)))  # as written and read back
    assert set(params) <= META_KEYS, sorted(set(params) - META_KEYS)
    assert (params["multiple_of"], params.get("ffn_dim_multiplier")) == expected
    meta = MetaModelArgs(max_seq_len=64, max_batch_size=1, **params)  # as Meta's Llama.build builds it
    assert feed_forward_size(4 * meta.dim, meta.multiple_of, meta.ffn_dim_multiplier) == size


# Llama 4's presets are not written in Meta's format (refused: tests/checkpoint/test_hf_llama4.py).
@pytest.mark.parametrize("preset", [p for p in preset_names() if not ModelArgs.from_preset(p).llama4])
def test_presets_keep_their_own_ffn_fields(preset):
    from hybridpar.checkpoint.meta import meta_params_json

    args = ModelArgs.from_preset(preset)
    for stated in (args, ModelArgs.from_preset(preset, ffn_hidden_size=args.ffn_hidden_dim)):
        params = meta_params_json(stated)
        assert (params["multiple_of"], params.get("ffn_dim_multiplier")) == (args.multiple_of, args.ffn_dim_multiplier)


def test_ffn_size_metas_fields_cannot_state_is_refused():
    from hybridpar.checkpoint.meta import MetaCheckpointError, meta_params_json

    # Odd, so multiple_of 1; at this dim no multiplier of up to 6 decimals lands on it.
    args = ModelArgs(dim=2 ** 20, n_heads=8, ffn_hidden_size=3 * 2 ** 20 + 1)
    with pytest.raises(MetaCheckpointError) as info:
        meta_params_json(args)
    message = str(info.value)
    assert "ffn_hidden_size = 3145729 (dim = 1048576) cannot be stated in Meta's params.json" in message, message
    assert "export to hf or dcp instead" in message, message


def test_hybridpar_json_holds_only_what_params_json_cannot_state():
    from hybridpar.checkpoint.meta import hybridpar_json

    assert hybridpar_json(ModelArgs.from_preset("llama3.2_1b")) == {"rope_scaling_factor": 32.0, "tie_embeddings": True}
    assert hybridpar_json(ModelArgs.from_preset("llama3.1_8b")) == {}  # Meta's fixed factors
    # Without scaled RoPE the factors change nothing: nothing to state.
    assert hybridpar_json(ModelArgs.from_preset("debug", rope_scaling_factor=32.0)) == {}
    other = ModelArgs.from_preset("debug_gqa", rope_low_freq_factor=2.0, rope_original_context=4096)
    assert hybridpar_json(other) == {"rope_low_freq_factor": 2.0, "rope_original_context": 4096}


# --- tied checkpoints: written at any MP, read at any mp ----------------------------------------------


def _tokens(args: ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))


def _case_tied_round_trip(folder: str) -> dict:
    from hybridpar.checkpoint.meta import load_meta_checkpoint, read_meta_params, save_meta_checkpoint
    from hybridpar.parallel.state import full_state_dict

    args = ModelArgs.from_preset("debug_gqa", **TIED)
    source_parallel = parallel_dims(mp=2)
    torch.manual_seed(0)
    source = Transformer(args, source_parallel)
    expected, tokens = full_state_dict(source), _tokens(args)
    with torch.no_grad():
        expected_logits = source(tokens, gather_logits=True)
    weight_errors, logit_errors = {}, {}
    for mp_out in (2, 1):
        path = Path(folder) / f"MP{mp_out}"
        save_meta_checkpoint(source, path, source_parallel, mp_out)
        loaded = read_meta_params(path, max_seq_len=args.max_seq_len)
        assert loaded.tie_embeddings and loaded.rope_scaling == args.rope_scaling, loaded
        assert loaded.ffn_hidden_dim == args.ffn_hidden_dim == 100, loaded
        for mp in (1, 2, 4):
            parallel = parallel_dims(mp=mp)
            torch.manual_seed(1)  # other weights: the load must overwrite every one
            model = Transformer(loaded, parallel)
            load_meta_checkpoint(path, model, parallel)
            weights = full_state_dict(model)
            assert weights.keys() == expected.keys() and "output.weight" not in weights
            weight_errors.update({f"MP{mp_out}->mp{mp} {k}": rel_err(weights[k], v) for k, v in expected.items()})
            with torch.no_grad():
                logit_errors[f"MP{mp_out}->mp{mp}"] = rel_err(model(tokens, gather_logits=True), expected_logits)
    return weight_errors, logit_errors


def test_tied_model_round_trip(workers, check_close, tmp_path):
    results = workers(4).run(_case_tied_round_trip, str(tmp_path))
    check_close("tied mp2 -> MP2/MP1 -> mp1/2/4 weights", [w for w, _ in results], 0.0)
    # The same sums at the source's mp; other mp sizes add the partial products in another order.
    check_close("tied mp2 -> MP2/MP1 -> mp2 logits", [{k: v for k, v in lg.items() if k.endswith("mp2")}
                                                     for _, lg in results], 0.0)
    check_close("tied mp2 -> MP2/MP1 -> mp1/2/4 logits", [lg for _, lg in results], BOUND)
    for mp_out in (2, 1):
        folder = tmp_path / f"MP{mp_out}"
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["params.json", "hybridpar.json"] + [f"consolidated.{j:02d}.pth" for j in range(mp_out)])
        assert json.loads((folder / "hybridpar.json").read_text()) == {"rope_scaling_factor": 32.0,
                                                                       "tie_embeddings": True}
        assert set(json.loads((folder / "params.json").read_text())) <= META_KEYS
        for j in range(mp_out):
            shard = torch.load(folder / f"consolidated.{j:02d}.pth", weights_only=True, map_location="cpu")
            # As in Meta's Llama 3.2 files: the head's weight is there, equal and a copy of its own.
            output, embedding = shard["output.weight"], shard["tok_embeddings.weight"]
            assert output.shape == (128 // mp_out, 64) and torch.equal(output, embedding)
            assert output.untyped_storage().data_ptr() != embedding.untyped_storage().data_ptr()


def _case_export(folder: str) -> None:
    from hybridpar.checkpoint.meta import save_meta_checkpoint

    parallel = parallel_dims(mp=2)
    for name, overrides in (("tied", TIED), ("untied", {})):
        torch.manual_seed(0)
        model = Transformer(ModelArgs.from_preset("debug_gqa", **overrides), parallel)
        save_meta_checkpoint(model, Path(folder) / name, parallel, 2)


@pytest.fixture(scope="module")
def exported(workers, tmp_path_factory):
    """debug_gqa at MP 2, tied (TIED) and not."""
    root = tmp_path_factory.mktemp("meta_fields")
    workers(4).run(_case_export, str(root))
    return root


@pytest.fixture
def copy_of(exported, tmp_path):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(exported / name, tmp_path / name))

    return copy


def _read_error(folder: Path) -> str:
    from hybridpar.checkpoint.meta import MetaCheckpointError, read_meta_params

    with pytest.raises(MetaCheckpointError) as info:
        read_meta_params(folder)
    return str(info.value)


def _edit_output_row(folder: Path, row: int) -> None:
    """Change one row of output.weight (file 0 holds rows 0 .. 63)."""
    path = folder / "consolidated.00.pth"
    state = torch.load(path, weights_only=True, map_location="cpu")
    state["output.weight"][row] += 1.0
    torch.save(state, path)


def test_sidecar_round_trips_rope_factor_32(exported):
    from hybridpar.checkpoint.meta import read_meta_params

    args = read_meta_params(exported / "tied")
    assert (args.rope_scaling_factor, args.tie_embeddings, args.ffn_hidden_dim) == (32.0, True, 100)
    assert not read_meta_params(exported / "untied").tie_embeddings
    assert not (exported / "untied" / "hybridpar.json").exists()  # nothing Meta's fields cannot state


def test_tied_detected_without_sidecar(copy_of):
    from hybridpar.checkpoint.meta import read_meta_params

    folder = copy_of("tied")
    (folder / "hybridpar.json").unlink()  # as Meta's own download: params.json and the files only
    args = read_meta_params(folder)
    assert args.tie_embeddings and args.rope_scaling_factor == 8.0  # Meta's fixed factor, as its code uses
    # Rows the sample skips are not compared: row 1 (of 0, 2, 4, ... 127 in the sample).
    _edit_output_row(folder, 1)
    assert read_meta_params(folder).tie_embeddings
    _edit_output_row(folder, 2)
    assert not read_meta_params(folder).tie_embeddings


def test_sidecar_saying_tied_over_untied_files(copy_of):
    folder = copy_of("untied")
    (folder / "hybridpar.json").write_text('{"tie_embeddings": true}')
    message = _read_error(folder)
    assert "hybridpar.json says tie_embeddings = true, but output.weight differs" in message, message


@pytest.mark.parametrize("content,expected", [
    ({"tie_embeddings": True, "rope_factor": 32.0}, "unknown field(s) ['rope_factor']"),
    ({"tie_embeddings": "yes"}, '"tie_embeddings" must be true or false, got the string "yes"'),
    ({"rope_scaling_factor": "32"}, '"rope_scaling_factor" must be a number, got the string "32"'),
    ({"rope_original_context": 8192.5}, '"rope_original_context" must be an integer, got the number 8192.5'),
    ({"use_scaled_rope": True}, "unknown field(s) ['use_scaled_rope']"),  # params.json's
    ([32.0], "holds a list, not a JSON object"),
])
def test_sidecar_is_checked(copy_of, content, expected):
    folder = copy_of("tied")
    (folder / "hybridpar.json").write_text(json.dumps(content))
    message = _read_error(folder)
    assert f"{folder / 'hybridpar.json'}" in message and expected in message, message


def test_field_in_both_files_is_refused(copy_of):
    folder = copy_of("tied")
    params = json.loads((folder / "params.json").read_text())
    (folder / "params.json").write_text(json.dumps({**params, "tie_embeddings": True}))
    message = _read_error(folder)
    assert "and params.json both set ['tie_embeddings']: remove them from params.json" in message, message


def test_params_json_hybridpar_field_types_are_checked(copy_of):
    folder = copy_of("untied")
    params = json.loads((folder / "params.json").read_text())
    (folder / "params.json").write_text(json.dumps({**params, "ffn_hidden_size": "100"}))
    assert '"ffn_hidden_size" must be an integer or null, got the string "100"' in _read_error(folder)


# --- loading refuses what would compute something else --------------------------------------------------


def _case_load_errors(root: str) -> list[str]:
    from hybridpar.checkpoint.meta import MetaCheckpointError, load_meta_checkpoint

    parallel = parallel_dims(mp=2)
    cases = [("untied", ModelArgs.from_preset("debug_gqa", tie_embeddings=True)),
             ("tied", ModelArgs.from_preset("debug_gqa", **{**TIED, "tie_embeddings": False})),
             ("tied", ModelArgs.from_preset("debug_gqa", **{**TIED, "rope_scaling_factor": 8.0})),
             ("rows", ModelArgs.from_preset("debug_gqa", **{**TIED, "rope_scaling_factor": 8.0}))]
    messages = []
    for name, args in cases:
        # mp 1 for the last: every rank compares all rows (each compares its own block only).
        p = parallel_dims(mp=1) if name == "rows" else parallel
        try:
            load_meta_checkpoint(Path(root) / name, Transformer(args, p), p)
        except MetaCheckpointError as err:
            messages.append(str(err))
        else:
            messages.append("no error")
    return messages


def test_load_refuses_a_tie_or_rope_mismatch(workers, exported, tmp_path):
    for name in ("tied", "untied"):
        shutil.copytree(exported / name, tmp_path / name)
    rows = Path(shutil.copytree(exported / "tied", tmp_path / "rows"))
    (rows / "hybridpar.json").unlink()
    _edit_output_row(rows, 1)  # outside the sample: read_meta_params still says tied
    results = workers(4).run(_case_load_errors, str(tmp_path))
    assert all(r == results[0] for r in results), results
    untied, tied, rope, block = results[0]
    assert (f"the checkpoint in {tmp_path / 'untied'} has tie_embeddings = False (from the consolidated files "
            "(output.weight differs from tok_embeddings.weight)), the model tie_embeddings = True: build the model "
            "with tie_embeddings = False" in untied), untied
    assert (f"{tmp_path / 'tied'} has tie_embeddings = True (from hybridpar.json), the model tie_embeddings = "
            "False: build the model with tie_embeddings = True" in tied), tied
    assert "rope_scaling = RopeScaling(factor=32.0" in rope and "(model: RopeScaling(factor=8.0" in rope, rope
    assert "output.weight in" in block and "differs from tok_embeddings.weight in rows 0 to 127" in block, block
    assert 'Put {"tie_embeddings": false} in' in block, block
