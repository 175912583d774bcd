"""Hugging Face import: folders written by transformers' own save_pretrained (sharded, with an
index) load at mp 1, 2 and 4 and give transformers' logits; round trips through dcp and meta give
back the same tensors; training starts from them; each rank's extra memory stays one block."""

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import parallel_dims, rel_err

transformers = pytest.importorskip("transformers")

from tests.checkpoint.hf_folders import make_hf_folder, transformers_logits  # noqa: E402

BOUND = 1e-5
TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(shape, tied, dtype) -> an HF folder, made once per module."""
    root, made = tmp_path_factory.mktemp("hf_in"), {}

    def get(shape="gqa_llama3", tied=False, dtype="float32", single=False):
        key = (shape, tied, dtype, single)
        if key not in made:
            made[key] = make_hf_folder(root / "-".join(map(str, key)), shape, tied=tied, dtype=getattr(torch, dtype),
                                       shard_kb=10**6 if single else 64)
        return made[key]

    return get


def _case_logits(folder: str, mp: int):
    from hybridpar.checkpoint.convert import load_model

    model, args = load_model(Path(folder), parallel_dims(mp=mp))
    with torch.no_grad():
        logits = model(TOKENS[:, : min(TOKENS.shape[1], args.max_seq_len)] % args.vocab_size, gather_logits=True)
    return logits, args.tie_embeddings, type(model.output).__name__


@pytest.mark.parametrize("shape,tied,dtype,mp,single", [
    ("gqa_llama3", False, "float32", 1, False), ("gqa_llama3", False, "float32", 2, False),
    ("gqa_llama3", False, "float32", 4, False), ("gqa_llama3", True, "float32", 1, False),
    ("gqa_llama3", True, "float32", 2, False), ("gqa_llama3", True, "float32", 4, False),
    ("gqa_llama3", False, "bfloat16", 2, False), ("gqa_llama3", True, "bfloat16", 4, False),
    ("plain", False, "float32", 2, False), ("plain", False, "float16", 4, True),
])
def test_logits_equal_transformers(workers, check_close, folders, shape, tied, dtype, mp, single):
    folder = folders(shape, tied, dtype, single)
    if single:  # one model.safetensors, no index
        assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    else:
        assert len(list(folder.glob("model-*.safetensors"))) > 3 and (folder / "model.safetensors.index.json").exists()
    results = workers(4).run(_case_logits, str(folder), mp)
    logits, is_tied, head = results[0]
    assert (is_tied, head) == (tied, "TiedOutput" if tied else "ColumnParallelLinear")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    expected = transformers_logits(folder, TOKENS % vocab)
    errors = {f"rank{r} logits": rel_err(value[0], expected) for r, value in enumerate(results)}
    check_close(f"{shape} tied={tied} {dtype} mp{mp}{' one file' if single else ''} vs transformers", errors, BOUND)


def test_llama3_rope_rescaling_matches_transformers(folders):
    """The rescaled frequencies themselves (factor 32, original context 64), not only through logits."""
    from hybridpar.checkpoint.hf_read import read_hf_config
    from hybridpar.models.llama import rope_frequencies

    folder = folders()
    args = read_hf_config(folder)
    assert args.rope_scaling.factor == 32.0 and args.rope_scaling.original_context == 64
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True)
    ours = rope_frequencies(args.head_dim, torch.ones(1), args.rope_theta, args.rope_scaling).angle()[0]
    plain = rope_frequencies(args.head_dim, torch.ones(1), args.rope_theta, None).angle()[0]
    theirs = model.model.rotary_emb.inv_freq
    print(f"\ninv_freq relative error {rel_err(ours, theirs):.2e}; unscaled would be {rel_err(plain, theirs):.2e}")
    assert rel_err(ours, theirs) < 1e-6 and rel_err(plain, theirs) > 0.1


# --- round trips ------------------------------------------------------------------------------


def _case_round_trip(src: str, root: str, via: str, load_mp: int):
    from hybridpar.checkpoint.convert import convert

    parallel = parallel_dims(mp=load_mp)
    middle, back = Path(root) / via, Path(root) / "back"
    convert(Path(src), middle, via, parallel, **({"mp_out": 2} if via == "meta" else {}))
    # float32 (the source's dtype: the round trip must be exact) in several shards, as the source.
    convert(middle, back, "hf", parallel, dtype=torch.float32, max_shard_size="64KB")
    return str(back)


@pytest.mark.parametrize("via,tied,load_mp", [("dcp", False, 2), ("dcp", True, 4), ("meta", False, 2),
                                              ("meta", True, 1)])
def test_round_trip_gives_back_identical_tensors(workers, folders, tmp_path, via, tied, load_mp):
    from safetensors import safe_open

    src = folders("gqa_llama3", tied)
    back = Path(workers(4).run(_case_round_trip, str(src), str(tmp_path), via, load_mp)[0])
    original, again = {}, {}
    for folder, tensors in ((src, original), (back, again)):
        for path in folder.glob("model-*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert len(list(back.glob("model-*.safetensors"))) > 3
    assert sorted(again) == sorted(original)
    assert ("lm_head.weight" in again) == (not tied)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name
    config, config_back = (json.loads((p / "config.json").read_text()) for p in (src, back))
    for key in ("hidden_size", "intermediate_size", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps"):
        assert config_back[key] == config[key], key
    assert config_back["rope_scaling"] == {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}


# --- training from an HF folder -----------------------------------------------------------------


def _case_train(config):
    import torch.distributed as dist

    from hybridpar.train import Trainer

    history = Trainer(config).run()
    return [m["loss"] for m in history] if dist.get_rank() == 0 else None


def test_training_from_hf_at_mp2_dp2_gives_the_losses_of_mp1(workers, check_close, corpus, tmp_path):
    from tests.runs import make_config

    folder = make_hf_folder(tmp_path / "hf", vocab_size=512, tied=True)  # the corpus tokenizer has 512 ids
    losses = {}
    for mp, dp in ((1, 4), (2, 2)):
        config = make_config(corpus, tmp_path / f"run{mp}", mp=mp, dp=dp, steps=5,
                             **{"checkpoint.init_from": str(folder)})
        losses[mp] = workers(4).run(_case_train, config)[0]
    print(f"\nfrom HF, mp1 x dp4: {[round(x, 6) for x in losses[1]]}\n         mp2 x dp2: {[round(x, 6) for x in losses[2]]}")
    assert len(losses[1]) == 5 and losses[1][-1] < losses[1][0]
    errors = {f"loss step {i + 1}": rel_err(torch.tensor(a), torch.tensor(b)) for i, (a, b) in enumerate(zip(losses[2], losses[1]))}
    check_close("train from HF mp2xdp2 vs mp1", errors, 1e-4)


# --- memory: one block at a time ----------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _case_import_memory(folder: str, mp: int) -> dict:
    """This rank's peak resident memory during the import above what it held before (the model
    allocated), against its shard, the largest block it copies and the largest tensor in the files."""
    import gc

    from hybridpar.checkpoint.hf_read import load_hf_checkpoint, read_hf_config
    from hybridpar.parallel.state import local_box
    from hybridpar.models.llama import Transformer

    parallel = parallel_dims(mp=mp)
    args = read_hf_config(folder)
    model = Transformer(args, parallel)
    own = model.state_dict()
    shard = sum(v.to_local().nbytes for v in own.values())
    largest_block = max(4 * torch.Size(local_box(v, k)[1]).numel() for k, v in own.items())
    largest_tensor = max(4 * v.numel() for v in own.values())
    gc.collect()
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    load_hf_checkpoint(folder, model, parallel)
    extra = (_status_kb("VmHWM") - before) * 1024
    return {"extra": extra, "shard": shard, "largest_block": largest_block, "largest_tensor": largest_tensor}


def test_each_rank_holds_one_block_at_a_time(workers, tmp_path):
    """Bound: the block being copied + the file pages of the one tensor it is read from (mapped
    while it is read; a column block touches all of them) + 4 MiB for the allocator. The model
    itself (66 MB in fp32) would not fit."""
    folder = make_hf_folder(tmp_path / "hf", "plain", hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                            num_key_value_heads=4, num_hidden_layers=4, vocab_size=4096, shard_kb=8192)
    full = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    results = workers(4).run(_case_import_memory, str(folder), 4)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    for rank, r in enumerate(results):
        bound = r["largest_block"] + r["largest_tensor"] + 4 * 2**20
        print(f"\nrank {rank}: extra {mib(r['extra'])} (shard {mib(r['shard'])}, largest block "
              f"{mib(r['largest_block'])}, largest tensor {mib(r['largest_tensor'])}, bound {mib(bound)}, "
              f"whole checkpoint {mib(full)})")
        assert r["extra"] <= bound, r
        assert r["extra"] < full / 3


# --- clear errors ---------------------------------------------------------------------------------


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "mistral"}, "model_type = 'mistral'; hybridpar imports Llama models only"),
    ({"attention_bias": True}, "attention_bias = true; hybridpar's Llama has no biases"),
    ({"mlp_bias": True}, "mlp_bias = true"),
    ({"head_dim": 16}, "head_dim = 16 but hidden_size / num_attention_heads = 128 / 4"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters.rope_type = 'yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type = 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"hidden_size": None}, '"hidden_size" is missing'),
    ({"intermediate_size": "big"}, '"intermediate_size" must be an integer, got the string "big"'),
])
def test_configs_hybridpar_cannot_hold_are_refused_naming_the_field(folders, tmp_path, changes, message):
    import shutil

    from hybridpar.checkpoint.hf_read import HFImportError, read_hf_config

    folder = Path(shutil.copytree(folders(), tmp_path / "hf"))
    _edit_config(folder, **changes)
    with pytest.raises(HFImportError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        read_hf_config(folder)


def test_transformers_4_spelling_reads_like_5(folders, tmp_path):
    import shutil

    from hybridpar.checkpoint.hf_read import read_hf_config

    folder = Path(shutil.copytree(folders(), tmp_path / "hf"))
    config = json.loads((folder / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    _edit_config(folder, rope_parameters=None, rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert read_hf_config(folder) == read_hf_config(folders())


def _case_load_error(folder: str, **model_fields):
    from hybridpar.checkpoint.hf_read import HFImportError, load_hf_checkpoint, read_hf_config
    from hybridpar.models.llama import Transformer

    parallel = parallel_dims(mp=2)
    args = read_hf_config(folder, **model_fields)
    model = Transformer(args, parallel)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    try:
        load_hf_checkpoint(folder, model, parallel)
    except HFImportError as err:
        untouched = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
        return str(err), untouched
    return None, None


def test_a_shard_the_index_lists_but_the_folder_lacks(workers, folders, tmp_path):
    import shutil

    folder = Path(shutil.copytree(folders(), tmp_path / "hf"))
    lost = sorted(folder.glob("model-*.safetensors"))[2]
    lost.unlink()
    message, _ = workers(4).run(_case_load_error, str(folder))[0]
    assert f"model.safetensors.index.json lists {lost.name}, which is not in the folder" in message
    assert "finish the download" in message


def test_a_file_cut_short_names_the_tensor_it_lost(folders, tmp_path):
    import shutil

    from hybridpar.checkpoint.hf_read import HFImportError, _refuse_cut_short

    folder = Path(shutil.copytree(folders(), tmp_path / "hf"))
    path = sorted(folder.glob("model-*.safetensors"))[1]
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:header_end])
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(HFImportError) as info:
        _refuse_cut_short(path)
    message = str(info.value)
    assert f"{path} is cut short: it has {path.stat().st_size} bytes, but its header places {last} up to byte" in message
    assert "download it again" in message


def test_a_tensor_of_the_wrong_shape(workers, folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(folders(), tmp_path / "hf"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.up_proj.weight"
    path = folder / index[name]
    tensors = load_file(str(path))
    tensors[name] = tensors[name][:100].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    message, untouched = workers(4).run(_case_load_error, str(folder))[0]
    assert f"{name} in {path.name} has shape [100, 128], but config.json implies [192, 128]" in message
    assert untouched  # checked before anything was copied


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_do_not_mix(workers, folders, tied):
    message, untouched = workers(4).run(_case_load_error, str(folders("gqa_llama3", tied)), tie_embeddings=not tied)[0]
    which = "tied (tie_word_embeddings: true)" if tied else "untied (its own lm_head.weight)"
    assert f"is {which} but the model is {'untied' if tied else 'tied'}" in message and untouched


def test_an_untied_folder_whose_config_says_tied(folders, tmp_path):
    """lm_head.weight present though config.json says tied: transformers would ignore it; so do we,
    but a folder missing lm_head while saying untied is named as such."""
    import shutil

    from hybridpar.checkpoint.hf_read import HFImportError, _Files, _check_tensors, _weight_map, read_hf_config

    folder = Path(shutil.copytree(folders("gqa_llama3", True), tmp_path / "hf"))
    _edit_config(folder, tie_word_embeddings=False)
    files = _Files(folder, _weight_map(folder))
    with pytest.raises(HFImportError, match="lm_head.weight missing: a tied checkpoint"):
        _check_tensors(files, read_hf_config(folder))
    files.close()


def test_tokenizer_ids_beyond_the_vocabulary_are_refused(folders, tmp_path):
    """generate from an HF folder with a tokenizer larger than the model's 256 ids: one clear error."""
    import subprocess
    import sys

    from tests.data.bpe_files import MIXED_TEXT, train_hf_bpe

    hf, _ = train_hf_bpe([MIXED_TEXT] * 4, 300)  # with Llama 3's 256 special tokens: well over 256 ids
    tokenizer = tmp_path / "tokenizer.json"
    hf.save(str(tokenizer))
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "hybridpar", "generate", "--checkpoint", str(folders()),
                          "--tokenizer", str(tokenizer), "--prompt", "hello", "--max-new-tokens", "2"],
                         cwd=root, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "vocab" in out.stderr and "256" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


# --- token ids and tokenizer files on the way out -----------------------------------------------


def _case_convert_hf(src: str, dst: str, tokenizer):
    from hybridpar.checkpoint.convert import convert

    return str(convert(Path(src), Path(dst), "hf", parallel_dims(mp=2), tokenizer=tokenizer))


def test_export_takes_token_ids_from_the_tokenizer_or_the_source(workers, tmp_path):
    from hybridpar.data.tokenizer import Tokenizer
    from tests.data.bpe_files import MIXED_TEXT, train_hf_bpe, write_tokenizer_config

    hf, n_words = train_hf_bpe([MIXED_TEXT] * 4, 300)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    hf.save(str(tok_dir / "tokenizer.json"))
    write_tokenizer_config(tok_dir, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    vocab = (hf.get_vocab_size() + 63) // 64 * 64
    src = make_hf_folder(tmp_path / "src", vocab_size=vocab, bos_token_id=7, eos_token_id=9)

    same = Path(workers(4).run(_case_convert_hf, str(src), str(tmp_path / "same"), None)[0])
    config = json.loads((same / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (7, 9)  # the source's own

    out = Path(workers(4).run(_case_convert_hf, str(src), str(tmp_path / "tok_out"), str(tok_dir))[0])
    config = json.loads((out / "config.json").read_text())
    tok = Tokenizer(tok_dir)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id) == (n_words, n_words + 9)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_plan_reads_the_shape_of_an_hf_folder_or_its_config(folders, capsys):
    from hybridpar.cli import main

    for model in (folders(), folders() / "config.json"):
        assert main(["plan", "--model", str(model), "--gpus", "8", "--gpu-mem-gb", "80"]) == 0
        assert "2 layers, dim 128, 4 heads / 2 kv heads, vocab 256" in capsys.readouterr().out
