"""Training with pipeline parallelism against the same layout without it (issue 38's must-show): the
tiny preset at seq 512 for 8 steps, pp 2 (1F1B, world 2) against world 1, pp 2 x mp 2 with sequence
parallelism (Interleaved1F1B, world 4) against mp 2, pp 2 x dp 2 (ZBVZeroBubble, world 4) against
dp 2: every step's loss (as rank 0, a first-stage rank, logs it) and gradient norm within 1e-5, with
clipping active, and the validation loss through the pipeline (forward only; torch's V schedules run
none, so ZBVZeroBubble trains without validation). Each stage keeps its FSDP blocks gathered between
micro-batches."""

import pytest

from tests.runs import make_config

BOUND = 1e-5
TINY_512 = {"model.preset": "tiny", "model.vocab_size": 4096, "data.tokenizer_vocab_size": 4096,
            "data.seq_len": 512, "steps": 8}
BATCH = 4  # the global batch, in sequences
VAL = {"data.val_fraction": 0.1}  # validated after the last step
LAYOUTS = {
    # name: (world, make_config keyword arguments, data-parallel degree)
    "world1": (1, VAL, 1),
    "mp2-sequence_parallel": (2, dict(mp=2, strategy="hybrid_shard", **VAL), 1),
    "dp2": (2, dict(dp_shard=2), 2),
    # 2 micro-batches of 2 sequences; activation checkpointing of layer 0 and 2 (ac_every 2), on stage 0 and 1
    "pp2-1F1B": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1F1B", "fsdp.activation_checkpointing": "selective",
                     **VAL}, 1),
    # 4 stages (layers 1, 2, 1, 0: the last holds the head alone), 4 micro-batches of 1 sequence
    "pp2-mp2-Interleaved1F1B": (4, dict(mp=2, strategy="hybrid_shard", **VAL, **{
        "parallel.pp": 2, "parallel.pp_schedule": "Interleaved1F1B"}), 1),
    # rank 0 holds stages 0 and 3 (the embedding and the head); 2 micro-batches of 1 sequence per dp rank
    "pp2-dp2-ZBVZeroBubble": (4, dict(dp_shard=2, **{"parallel.pp": 2, "parallel.pp_schedule": "ZBVZeroBubble",
                                                   "parallel.pp_microbatches": 2}), 2),
}
WITHOUT_PP = {"pp2-1F1B": "world1", "pp2-mp2-Interleaved1F1B": "mp2-sequence_parallel",
              "pp2-dp2-ZBVZeroBubble": "dp2"}


def _case_train(config) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hybridpar.train import Trainer

    trainer = Trainer(config)
    history = trainer.run()
    # Under pp every block stays gathered from its first micro-batch's forward to the backward:
    # FSDP's post-forward reshard would all-gather it again for every micro-batch.
    resharded = [name for part in trainer.model_parts for name, block in part.layers.items()
                 if fully_shard.state(block)._fsdp_param_group.post_forward_mesh_info is not None]
    return {"history": history if dist.get_rank() == 0 else None, "resharded": resharded,
            "validation": trainer.validation,
            "parts": len(trainer.model_parts), "pp": trainer.parallel.pp}


@pytest.fixture(scope="module")
def history(workers, corpus, tmp_path_factory):
    """history(layout) -> (rank 0's 8 steps' metrics, every rank's blocks resharded after forward);
    each layout runs once for the module."""
    runs = {}

    def get(layout: str):
        if layout not in runs:
            world, kwargs, dp = LAYOUTS[layout]
            config = make_config(corpus, tmp_path_factory.mktemp(layout), dp=dp, **kwargs,
                                 **{**TINY_512, "data.micro_batch_size": BATCH // dp})
            runs[layout] = workers(world).run(_case_train, config)
        return runs[layout]

    return get


def _step_errors(hist, ref_hist) -> dict:
    assert len(hist) == len(ref_hist) == 8
    assert [m["tokens"] for m in hist] == [m["tokens"] for m in ref_hist] == [BATCH * 512] * 8
    return {f"{key} step {a['step']}": abs(a[key] - b[key]) / abs(b[key])
            for a, b in zip(hist, ref_hist) for key in ("loss", "grad_norm")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(WITHOUT_PP))
def test_tiny_seq512_pipeline_matches_the_run_without_pp(history, check_close, layout):
    """Every step's loss and gradient norm within 1e-5 (relative) of the same layout without pp; the
    errors of every step are printed."""
    base = WITHOUT_PP[layout]
    ranks, ref = history(layout), history(base)
    hist, ref_hist = ranks[0]["history"], ref[0]["history"]
    assert ref_hist[0]["grad_norm"] > 0.5, "clipping (optim.grad_clip 0.5) must be active"
    assert all(r["pp"] == 2 for r in ranks) and {r["parts"] for r in ranks} == {1 if layout == "pp2-1F1B" else 2}
    assert [r["resharded"] for r in ranks] == [[]] * len(ranks), "a block resharded between micro-batches"
    assert [r["resharded"] for r in ref] != [[]] * len(ref)  # ...which it does without pp (full_shard)
    errors = _step_errors(hist, ref_hist)
    validated = "data.val_fraction" in LAYOUTS[layout][1]
    if validated:  # every rank's, each stage's included
        want = ref[0]["validation"]["val_loss"]
        errors.update({f"val_loss rank {i}": abs(r["validation"]["val_loss"] - want) / want
                       for i, r in enumerate(ranks)})
    for key in ("loss", "grad_norm"):
        print(f"\n{layout} vs {base} {key}: " + " ".join(f"{errors[f'{key} step {s}']:.1e}" for s in range(1, 9)))
    check_close(f"tiny seq 512 {layout} vs {base}", errors, BOUND)
    if validated:
        assert {r["validation"]["val_tokens"] for r in ranks} == {ref[0]["validation"]["val_tokens"]}


def _history(config) -> list:
    import torch.distributed as dist

    from hybridpar.train import Trainer

    trainer = Trainer(config)
    history = trainer.run()
    if config.train.compile:  # every block of every stage went through torch.compile
        assert all(block._compiled_call_impl is not None for part in trainer.model_parts
                   for block in part.layers.values())
    return [(m["loss"], m["grad_norm"]) for m in history] if dist.get_rank() == 0 else []


@pytest.mark.slow
def test_gradient_accumulation_under_pp(workers, corpus, check_close, tmp_path):
    """pp 2 (GPipe, the 4 layers split 3 and 1 by parallel.pp_layers) with train.grad_accum 2: two schedule
    steps per optimizer step, FSDP reducing after each, against world 1 without accumulation."""
    small = {"model.n_layers": 4}
    ref = workers(1).run(_history, make_config(corpus, tmp_path / "ref", **small))[0]
    got = workers(2).run(_history, make_config(corpus, tmp_path / "pp", grad_accum=2, **small, **{
        "parallel.pp": 2, "parallel.pp_schedule": "GPipe", "parallel.pp_layers": "3,1"}))[0]
    assert len(got) == len(ref) == 5 and ref[0][1] > 0.5  # clipping active
    check_close("pp 2 grad_accum 2 vs world 1", {f"{k} step {i + 1}": abs(a[j] - b[j]) / abs(b[j])
                                                  for i, (a, b) in enumerate(zip(got, ref))
                                                  for j, k in enumerate(("loss", "grad_norm"))}, BOUND)


@pytest.mark.slow
def test_compiled_stages_under_pp(workers, corpus, check_close, tmp_path):
    """pp 2 (1F1B) with train.compile and full activation checkpointing: each stage's blocks compiled
    by the one build_model, losses and gradient norms within 1e-5 of world 1 without compile."""
    small = {"model.n_layers": 4}
    ref = workers(1).run(_history, make_config(corpus, tmp_path / "ref", **small))[0]
    got = workers(2).run(_history, make_config(corpus, tmp_path / "pp", **small, **{
        "parallel.pp": 2, "train.compile": True, "fsdp.activation_checkpointing": "full"}))[0]
    assert len(got) == len(ref) == 5 and ref[0][1] > 0.5  # clipping active
    check_close("pp 2 compiled vs world 1", {f"{k} step {i + 1}": abs(a[j] - b[j]) / abs(b[j])
                                            for i, (a, b) in enumerate(zip(got, ref))
                                            for j, k in enumerate(("loss", "grad_norm"))}, BOUND)


STALL = 0.5  # seconds stage 1 spends in its first forward of the profiled step


def _case_profile_stalled(config) -> dict:
    import time

    import torch.distributed as dist

    from hybridpar.train import Trainer

    trainer = Trainer(config)
    stalled = []

    def hook(module, args):  # stage 1's own compute, which stage 0 waits for in its receives
        if dist.get_rank() == 1 and trainer.step + 1 == 2 and not stalled:
            stalled.append(True)
            time.sleep(STALL)

    trainer.model_parts[0].register_forward_pre_hook(hook)
    trainer.run()
    return {"rows": trainer.profiler.rows, "text": trainer.profiler.describe()}


@pytest.mark.slow
def test_a_pipeline_profile_counts_the_stages_sends_receives_and_waits_apart_from_compute(workers, corpus, tmp_path):
    """pp 2 (1F1B), step 2 profiled, stage 1 busy STALL s in its first forward: stage 0 spends that
    time waiting for its gradients, which its breakdown counts as the pipeline's (its sends,
    receives and the waits for them: the bubble), not as compute; stage 1's compute holds it."""
    config = make_config(corpus, tmp_path, steps=2, **{"model.n_layers": 2, "parallel.pp": 2,
                                                        "parallel.pp_microbatches": 2, "train.profile_steps": "2"})
    results = workers(2).run(_case_profile_stalled, config)
    print("\n" + "\n".join(r["text"] for r in results))
    first, last = [r["rows"][0] for r in results]
    for row in (first, last):
        assert row["step"] == 2 and row["pipeline"]["calls"] == 4  # 2 micro-batches: 2 sends, 2 receives
        assert row["compute_s"] + row["communication_s"] + row["pipeline_s"] == pytest.approx(row["seconds"])
    assert first["pipeline_s"] > 0.8 * STALL > first["compute_s"]
    assert last["compute_s"] > STALL > last["pipeline_s"]
    assert "pp" in first["by_dim"]  # the loss and gradient-norm all-reduces stay communication
