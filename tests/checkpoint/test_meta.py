"""Meta's consolidated checkpoints: export at any MP, import at any mp, Meta-style code as the oracle.
The ways a folder can be broken: test_meta_errors; hybridpar's own fields and tied models: test_meta_fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer
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
    placements = str(model.layers["0"].attention.wq.weight.placements)
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
    from hybridpar.parallel.fairscale import use_mesh
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
