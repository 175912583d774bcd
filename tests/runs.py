"""Small training configurations shared by the trainer and checkpoint tests."""

GLOBAL_BATCH = 8  # sequences per optimizer step, at every layout


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
        "checkpoint.at_end": False,
        **overrides,
    }
    return load_config(None, [f"--{k}={v}" for k, v in flags.items()])
