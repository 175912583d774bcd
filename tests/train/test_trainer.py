"""Training end to end against single-process math: the same global batch, the same steps, at every layout."""

import json
import math
import re

import pytest
import torch

from tests.distributed import rel_err
from tests.runs import make_config

BOUND = 1e-4



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
    # mp > 1 layouts run sequence parallelism (the default); this one the all-reduce path without it.
    "mp2-dp_shard2-no_sequence_parallel": (4, dict(mp=2, dp_shard=2, strategy="hybrid_shard", dp=2, **{
        "parallel.sequence_parallel": False})),
    "mp2-hybrid_shard-2x2": (8, dict(mp=2, dp_shard=2, dp_replicate=2, strategy="hybrid_shard", dp=4)),
    # FSDP2's own all-gather and reduce-scatter, the collectives nccl runs (gloo's default is all-to-all).
    "mp2-hybrid_shard-2x2-fsdp_collectives": (8, dict(mp=2, dp_shard=2, dp_replicate=2, strategy="hybrid_shard",
                                                      dp=4, **{"fsdp.gloo_all_to_all": False})),
    "mp2-no_shard-dp2": (4, dict(mp=2, dp_shard=1, dp_replicate=2, strategy="no_shard", dp=2)),
    "mp2-dp2-accum2": (4, dict(mp=2, dp_shard=2, strategy="full_shard", dp=2, grad_accum=2)),
    "mp1-world1-accum2": (1, dict(dp=1, grad_accum=2)),
    "mp2-hybrid-2x2-accum2-sync_every": (8, dict(mp=2, dp_shard=2, dp_replicate=2, strategy="hybrid_shard", dp=4,
                                                 grad_accum=2, **{"train.grad_sync": "every"})),
    # ZeRO-2 variants and activation checkpointing change when things are computed, not what.
    "mp1-shard_grad_op-dp4-ac_selective": (4, dict(mp=1, dp_shard=4, strategy="shard_grad_op", dp=4, **{
        "fsdp.activation_checkpointing": "selective", "fsdp.ac_every": 2})),
    "mp2-hybrid_shard_zero2-2x2-ac_full": (8, dict(mp=2, dp_shard=2, dp_replicate=2, strategy="hybrid_shard_zero2",
                                                   dp=4, **{"fsdp.activation_checkpointing": "full"})),
    # Compiled blocks (fused kernels, the tensor-parallel collectives traced), one of them checkpointed.
    "mp2-dp_shard2-compile-ac_selective": (4, dict(mp=2, dp_shard=2, strategy="hybrid_shard", dp=2, **{
        "train.compile": True, "fsdp.activation_checkpointing": "selective", "fsdp.ac_every": 2})),
}


@pytest.mark.slow
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


@pytest.mark.slow
def test_bf16_mixed_precision_trains(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, strategy="hybrid_shard", dp=2, steps=20,
                         **{"fsdp.param_dtype": "bfloat16", "optim.grad_clip": 1.0})
    hist = workers(4).run(_case_train, config, False)[0]["history"]
    first, last = hist[0]["loss"], sum(m["loss"] for m in hist[-3:]) / 3
    print(f"\nbf16 loss {first:.3f} -> {last:.3f}")
    assert math.isfinite(last) and last < first - 0.5


# --- clipping against torch's ----------------------------------------------------------------


def _case_clipping(mp: int, dp_shard: int) -> dict:
    """One backward of the debug model at the layout; then grad_norm_and_clip at a max norm half the
    gradients' norm and at twice it, against torch.nn.utils.clip_grad_norm_ on the full gradients (in
    float64: the reference's own rounding out of the comparison)."""
    from torch.distributed.tensor import DTensor

    from hybridpar.build import build_model
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.models.args import ModelArgs
    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.train.optim import grad_norm_and_clip
    from tests.distributed import parallel_dims

    parallel = parallel_dims(mp=mp, dp_shard=dp_shard)
    args = ModelArgs.from_preset("debug")
    torch.manual_seed(0)
    fsdp = FSDPConfig(sharding_strategy="full_shard", param_dtype="float32") if dp_shard > 1 else None
    model = build_model(args, parallel, fsdp=fsdp)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1 + parallel.dp_rank))
    vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], parallel=parallel).backward()

    def full(grad):  # collective: every rank gathers every gradient in the same order
        return grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()

    def local(grad):
        return grad.to_local() if isinstance(grad, DTensor) else grad

    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    grads = [p.grad.detach().clone() for _, p in named]
    whole = [full(g).double() for g in grads]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in whole])).item()
    errors, unchanged = {}, None
    for scale in (0.5, 2.0):  # clipped, and under the max norm (left alone)
        for (_, p), g in zip(named, grads):
            p.grad = g.clone()
        got, _ = grad_norm_and_clip([p for _, p in named], scale * norm)
        expected = [torch.nn.Parameter(torch.zeros_like(g)) for g in whole]
        for e, g in zip(expected, whole):
            e.grad = g.clone()
        torch_norm = torch.nn.utils.clip_grad_norm_(expected, scale * norm).item()
        errors[f"norm at max {scale} x norm"] = abs(got - torch_norm) / torch_norm
        for (name, p), e in zip(named, expected):
            errors[f"{name} at max {scale} x norm"] = rel_err(full(p.grad), e.grad)  # (rel_err: in float64)
        if scale > 1:
            unchanged = all(torch.equal(local(p.grad), local(g)) for (_, p), g in zip(named, grads))
    return {"errors": errors, "unchanged": unchanged, "norm": norm}


@pytest.mark.parametrize("mp,dp_shard", [(1, 1), (2, 2)], ids=["world1", "mp2-dp_shard2"])
def test_clipping_matches_torchs_clip_grad_norm(workers, check_close, mp, dp_shard):
    results = workers(mp * dp_shard).run(_case_clipping, mp, dp_shard)
    assert all(r["norm"] > 0 for r in results), results
    check_close(f"clipping at mp{mp} x dp_shard{dp_shard} vs torch.nn.utils.clip_grad_norm_",
                [r["errors"] for r in results], 1e-6)


def test_gradients_under_the_max_norm_are_left_alone(workers):
    """Bit for bit: the clip coefficient is at most 1."""
    assert workers(1).run(_case_clipping, 1, 1)[0]["unchanged"], "gradients under the max norm must be left as they are"


# --- bad input: clear errors before any work is lost ------------------------------------------


def _case_trainer_error(config):
    from hybridpar.train import Trainer

    try:
        Trainer(config)
    except (ValueError, FileNotFoundError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


BAD_INPUT = {
    "mesh sizes": ({"parallel.mp": 3}, r"world size 1 is not divisible by mp \* dp_replicate = 3 \* 1 = 3"),
    "seq_len": ({"data.seq_len": 65}, r"data.seq_len = 65 is larger than the model's max_seq_len = 64"),
    "dataset too small": ({"data.micro_batch_size": 4000}, r"dataset has 2126 windows .* but one global batch needs 4000 \(micro_batch 4000 x grad_accum 1 x dp_size 1\)"),
    "tokenizer vocab": ({"model.vocab_size": 256}, r"512.*256|256.*512"),
    "missing data": ({"data.source": "/nonexistent/corpus.jsonl"}, r"data.source: /nonexistent/corpus.jsonl does not exist"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gives_a_clear_error(workers, corpus, tmp_path, case):
    overrides, expected = BAD_INPUT[case]
    config = make_config(corpus, tmp_path / "run", **overrides)
    message = workers(1).run(_case_trainer_error, config)[0]
    print(f"\n{case}: {message}")
    assert re.search(expected, message), message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_seq_len_mp_does_not_divide_is_refused_with_sequence_parallelism(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path / "run", mp=2, dp=1, **{"data.seq_len": 33})
    for message in workers(2).run(_case_trainer_error, config):
        print(f"\n{message}")
        assert "data.seq_len = 33 is not divisible by parallel.mp = 2: sequence parallelism" in message, message
        assert "parallel.sequence_parallel = false" in message


def test_unknown_config_key_lists_valid_keys(tmp_path):
    from hybridpar.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz' \(did you mean train.steps\?\); "
                                          r"valid keys in \[train\] are \[.*'steps'"):
        load_config(None, ["--train.stepz", "3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'run_dir' \(did you mean output.run_dir\?\); sections"):
        load_config(None, ["--run_dir", "runs/x"])
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'; valid keys in \[optim\]"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"train.steps: expected int, got 'many'"):
        load_config(None, ["--train.steps", "many"])


def _case_strategy_mesh_error(strategy, mp, dp_shard, dp_replicate):
    from hybridpar.parallel.fsdp import dp_mesh_for
    from tests.distributed import parallel_dims

    try:
        dp_mesh_for(strategy, parallel_dims(mp, dp_shard, dp_replicate))
    except ValueError as err:
        return str(err)
    return "no error"


def test_strategy_that_does_not_fit_the_mesh_is_an_error(workers):
    pool = workers(4)
    assert "use hybrid_shard" in pool.run(_case_strategy_mesh_error, "full_shard", 1, 2, 2)[0]
    assert "set dp_shard = 1 and dp_replicate = 4" in pool.run(_case_strategy_mesh_error, "no_shard", 1, 4, 1)[0]
    assert pool.run(_case_strategy_mesh_error, "hybrid_shard", 2, 1, 2)[0] == "no error"


# --- non-finite losses -------------------------------------------------------------------------


def _case_nonfinite(config, bad_step):
    from hybridpar.train import NonFiniteLossError, Trainer

    trainer = Trainer(config)
    forward = trainer.model.forward

    def poisoned(tokens, *args, **kwargs):  # NaN logits during one chosen step
        out = forward(tokens, *args, **kwargs)
        return out * float("nan") if trainer.step + 1 == bad_step else out

    trainer.model.forward = poisoned
    try:
        history = trainer.run()
    except NonFiniteLossError as err:
        return {"error": str(err), "steps_done": trainer.step}
    return {"skipped": [m["step"] for m in history if m["skipped"]], "final_loss": history[-1]["loss"]}


def test_nan_loss_stops_naming_the_step(workers, corpus, tmp_path):
    result = workers(4).run(_case_nonfinite, make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2), 3)[0]
    assert result["steps_done"] == 2 and result["error"].startswith("step 3: loss nan"), result
    assert "train.on_nonfinite" in result["error"]


def test_nan_loss_is_skipped_when_configured(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2, **{"train.on_nonfinite": "skip"})
    result = workers(4).run(_case_nonfinite, config, 3)[0]
    assert result["skipped"] == [3] and math.isfinite(result["final_loss"]), result


# --- outputs ---------------------------------------------------------------------------------


def test_run_folder_has_metrics_tensorboard_and_plot(workers, corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2, steps=4,
                         **{"output.tensorboard": True, "output.plot": True, "train.log_every": 2})
    workers(4).run(_case_train, config, False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_gb"} <= rows[0].keys()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 4]
    tags = set(events.Tags()["scalars"])
    assert {"train/lr", "train/grad_norm", "perf/step_time_s", "perf/tokens_per_s", "perf/mfu", "memory/peak_gb"} <= tags
    assert all(tag.split("/")[0] in ("train", "val", "perf", "memory") for tag in tags), tags
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[train]" in (tmp_path / "config.toml").read_text()


def _case_printed(config):
    import contextlib
    import io

    from hybridpar.train import Trainer

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        Trainer(config).run()
    return printed.getvalue()


def test_the_step_line_shows_elapsed_time_and_eta(workers, corpus, tmp_path):
    from hybridpar.train.clock import WARMUP_STEPS

    out = workers(1).run(_case_printed, make_config(corpus, tmp_path, steps=6))[0]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    print("\n" + "\n".join(lines))
    found = [re.match(r"step +(\d+)/6  elapsed (\d+):(\d\d):(\d\d)  eta (\?|\d+:\d\d:\d\d)  loss \d", line)
             for line in lines]
    assert all(found) and [int(m[1]) for m in found] == list(range(1, 7)), lines
    elapsed = [3600 * int(m[2]) + 60 * int(m[3]) + int(m[4]) for m in found]
    assert elapsed == sorted(elapsed)
    etas = [m[5] for m in found]
    assert etas[:WARMUP_STEPS] == ["?"] * WARMUP_STEPS and etas[-1] == "0:00:00"
    assert all(eta != "?" for eta in etas[WARMUP_STEPS:]), etas


def _case_vocab_from_tokenizer(config):
    from hybridpar.train import Trainer

    return Trainer(config).args.vocab_size


def test_llama2_params_json_takes_the_tokenizer_vocab(workers, corpus, tmp_path):
    params = tmp_path / "params.json"  # Meta's Llama 2 convention: vocab_size -1
    params.write_text(json.dumps({"dim": 64, "n_layers": 1, "n_heads": 4, "multiple_of": 32, "norm_eps": 1e-05,
                                  "vocab_size": -1, "max_seq_len": 64}))
    config = make_config(corpus, tmp_path / "run", **{"model.params_json": str(params), "model.vocab_size": 0})
    assert workers(1).run(_case_vocab_from_tokenizer, config)[0] == 512


# --- timeouts after a resume -------------------------------------------------------------------


def _case_first_step_checks(config):
    import hybridpar.diagnostics.timeouts as timeouts_module
    import hybridpar.train.supervisor as supervisor_module
    import hybridpar.train.trainer as trainer_module

    real_timeout, real_guard, calls, guarded = timeouts_module.set_train_timeout, supervisor_module.check_data, [], []
    trainer = trainer_module.Trainer(config)

    def recording(parallel, seconds):
        calls.append((trainer.step, seconds))
        real_timeout(parallel, seconds)

    def guard(fingerprint, parallel, step):
        guarded.append(step)
        real_guard(fingerprint, parallel, step)

    timeouts_module.set_train_timeout, supervisor_module.check_data = recording, guard
    try:
        before = trainer.supervisor.deadlines.no_progress_limit()
        trainer.run()
    finally:
        timeouts_module.set_train_timeout, supervisor_module.check_data = real_timeout, real_guard
    return {"start": trainer.start_step, "before": before, "calls": calls,
            "after": trainer.supervisor.deadlines.no_progress_limit(), "guarded": guarded}


def test_a_resumed_run_treats_its_own_first_step_as_the_first(workers, corpus, tmp_path):
    # The first step of a resumed run compiles and all-gathers like any first step: the short train
    # timeout must wait for it, and must then be set (it once was only set at global step 1). A
    # checkpoint's writes may take long too: the collectives wait as long as the watchdog then. The
    # data guard runs at a resumed run's first step: a resume at another layout is when data goes wrong.
    flags = {"diagnostics.train_timeout": 300, "parallel.init_timeout": 600, "checkpoint.resume": True}
    workers(2).run(_case_train, make_config(corpus, tmp_path, dp=2, steps=2, **flags, **{"checkpoint.at_end": True}),
                   False)
    config = make_config(corpus, tmp_path, dp=2, steps=4, **flags, **{"checkpoint.at_end": True})
    result = workers(2).run(_case_first_step_checks, config)[0]
    print(result)
    assert result["start"] == 2 and result["before"] == 600 and result["after"] == 300, result
    # Shortened after step 3; during the final checkpoint the collectives get the init timeout back.
    grace = result["calls"][0][1] - 300
    assert result["calls"] == [(3, 300 + grace), (4, 600), (4, 300 + grace)] and grace >= 0, result
    assert result["guarded"] == [3], result
