"""Hugging Face export: the RoPE permutation, the folder's files, names and tensors, and (when
transformers is installed) LlamaForCausalLM's logits against hybridpar's."""

import json

import pytest
import torch

from hybridpar.checkpoint.hf import HFExportError, export_hf, hf_state_dict, rope_permutation
from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer, apply_rope, rope_frequencies
from tests.distributed import parallel_dims, rel_err

BOUND = 1e-4


def _args(name: str) -> ModelArgs:
    if name == "llama31_rope":
        # head_dim 32 gives RoPE bands on both sides of Llama 3.1's rescaling thresholds.
        return ModelArgs.from_preset("debug_gqa", dim=128, n_heads=4, n_kv_heads=2)
    return ModelArgs.from_preset(name)


# --- the permutation (no processes) ----------------------------------------------------------------


def _rope_rotate_half(y: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """HF's convention: (y[i], y[i + d/2]) rotated by angle i; angles [seq, d/2]."""
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :]
    half = y.shape[-1] // 2
    rotated = torch.cat([-y[..., half:], y[..., :half]], dim=-1)
    return y * cos + rotated * sin


@pytest.mark.parametrize("head_dim,theta,scaled", [(8, 10000.0, False), (32, 500000.0, True)])
def test_permutation_maps_meta_rope_to_rotate_half(head_dim, theta, scaled):
    heads, seq = 3, 40
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(5, 5 + seq)
    freqs_cis = rope_frequencies(head_dim, positions, theta, scaled)
    angles = freqs_cis.angle()  # the same angles, as HF computes cos/sin from them
    perm = rope_permutation(heads, head_dim).view(heads, head_dim) - torch.arange(heads)[:, None] * head_dim
    assert all(torch.equal(p, perm[0]) for p in perm)  # the same order in every head
    perm = perm[0]
    x = torch.randn(2, seq, heads, head_dim, generator=g)
    meta = apply_rope(x, freqs_cis)
    hf = _rope_rotate_half(x[..., perm], angles)
    torch.testing.assert_close(hf, meta[..., perm], rtol=0, atol=1e-6)
    # Without the permutation the two conventions disagree: the check has teeth.
    assert (_rope_rotate_half(x, angles) - meta).abs().max() > 0.1

    # On weights: q = W x; permuting W's rows gives HF's q, and attention scores are unchanged.
    dim = 16
    wq = torch.randn(heads * head_dim, dim, generator=g)
    wk = torch.randn(heads * head_dim, dim, generator=g)
    h = torch.randn(2, seq, dim, generator=g)
    full_perm = rope_permutation(heads, head_dim)
    q_meta = apply_rope((h @ wq.T).view(2, seq, heads, head_dim), freqs_cis)
    k_meta = apply_rope((h @ wk.T).view(2, seq, heads, head_dim), freqs_cis)
    q_hf = _rope_rotate_half((h @ wq[full_perm].T).view(2, seq, heads, head_dim), angles)
    k_hf = _rope_rotate_half((h @ wk[full_perm].T).view(2, seq, heads, head_dim), angles)
    scores_meta = torch.einsum("bqhd,bkhd->bhqk", q_meta, k_meta)
    scores_hf = torch.einsum("bqhd,bkhd->bhqk", q_hf, k_hf)
    assert rel_err(scores_hf, scores_meta) < 1e-6


def test_permutation_order_and_names():
    assert rope_permutation(2, 6).tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]
    args = _args("debug_gqa")
    state = {"layers.1.attention.wk.weight": torch.arange(16.0)[:, None], "output.weight": torch.ones(2, 2)}
    out = hf_state_dict(state, args)
    assert list(out) == ["model.layers.1.self_attn.k_proj.weight", "lm_head.weight"]
    assert out["model.layers.1.self_attn.k_proj.weight"].flatten().tolist() == rope_permutation(2, 8).tolist()
    with pytest.raises(HFExportError, match="rope.freqs is not a parameter"):
        hf_state_dict({"rope.freqs": torch.ones(4)}, args)


# --- export from a model-parallel job ------------------------------------------------------------


def _tokens(args: ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(1))


def _case_export(name: str, mp: int, out_dir: str, dtype_name: str = "float32", overwrite: bool = False,
                 fsdp: bool = False, max_shard_size="5GB"):
    """Export a seeded model at this mp; rank 0 returns its full state dict and full logits."""
    import torch.distributed as dist

    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.parallel.state import full_state_dict

    args = _args(name)
    parallel = parallel_dims(mp=mp)
    torch.manual_seed(0)  # the same weights at every mp (drawn as full tensors)
    model = Transformer(args, parallel)
    state = full_state_dict(model)  # before any FSDP wrapping: what the export must reproduce
    if fsdp:  # parameters sharded over dp too: the gather must see through both
        apply_fsdp(model, parallel, FSDPConfig(sharding_strategy="full_shard", param_dtype="float32"))
    try:
        export_hf(model, out_dir, parallel, dtype=getattr(torch, dtype_name), overwrite=overwrite,
                  max_shard_size=max_shard_size)
    except HFExportError as err:
        return "error", str(err)
    with torch.no_grad():
        logits = model(_tokens(args), gather_logits=True)
    return ("ok", (state, logits)) if dist.get_rank() == 0 else ("ok", None)


def _expected_names(args: ModelArgs) -> dict:
    kv = args.kv_heads * args.head_dim
    names = {
        "model.embed_tokens.weight": (args.vocab_size, args.dim),
        "model.norm.weight": (args.dim,),
        "lm_head.weight": (args.vocab_size, args.dim),
    }
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        names.update({
            p + "self_attn.q_proj.weight": (args.dim, args.dim),
            p + "self_attn.k_proj.weight": (kv, args.dim),
            p + "self_attn.v_proj.weight": (kv, args.dim),
            p + "self_attn.o_proj.weight": (args.dim, args.dim),
            p + "mlp.gate_proj.weight": (args.ffn_hidden_dim, args.dim),
            p + "mlp.up_proj.weight": (args.ffn_hidden_dim, args.dim),
            p + "mlp.down_proj.weight": (args.dim, args.ffn_hidden_dim),
            p + "input_layernorm.weight": (args.dim,),
            p + "post_attention_layernorm.weight": (args.dim,),
        })
    return names


@pytest.mark.parametrize(
    "name,mp,fsdp", [("debug_gqa", 2, False), ("debug_gqa", 4, False), ("debug_llama2", 2, False), ("debug_gqa", 2, True)]
)
def test_export_writes_hf_names_shapes_and_full_tensors(workers, tmp_path, name, mp, fsdp):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    results = workers(4).run(_case_export, name, mp, str(out), fsdp=fsdp)
    assert [status for status, _ in results] == ["ok"] * 4
    state, _ = results[0][1]
    args = _args(name)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left behind
    # The whole model fits in one 5GB shard: one model.safetensors and no index, as transformers writes it.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        args.dim, args.ffn_hidden_dim, args.n_layers)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (args.n_heads, args.kv_heads)
    assert (config["rope_theta"], config["rms_norm_eps"], config["vocab_size"]) == (
        args.rope_theta, args.norm_eps, args.vocab_size)
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == config["dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"], config["hidden_act"]) == (1, 2, "silu")
    assert (config["rope_scaling"] is not None) == args.use_scaled_rope
    if args.use_scaled_rope:
        assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == _expected_names(args)
    assert all(v.dtype == torch.float32 for v in tensors.values())
    q_perm = rope_permutation(args.n_heads, args.head_dim)
    k_perm = rope_permutation(args.kv_heads, args.head_dim)
    expected = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "lm_head.weight": state["output.weight"],
        "model.norm.weight": state["norm.weight"],
        "model.layers.1.self_attn.q_proj.weight": state["layers.1.attention.wq.weight"][q_perm],
        "model.layers.1.self_attn.k_proj.weight": state["layers.1.attention.wk.weight"][k_perm],
        "model.layers.1.self_attn.v_proj.weight": state["layers.1.attention.wv.weight"],
        "model.layers.1.self_attn.o_proj.weight": state["layers.1.attention.wo.weight"],
        "model.layers.0.mlp.gate_proj.weight": state["layers.0.feed_forward.w1.weight"],
        "model.layers.0.mlp.up_proj.weight": state["layers.0.feed_forward.w3.weight"],
        "model.layers.0.mlp.down_proj.weight": state["layers.0.feed_forward.w2.weight"],
        "model.layers.0.input_layernorm.weight": state["layers.0.attention_norm.weight"],
        "model.layers.0.post_attention_layernorm.weight": state["layers.0.ffn_norm.weight"],
    }
    for key, value in expected.items():
        assert torch.equal(tensors[key], value), key
    assert all(torch.equal(tensors[k], v) for k, v in hf_state_dict(state, args).items())


def test_export_refuses_an_existing_folder_and_overwrites_when_asked(workers, tmp_path):
    from safetensors.torch import load_file

    pool, out = workers(4), tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    results = pool.run(_case_export, "debug", 2, str(out))
    assert [status for status, _ in results] == ["error"] * 4  # every rank raises; none waits
    assert "already exists: choose a new folder, or replace it with --overwrite (overwrite=True from Python)" in results[1][1]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    results = pool.run(_case_export, "debug", 2, str(out), "bfloat16", True)
    assert [status for status, _ in results] == ["ok"] * 4
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    state, _ = results[0][1]
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], state["output.weight"].bfloat16())


# --- transformers loads the folder and computes the same logits -----------------------------------


@pytest.mark.parametrize(
    "name,mp",
    [("debug", 2), ("debug_llama2", 2), ("debug_gqa", 2), ("debug_gqa", 4), ("llama31_rope", 2)],
)
def test_transformers_logits_match(workers, check_close, tmp_path, name, mp):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    (status, (_, logits)), *_ = workers(4).run(_case_export, name, mp, str(out))
    assert status == "ok"
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.dtype == torch.float32
    # RoPE frequencies directly: Llama 3.1's rescaling barely moves logits over 64 positions.
    args = _args(name)
    ours = rope_frequencies(args.head_dim, torch.ones(1), args.rope_theta, args.use_scaled_rope).angle()[0]
    check_close(f"{name} inv_freq", {"inv_freq": rel_err(model.model.rotary_emb.inv_freq, ours)}, 1e-6)
    model.eval()
    with torch.no_grad():
        hf_logits = model(_tokens(_args(name))).logits
    check_close(f"{name} mp{mp} transformers", {"logits": rel_err(hf_logits, logits)}, BOUND)


def _case_export_failing_check(out_dir: str):
    """Rank 0's look at the target raises an OSError (as an unreadable parent folder would)."""
    from unittest import mock

    from hybridpar.checkpoint import hf

    def denied(path, overwrite):
        raise PermissionError(13, "Permission denied", str(path))

    parallel = parallel_dims(mp=2)
    model = Transformer(_args("debug"), parallel)
    with mock.patch.object(hf, "_check_target", denied):
        try:
            export_hf(model, out_dir, parallel)
        except HFExportError as err:
            return str(err)
    return None


def test_any_error_of_rank0s_check_reaches_every_rank(workers, tmp_path):
    results = workers(4).run(_case_export_failing_check, str(tmp_path / "hf"), timeout=60)
    assert all(r == results[0] for r in results), results  # every rank raises; none waits in the broadcast
    assert "PermissionError: [Errno 13] Permission denied" in results[0], results[0]
    assert list(tmp_path.iterdir()) == []


# --- one process: what write_hf_folder copies and writes -------------------------------------------


def _debug_state(args: ModelArgs) -> dict:
    """Every parameter of `args`' model, full and seeded, under Meta's names (one process)."""
    from hybridpar.checkpoint.foreign import model_shapes

    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in model_shapes(args).items()}


def test_write_copies_only_views(tmp_path, monkeypatch):
    """Tensors that own their storage go to safetensors as they are (a rank holds its shard once);
    views into a larger tensor, which safetensors refuses, are copied."""
    import safetensors.torch
    from safetensors.torch import load_file

    from hybridpar.checkpoint.hf import write_hf_folder

    saved, real_save = {}, safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda tensors, *a, **k: (saved.update(tensors), real_save(tensors, *a, **k))[1])
    args = _args("debug")
    state = _debug_state(args)
    norm, rows = state["norm.weight"], torch.randn(2, args.dim, generator=torch.Generator().manual_seed(1))
    state.update({"layers.0.attention_norm.weight": rows[0], "layers.0.ffn_norm.weight": rows[1]})
    write_hf_folder(state, args, tmp_path / "hf", dtype=torch.float32)
    assert saved["model.norm.weight"].data_ptr() == norm.data_ptr()
    views = ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight")
    assert all(saved[name].untyped_storage().nbytes() == args.dim * 4 for name in views)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(tensors["model.norm.weight"], norm)
    assert torch.equal(tensors[views[0]], rows[0]) and torch.equal(tensors[views[1]], rows[1])


@pytest.mark.parametrize("vocab,given,expected", [
    (128256, {}, (128000, 128001)),  # Llama 3's vocabulary: its tokenizer's ids
    (32000, {}, (1, 2)),  # anything else: Llama 2's
    (128256, {"bos_token_id": 7, "eos_token_id": 8}, (7, 8)),
])
def test_token_ids_follow_the_vocabulary_unless_given(tmp_path, vocab, given, expected):
    from hybridpar.checkpoint.hf import write_hf_folder

    args = ModelArgs.from_preset("debug", vocab_size=vocab)
    out = write_hf_folder(_debug_state(args), args, tmp_path / "hf", **given)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == expected
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == expected


class _FullModel(torch.nn.Module):
    """What export_hf reads of a model, in one process without a process group: `.args` and a state
    dict of full tensors under Meta's names."""

    def __init__(self, args: ModelArgs, state: dict) -> None:
        super().__init__()
        self.args, self._state = args, state

    def state_dict(self, *a, **k):
        return dict(self._state)


def test_the_library_exports_bfloat16_unless_told(tmp_path):
    """docs/api.md: export_hf and write_hf_folder default to bfloat16 (the CLI's default is tested
    apart). The files and config.json say so; a float32 state is cast."""
    from safetensors import safe_open

    from hybridpar.checkpoint.hf import write_hf_folder

    args = _args("debug")
    state = _debug_state(args)
    assert all(t.dtype == torch.float32 for t in state.values())
    for folder in (export_hf(_FullModel(args, state), tmp_path / "export"),
                   write_hf_folder(state, args, tmp_path / "write")):
        files = sorted(folder.glob("*.safetensors"))
        assert files, list(folder.iterdir())
        dtypes = set()
        for path in files:
            with safe_open(str(path), "pt") as f:
                dtypes |= {f.get_slice(name).get_dtype() for name in f.keys()}
        assert dtypes == {"BF16"}, (folder.name, dtypes)
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
