"""Training end to end against single-process math: the same global batch, the same steps, at every layout."""

import json
import math

import pytest
import torch

from tests.distributed import rel_err

BOUND = 1e-4
GLOBAL_BATCH = 8  # sequences per optimizer step, at every layout


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small jsonl corpus (real text from the embedded corpus) and a cache folder shared by all runs."""
    from hybridpar.data import default_corpus_documents

    root = tmp_path_factory.mktemp("train_data")
    path = root / "docs.jsonl"
    with open(path, "w") as f:
        for doc in default_corpus_documents(400):
            f.write(json.dumps({"text": doc}) + "\n")
    return {"source": str(path), "cache_dir": str(root / "cache")}


def make_config(corpus, run_dir, *, mp=1, dp_shard=-1, dp_replicate=1, strategy="full_shard", dp=1,
                grad_accum=1, steps=5, **overrides):
    from hybridpar.config import load_config

    flags = {
        "model.preset": "debug", "model.vocab_size": 512,
        "parallel.mp": mp, "parallel.dp_shard": dp_shard, "parallel.dp_replicate": dp_replicate,
        "fsdp.sharding_strategy": strategy, "fsdp.param_dtype": "float32",
        "data.source": corpus["source"], "data.cache_dir": corpus["cache_dir"], "data.tokenizer_vocab_size": 512,
        "data.seq_len": 32, "data.micro_batch_size": GLOBAL_BATCH // (dp * grad_accum),
        "train.grad_accum": grad_accum, "train.steps": steps, "train.log_every": 1, "train.peak_flops": 1e12,
        "optim.lr": 3e-3, "optim.warmup_steps": 2, "optim.grad_clip": 0.5,  # small: clipping is active
        # Adam divides by sqrt(v) + eps: a larger eps keeps near-zero gradients from amplifying rounding.
        "optim.eps": 1e-6,
        "output.run_dir": str(run_dir), "output.tensorboard": False, "output.plot": False,
        **overrides,
    }
    return load_config(None, [f"--{k}={v}" for k, v in flags.items()])


def _case_train(config, return_params=True):
    import torch.distributed as dist

    from hybridpar.parallel.state import full_state_dict
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    history = trainer.run()
    params = full_state_dict(trainer.model) if return_params else None
    first = dist.get_rank() == 0
    return {"history": history, "params": params if first else None}


@pytest.fixture(scope="module")
def reference(workers, corpus, tmp_path_factory):
    """World size 1, no accumulation: the single-process math every layout must reproduce."""
    config = make_config(corpus, tmp_path_factory.mktemp("ref"), dp=1)
    return workers(1).run(_case_train, config)[0]


LAYOUTS = {
    # name: (world, make_config keyword arguments)
    "mp1-full_shard-dp4": (4, dict(mp=1, dp_shard=4, strategy="full_shard", dp=4)),
    "mp2-dp_shard2": (4, dict(mp=2, dp_shard=2, strategy="hybrid_shard", dp=2)),
    "mp2-hybrid_shard-2x2": (8, dict(mp=2, dp_shard=2, dp_replicate=2, strategy="hybrid_shard", dp=4)),
    "mp2-no_shard-dp2": (4, dict(mp=2, dp_shard=1, dp_replicate=2, strategy="no_shard", dp=2)),
    "mp2-dp2-accum2": (4, dict(mp=2, dp_shard=2, strategy="full_shard", dp=2, grad_accum=2)),
    "mp1-world1-accum2": (1, dict(dp=1, grad_accum=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_single_process(workers, check_close, corpus, reference, tmp_path, layout):
    world, kwargs = LAYOUTS[layout]
    result = workers(world).run(_case_train, make_config(corpus, tmp_path, **kwargs))[0]
    ref_hist, hist = reference["history"], result["history"]
    assert len(hist) == len(ref_hist) == 5
    print(f"\n{layout} loss curve: {[round(m['loss'], 6) for m in hist]}")
    print(f"{'world-1':>{len(layout)}} loss curve: {[round(m['loss'], 6) for m in ref_hist]}")
    assert ref_hist[0]["grad_norm"] > 0.5, "clipping must be active for the norm comparison to mean something"
    errors = {}
    for a, b in zip(hist, ref_hist):
        errors[f"loss step {a['step']}"] = rel_err(torch.tensor(a["loss"]), torch.tensor(b["loss"]))
        errors[f"grad_norm step {a['step']}"] = rel_err(torch.tensor(a["grad_norm"]), torch.tensor(b["grad_norm"]))
    for name, value in reference["params"].items():
        errors[f"param {name}"] = rel_err(result["params"][name], value)
    check_close(layout, errors, BOUND)
    assert hist[-1]["loss"] < hist[0]["loss"]


def test_bf16_mixed_precision_trains(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, strategy="hybrid_shard", dp=2, steps=20,
                         **{"fsdp.param_dtype": "bfloat16", "optim.grad_clip": 1.0})
    hist = workers(4).run(_case_train, config, False)[0]["history"]
    first, last = hist[0]["loss"], sum(m["loss"] for m in hist[-3:]) / 3
    print(f"\nbf16 loss {first:.3f} -> {last:.3f}")
    assert math.isfinite(last) and last < first - 0.5
