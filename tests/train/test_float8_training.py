"""Float8 training through the Trainer (issue 50), emulated on the CPU, against the same recipe at
world 1 (fp32 master weights): mp 2 (no sequence parallelism), mp 2 x dp 2 with sequence
parallelism, cp 2 and pp 2 (1F1B), float8.recipe tensorwise and rowwise.

A float8 cast keeps 3 mantissa bits (2 for gradients). Where a layout's fp32 sums round one bit
apart from world 1's (a row-parallel linear's partial sums, cp's attention), an element close to a
float8 rounding boundary rounds the other way; that moves its token's row of the next matmul by
~1e-3, which flips more elements in the next cast: an avalanche. In the debug preset it does not
start (step 1's gradients agree to 4e-7). In the tiny preset at seq 512 it does, from the first
step, at mp 2 and cp 2: their step-1 gradients are 0.9-2.5% (median over the parameters) from world
1's (fp32's are 9% from float8's), and Adam carries that into the later steps' losses (up to 5.2e-3
apart by step 17, tensorwise; 2.4e-3 rowwise). Each rank's own amax instead of the reduced one moves
the gradients 9-12%: at that shape no gradient bound tells a wrong scale from the avalanche, and a
loss bound never does (the loss moved 2.4e-5 at step 1). So:

- the debug preset, 5 steps (CI's case and the extended tier's): every step's loss within 1e-4
  and step 1's gradients within 1e-3 of world 1; without the amax reductions the gradients are
  1e-1 off (tensorwise; rowwise's power-of-2 scales hardly ever differ on such data, whose
  reductions tests/parallel/test_float8.py checks on spread inputs), the losses 1.4e-4;
- the tiny preset at seq 512, 20 steps (the issue's shape; extended): every layout's step-1 loss
  within 1e-4, and pp 2's step-1 gradients within 1e-6 (its arithmetic is world 1's); each step's
  loss error is printed. (From step 18 the world-1 loss jumps, 4.7 to 6.5, and even fp32 at mp 2
  x dp 2 parts from fp32 at world 1, by 1.9e-2 at step 20.)

A float8 scale is the amax of a micro-batch's tokens (of a tensor's rows, rowwise), never reduced
over dp: every micro-batch here is one sequence, and world 1 accumulates the same sequences
(train.grad_accum) that dp 2 and pp 2's pipeline micro-batches split."""

import pytest

from tests.runs import make_config

LOSS_BOUND, GRAD_BOUND = 1e-4, 1e-3
BATCH = 4  # sequences per optimizer step, one per micro-batch
SHAPES = {
    "debug": {"model.preset": "debug", "model.vocab_size": 512, "data.tokenizer_vocab_size": 512,
              "data.seq_len": 64, "steps": 5},
    "tiny-512": {"model.preset": "tiny", "model.vocab_size": 4096, "data.tokenizer_vocab_size": 4096,
                 "data.seq_len": 512, "steps": 20},
    "debug_llama4": {"model.preset": "debug_llama4", "model.vocab_size": 512, "data.tokenizer_vocab_size": 512,
                     "data.seq_len": 64, "steps": 5},
}
LAYOUTS = {
    # name: (world, make_config keyword arguments)
    "world1": (1, dict(grad_accum=BATCH)),
    "mp2": (2, dict(mp=2, grad_accum=BATCH, **{"parallel.sequence_parallel": False})),
    "mp2-dp2-sequence_parallel": (4, dict(mp=2, dp_shard=2, grad_accum=BATCH // 2)),
    "cp2": (2, dict(grad_accum=BATCH, **{"parallel.cp": 2})),
    # 2 pipeline micro-batches of one sequence, twice
    "pp2": (2, dict(grad_accum=2, **{"parallel.pp": 2, "parallel.pp_schedule": "1F1B", "parallel.pp_microbatches": 2,
                                     "data.micro_batch_size": 2})),
}
# Issue 52: a mixture of experts, float8 in its dense linears (attention, shared experts, dense layers),
# its routed experts in fp32; ep takes its ranks from dp_shard.
EXPERT_LAYOUTS = {
    "ep2": (2, dict(dp_shard=2, grad_accum=BATCH // 2, **{"parallel.ep": 2})),
    "pp2-ep2": (4, dict(dp_shard=2, grad_accum=1, **{"parallel.pp": 2, "parallel.ep": 2, "parallel.pp_microbatches": 2,
                                                     "data.micro_batch_size": 2})),
    "mp2-sequence_parallel-ep1": (2, dict(mp=2, grad_accum=BATCH)),
    "ep2-mp2-sequence_parallel": (4, dict(mp=2, dp_shard=2, grad_accum=BATCH // 2, **{"parallel.ep": 2})),
}
RECIPES = ("tensorwise", "rowwise")
CI = ("tensorwise", "mp2-dp2-sequence_parallel")  # CI's case; the others are the extended tier's


def _case_train(config) -> dict:
    """The run's losses, and on one rank per pipeline stage step 1's full gradients (after
    clipping) under the unsplit names."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hybridpar.checkpoint.stages import one_module
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    model, p, grads = one_module(trainer.model_parts), trainer.parallel, {}

    def keep_gradients(optimizer, args, kwargs):  # every rank of a stage gathers each gradient
        if trainer.step == 0:
            grads.update({name: (q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad).clone()
                          for name, q in model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(keep_gradients)
    history = trainer.run()
    first = p.mp_rank == p.dp_rank == p.cp_rank == 0  # one rank of each stage
    return {"losses": [m["loss"] for m in history] if dist.get_rank() == 0 else None, "grads": grads if first else {}}


@pytest.fixture(scope="module")
def trained(workers, corpus, tmp_path_factory):
    """trained(shape, recipe, layout) -> {"losses", "grads"}; each run once for the module."""
    runs = {}

    def get(shape: str, recipe: str, layout: str) -> dict:
        key = (shape, recipe, layout)
        if key not in runs:
            world, kwargs = {**LAYOUTS, **EXPERT_LAYOUTS}[layout]
            config = make_config(corpus, tmp_path_factory.mktemp("-".join(key)), **{
                **SHAPES[shape], "data.micro_batch_size": 1, "float8.recipe": recipe, **kwargs})
            ranks = workers(world).run(_case_train, config, timeout=1800)
            runs[key] = {"losses": ranks[0]["losses"], "grads": {k: v for r in ranks for k, v in r["grads"].items()}}
        return runs[key]

    return get


def _errors(run: dict, ref: dict) -> tuple[dict, dict]:
    """({"loss step s": error}, {"gradient step 1 <name>": error}), relative."""
    from tests.distributed import rel_err

    assert len(run["losses"]) == len(ref["losses"])
    losses = {f"loss step {s + 1}": abs(a - b) / abs(b) for s, (a, b) in enumerate(zip(run["losses"], ref["losses"]))}
    assert sorted(run["grads"]) == sorted(ref["grads"]) and len(ref["grads"]) > 20  # every parameter
    return losses, {f"gradient step 1 {name}": rel_err(g, ref["grads"][name]) for name, g in run["grads"].items()}


def _print(shape: str, recipe: str, layout: str, losses: dict, grads: dict) -> None:
    worst, median = max(grads, key=grads.get), sorted(grads.values())[len(grads) // 2]
    print(f"\n{shape} {recipe} {layout} vs world 1: losses {' '.join(f'{e:.1e}' for e in losses.values())}; "
          f"step 1's gradients: median {median:.1e}, worst {grads[worst]:.1e} ({worst.split()[-1]})")


def _check_debug(trained, check_close, cases, shape: str = "debug") -> None:
    """Each (recipe, layout) of `cases` in the debug preset (or `shape`) against world 1: the losses, step 1's gradients."""
    losses, grads = {}, {}
    for recipe, layout in cases:
        run_losses, run_grads = _errors(trained(shape, recipe, layout), trained(shape, recipe, "world1"))
        _print(shape, recipe, layout, run_losses, run_grads)
        losses.update({f"{recipe} {layout} {k}": v for k, v in run_losses.items()})
        grads.update({f"{recipe} {layout} {k}": v for k, v in run_grads.items()})
    check_close(f"float8 {shape} preset losses", losses, LOSS_BOUND)
    check_close(f"float8 {shape} preset, step 1's gradients", grads, GRAD_BOUND)


@pytest.mark.slow
def test_float8_training_at_mp2_dp2_sequence_parallel_equals_world_1(trained, check_close):
    """CI's case: tensor parallelism with sequence parallelism, FSDP over dp and gradient
    accumulation at once, tensorwise (whose amaxes the layouts reduce most); every other layout
    and recipe is the extended tier's (the next test)."""
    _check_debug(trained, check_close, [CI])


@pytest.mark.slow
def test_float8_training_at_every_layout_equals_world_1(trained, check_close):
    _check_debug(trained, check_close, [(r, layout) for r in RECIPES for layout in LAYOUTS
                                        if layout != "world1" and (r, layout) != CI])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "pp2-ep2"])
def test_float8_with_experts_equals_world_1(trained, check_close, layout):
    """The tiny Llama 4, tensorwise: float8 in its dense linears, the routed experts in fp32."""
    _check_debug(trained, check_close, [("tensorwise", layout)], "debug_llama4")


@pytest.mark.slow
def test_float8_with_experts_at_mp2_equals_world_1_as_without_ep(trained, check_close):
    """ep 2 x mp 2 (sequence parallel), tensorwise: step 1's gradients within GRAD_BOUND of world 1's.
    Its step-5 loss is 1.2e-4 from world 1's, as mp 2 alone at ep 1 is (float8's avalanche from the
    row-parallel partial sums, the module's docstring; near-tied routing carries it on): ep 2 adds
    nothing, every loss within 1e-5 of mp 2's at ep 1."""
    shape, world1 = "debug_llama4", trained("debug_llama4", "tensorwise", "world1")
    run, mp2 = (trained(shape, "tensorwise", layout) for layout in ("ep2-mp2-sequence_parallel", "mp2-sequence_parallel-ep1"))
    losses, grads = _errors(run, world1)
    _print(shape, "tensorwise", "ep2-mp2-sequence_parallel", losses, grads)
    check_close("float8 ep 2 x mp 2 vs world 1, step 1's gradients", grads, GRAD_BOUND)
    check_close("float8 ep 2 x mp 2 vs mp 2 at ep 1, losses", _errors(run, mp2)[0], 1e-5)


@pytest.mark.slow
def test_float8_training_at_the_issues_shape(trained, check_close):
    """The tiny preset at seq 512, 20 steps, every layout and recipe: step 1's loss within 1e-4, and
    pp 2's step-1 gradients within 1e-6 (its sums round as world 1's); each error printed."""
    losses, grads = {}, {}
    for recipe in RECIPES:
        for layout in LAYOUTS:
            if layout != "world1":
                run_losses, run_grads = _errors(trained("tiny-512", recipe, layout), trained("tiny-512", recipe, "world1"))
                _print("tiny-512", recipe, layout, run_losses, run_grads)
                losses[f"{recipe} {layout} loss step 1"] = run_losses["loss step 1"]
                if layout == "pp2":
                    grads.update({f"{recipe} {layout} {k}": v for k, v in run_grads.items()})
    check_close("float8 tiny preset at seq 512, step 1's losses", losses, LOSS_BOUND)
    check_close("float8 tiny preset at seq 512, pp 2's step-1 gradients", grads, 1e-6)
