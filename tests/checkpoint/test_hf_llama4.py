"""Hugging Face Llama 4 folders made by transformers' own save_pretrained (Llama4ForCausalLM, and the
text model of a Llama4ForConditionalGeneration): hybridpar's logits from them equal transformers' at
world 1, mp 2, ep 2 and ep 2 x mp 2, the grouped GEMM and the loop alike; HF -> hybridpar -> HF gives
back the same bytes, at mp 1 and 2 and through a checkpoint saved at ep 2 x mp 2, and transformers loads
the export; published configs read as the presets."""

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import parallel_dims, rel_err

transformers = pytest.importorskip("transformers")

from tests.checkpoint.hf_folders import (folder_tensors, make_llama4_folder,  # noqa: E402
                                         transformers_llama4_logits)

BOUND = 1e-5
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))  # 3 chunks of 8 positions


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """multimodal -> a Llama 4 folder in several shards, made once per module."""
    root, made = tmp_path_factory.mktemp("hf_llama4"), {}

    def get(multimodal: bool = False) -> Path:
        if multimodal not in made:  # the multimodal one with token ids of its own, in its text_config, eos a list
            ids = dict(bos_token_id=5, eos_token_id=[2, 7]) if multimodal else {}
            made[multimodal] = make_llama4_folder(root / ("multimodal" if multimodal else "text"), multimodal=multimodal,
                                                  **ids)
        return made[multimodal]

    return get


def _case_logits(folder: str, mp: int, ep: int = 1) -> dict:
    """The full logits from the folder at this mp and ep, with the grouped GEMM and with the loop over experts."""
    from hybridpar.checkpoint.convert import load_model

    model, args = load_model(Path(folder), parallel_dims(mp=mp, ep=ep))
    experts = [m for m in model.modules() if type(m).__name__ == "GroupedExperts"]
    logits = {}
    for grouped in (True, False):
        for e in experts:
            e.grouped = grouped
        with torch.no_grad():
            logits[grouped] = model(TOKENS, gather_logits=True)
    return {"logits": logits[True], "loop_equal": torch.equal(logits[True], logits[False]), "experts": len(experts),
            "held": experts[0].w1.to_local().shape[0],
            "moe_layers": [i for i in range(args.n_layers) if args.is_moe_layer(i)], "nope": args.nope_layers}


@pytest.mark.parametrize("multimodal,world,mp,ep", [(False, 1, 1, 1), (False, 2, 2, 1), (True, 2, 2, 1),
                                                     (False, 2, 1, 2), (False, 4, 2, 2)],
                         ids=["world1", "mp2", "multimodal-mp2", "ep2", "ep2-mp2"])
def test_logits_equal_transformers(workers, check_close, folders, multimodal, world, mp, ep):
    """ep: each ep rank holds 2 of the 4 experts; the tokens choosing the others go there and back."""
    folder = folders(multimodal)
    assert len(list(folder.glob("model-*.safetensors"))) > 3 and (folder / "model.safetensors.index.json").exists()
    results = workers(world).run(_case_logits, str(folder), mp, ep)
    assert [(r["experts"], r["moe_layers"], r["nope"]) for r in results] == [(2, [1, 3], [3])] * world
    assert all(r["loop_equal"] for r in results)  # grouped GEMM and loop: the same logits, bit for bit
    assert [r["held"] for r in results] == [4 // ep] * world  # the experts this rank holds
    expected = transformers_llama4_logits(folder, TOKENS)
    errors = [{"logits": rel_err(r["logits"], expected)} for r in results]
    check_close(f"Llama 4{' multimodal' if multimodal else ''} mp{mp} ep{ep} vs transformers", errors, BOUND)


def _case_round_trip(src: str, root: str, via: str, mp: int, ep: int = 1) -> str:
    from hybridpar.checkpoint.convert import convert

    parallel = parallel_dims(mp=mp, ep=ep)
    back = Path(root) / "back"
    middle = Path(src) if via == "hf" else convert(Path(src), Path(root) / via, via, parallel)
    # float32 (the source's dtype: the round trip must be exact) in several shards, as the source.
    convert(middle, back, "hf", parallel, dtype=torch.float32, max_shard_size="64KB")
    return str(back)


@pytest.mark.parametrize("via,world,mp,ep,multimodal", [("dcp", 2, 2, 1, False), ("hf", 1, 1, 1, False),
                                                        ("hf", 2, 2, 1, True), ("dcp", 4, 2, 2, False)],
                         ids=["dcp-mp2", "direct-world1", "multimodal-direct-mp2", "dcp-ep2-mp2"])
def test_round_trip_gives_back_identical_tensors(workers, folders, tmp_path, via, world, mp, ep, multimodal):
    """A multimodal folder comes back as its text model: the same tensors, without language_model., and
    (converted directly: a dcp checkpoint records none) its text model's token ids. At ep 2 each rank
    reads and saves its half of the experts; the checkpoint holds them whole."""
    src = folders(multimodal)
    back = Path(workers(world).run(_case_round_trip, str(src), str(tmp_path), via, mp, ep)[0])
    prefix = "language_model." if multimodal else ""
    original = {k[len(prefix):]: v for k, v in folder_tensors(src).items() if k.startswith(prefix)}
    again = folder_tensors(back)
    assert len(list(back.glob("model-*.safetensors"))) > 3
    assert sorted(again) == sorted(original) and "model.layers.1.feed_forward.experts.gate_up_proj" in again
    for name, tensor in original.items():
        assert tensor.dtype == again[name].dtype and torch.equal(again[name], tensor), name
    config, config_back = (json.loads((p / "config.json").read_text()) for p in (src, back))
    config = config["text_config"] if multimodal else config
    for key in ("intermediate_size", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok",
                "moe_layers", "no_rope_layers", "layer_types", "use_qk_norm", "attention_chunk_size",
                "attn_temperature_tuning", "floor_scale", "attn_scale", "rms_norm_eps", "bos_token_id", "eos_token_id"):
        assert config_back[key] == config[key], key
    assert (config_back["architectures"], config_back["model_type"]) == (["Llama4ForCausalLM"], "llama4_text")
    # transformers builds the same model from the export: the same logits, bit for bit.
    assert torch.equal(transformers_llama4_logits(back, TOKENS), transformers_llama4_logits(src, TOKENS))


# Published text configs (meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E config.json's
# text_config), with the fields hybridpar reads; Scout's attn_temperature_tuning is a number there.
SCOUT = {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
         "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
         "vocab_size": 202048, "max_position_embeddings": 10485760, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
         "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
         "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
         "attention_chunk_size": 8192, "attn_temperature_tuning": 4, "floor_scale": 8192, "attn_scale": 0.1,
         "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False}
MAVERICK = {**SCOUT, "max_position_embeddings": 1048576, "rope_scaling": None, "num_local_experts": 128,
            "interleave_moe_layer_step": 2, "use_qk_norm": False}
del MAVERICK["attn_temperature_tuning"], MAVERICK["floor_scale"], MAVERICK["attn_scale"]  # transformers' defaults


@pytest.mark.parametrize("preset,config", [("llama4_scout", SCOUT), ("llama4_maverick", MAVERICK)])
def test_published_configs_read_as_the_presets_and_transformers_counts_their_parameters(preset, config):
    from hybridpar.checkpoint.hf import hf_config
    from hybridpar.checkpoint.hf_read import args_from_hf_config
    from hybridpar.models.args import ModelArgs

    args = ModelArgs.from_preset(preset)
    assert args_from_hf_config(config) == args
    wrapped = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": config}
    assert args_from_hf_config(wrapped) == args  # a multimodal folder's config.json: its text model
    # Our config.json for the preset builds, in transformers, a model of exactly our parameter count.
    exported = {k: v for k, v in hf_config(args).items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**exported))
    assert sum(p.numel() for p in model.parameters()) == args.num_params()


def test_a_config_whose_layer_types_disagree_with_its_rope_layers_is_refused_in_one_line(tmp_path):
    from hybridpar.checkpoint.hf_read import HFImportError, args_from_hf_config

    config = {**SCOUT, "num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0],
              "layer_types": ["chunked_attention"] * 3 + ["chunked_attention"]}
    with pytest.raises(HFImportError) as err:
        args_from_hf_config(config, tmp_path / "config.json")
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: \"layer_types\" = {config['layer_types']}, but hybridpar chunks the attention "
        "of exactly the RoPE layers (no_rope_layers' ones) when attention_chunk_size is set: ['chunked_attention', "
        "'chunked_attention', 'chunked_attention', 'full_attention']")


def _case_meta_refused(folder: str, out: str) -> str:
    from hybridpar.checkpoint.convert import load_model
    from hybridpar.checkpoint.meta import MetaCheckpointError, save_meta_checkpoint

    parallel = parallel_dims(mp=1)
    model, _ = load_model(Path(folder), parallel)
    with pytest.raises(MetaCheckpointError) as err:
        save_meta_checkpoint(model, out, parallel)
    return str(err.value)


def test_meta_format_is_refused_for_llama4_in_one_line(workers, folders, tmp_path):
    said = workers(1).run(_case_meta_refused, str(folders()), str(tmp_path / "meta"))[0]
    assert said == ("Meta's format is written for Llama 2 and 3; a Llama 4 model (experts, RoPE-less or chunked "
                    "attention) converts to hf or dcp (hybridpar convert --to hf)")
    assert not (tmp_path / "meta").exists()


def _case_train(config):
    import torch.distributed as dist

    from hybridpar.train import Trainer

    history = Trainer(config).run()
    return [m["loss"] for m in history] if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_training_from_llama4_at_mp2_dp2_gives_the_losses_of_mp1(workers, check_close, corpus, tmp_path):
    """checkpoint.init_from a Llama 4 folder: FSDP over the stacked experts, sequence parallelism (on by
    default) through the router and the experts, the trainer's loss at mp 2 x dp 2 as at mp 1 x dp 4."""
    from tests.runs import make_config

    folder = make_llama4_folder(tmp_path / "hf", vocab_size=512)  # the corpus tokenizer has 512 ids
    losses = {}
    for mp, dp in ((1, 4), (2, 2)):
        config = make_config(corpus, tmp_path / f"run{mp}", mp=mp, dp=dp, steps=5,
                             **{"checkpoint.init_from": str(folder)})
        losses[mp] = workers(4).run(_case_train, config)[0]
    print(f"\nLlama 4 from HF, mp1 x dp4: {[round(x, 6) for x in losses[1]]}\n"
          f"                 mp2 x dp2: {[round(x, 6) for x in losses[2]]}")
    assert len(losses[1]) == 5 and losses[1][-1] < losses[1][0]
    errors = {f"loss step {i + 1}": rel_err(torch.tensor(a), torch.tensor(b))
              for i, (a, b) in enumerate(zip(losses[2], losses[1]))}
    check_close("train Llama 4 from HF mp2xdp2 vs mp1", errors, 1e-5)
