"""Llama 4 through hybridpar's formats at ep 2 x mp 2 (world 4): training started from a transformers
Llama4ForCausalLM folder (checkpoint.init_from) has world 1's losses; its checkpoint, converted by
`hybridpar convert --to hf --mp 2 --ep 2` into several safetensors shards, is a folder transformers
loads to the logits hybridpar computes from the checkpoint; `--to meta` is refused in one line before
any weight loads (Meta's own Llama 4 layout is not written: docs/checkpoints.md says why)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import rel_err

pytest.importorskip("transformers")

from tests.checkpoint.hf_folders import make_llama4_folder, transformers_llama4_logits  # noqa: E402

BOUND = 1e-5
STEPS = 3
TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))  # 3 chunks of 8 positions


def _case_train(config) -> list | None:
    import torch.distributed as dist

    from hybridpar.train import Trainer

    history = Trainer(config).run()
    return [m["loss"] for m in history] if dist.get_rank() == 0 else None


def _case_export(checkpoints: str, out: str) -> dict:
    """`hybridpar convert --to hf` at mp 2 x ep 2 in this world of 4, and hybridpar's logits from the
    checkpoint at the same mesh."""
    from hybridpar.checkpoint.convert import load_model
    from hybridpar.cli import main
    from tests.distributed import parallel_dims

    code = main(["convert", checkpoints, out, "--to", "hf", "--mp", "2", "--ep", "2", "--dtype", "float32",
                 "--max-shard-size", "64KB"])
    model, _ = load_model(Path(checkpoints), parallel_dims(mp=2, ep=2))
    held = model.layers["1"].feed_forward.experts.w1.to_local().shape[0]
    with torch.no_grad():
        return {"code": code, "held": held, "logits": model(TOKENS, gather_logits=True)}


@pytest.mark.slow
def test_trained_at_ep2_mp2_from_a_transformers_folder_and_converted_back(workers, check_close, corpus, tmp_path):
    from tests.runs import make_config

    folder = make_llama4_folder(tmp_path / "hf", vocab_size=512)  # the corpus tokenizer has 512 ids
    losses, runs = {}, {}
    for name, world, mp, ep in (("world1", 1, 1, 1), ("ep2-mp2", 4, 2, 2)):
        runs[name] = tmp_path / name
        config = make_config(corpus, runs[name], mp=mp, dp=world // mp, steps=STEPS,
                             **{"checkpoint.init_from": str(folder), "parallel.ep": ep, "checkpoint.at_end": True,
                                "checkpoint.folder": str(runs[name] / "checkpoints")})
        losses[name] = workers(world).run(_case_train, config)[0]
    print(f"\nLlama 4 from HF, world 1: {[round(x, 6) for x in losses['world1']]}\n"
          f"              ep2 x mp2: {[round(x, 6) for x in losses['ep2-mp2']]}")
    assert len(losses["world1"]) == STEPS
    errors = {f"loss step {i + 1}": rel_err(torch.tensor(a), torch.tensor(b))
              for i, (a, b) in enumerate(zip(losses["ep2-mp2"], losses["world1"]))}
    check_close("train Llama 4 from HF at ep2 x mp2 vs world 1", errors, BOUND)

    out = tmp_path / "export"
    results = workers(4).run(_case_export, str(runs["ep2-mp2"] / "checkpoints"), str(out))
    assert [(r["code"], r["held"]) for r in results] == [(0, 2)] * 4  # each rank held 2 of the 4 experts
    assert len(list(out.glob("model-*.safetensors"))) > 3 and (out / "model.safetensors.index.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"]) == (["Llama4ForCausalLM"], 4)
    expected = transformers_llama4_logits(out, TOKENS)
    check_close("trained Llama 4's hf export (convert at ep2 x mp2): transformers vs hybridpar",
                {"logits": rel_err(results[0]["logits"], expected)}, BOUND)


def test_convert_to_meta_of_a_llama4_folder_is_one_line_before_its_weights_load(tmp_path, capsys):
    """A Llama 4 folder's config.json and an index naming no shard (a load would fail on the weights)."""
    from hybridpar.checkpoint.hf import hf_config
    from hybridpar.cli import main
    from hybridpar.models.args import ModelArgs

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(ModelArgs.from_preset("debug_llama4"))))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    assert main(["convert", str(folder), str(tmp_path / "meta"), "--to", "meta"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hybridpar: error: Meta's format is written for Llama 2 and 3; a Llama 4 model (experts, RoPE-less or chunked "
        "attention) converts to hf or dcp (hybridpar convert --to hf)"]
    assert not (tmp_path / "meta").exists()
