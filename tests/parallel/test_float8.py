"""Float8 in hybridpar's tensor-parallel linears (hybridpar.parallel.float8), emulated on the CPU:
at world 1 equal to torchao's own Float8Linear; at mp 2 (with and without sequence parallelism)
and cp 2 x mp 2 equal to world 1, every scale the unsplit tensor's; without the amax reduction
they would not be."""

import dataclasses

import pytest
import torch

from tests.distributed import parallel_dims, rel_err

# Each worker imports torchao (torch._dynamo with it: seconds of CPU a rank) for the first case.
pytestmark = pytest.mark.slow

BOUND = 1e-6
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
D_IN, D_OUT, BATCH, SEQ = 64, 96, 2, 16  # per-rank slices at mp 2 stay multiples of 16
SPREAD = 1e-4  # the ratio of the halves' magnitudes (_case_layout)


def _layer(kind: str, parallel, recipe: str, *, sequence_parallel: bool = False, reduce: bool = True,
           spread: float = 1.0):
    """A float8 Column/Row-parallel linear with the full weights of seed 0 (any layout), the second half
    of its split dimension scaled by 1 / spread; reduce=False: its amaxes left unreduced (the check
    that the test can fail)."""
    from hybridpar.config.low_precision import Float8Config
    from hybridpar.parallel import ColumnParallelLinear, RowParallelLinear
    from hybridpar.parallel.float8 import convert_to_float8

    torch.manual_seed(0)
    if kind == "column":
        layer = ColumnParallelLinear(D_IN, D_OUT, bias=True, gather_output=False, parallel=parallel,
                                     sequence_parallel=sequence_parallel)
        with torch.no_grad():  # a zero bias would hide bias bugs; the same full bias at any mp
            layer.bias.to_local().copy_(torch.randn(D_OUT).chunk(parallel.mp)[parallel.mp_rank])
    else:
        layer = RowParallelLinear(D_IN, D_OUT, bias=False, input_is_parallel=True, parallel=parallel,
                                  sequence_parallel=sequence_parallel)
    full = layer.weight.full_tensor().detach().clone()
    if kind == "column":
        full[D_OUT // 2:] /= spread
    else:
        full[:, D_IN // 2:] /= spread
    with torch.no_grad():
        layer.weight.to_local().copy_(full.chunk(parallel.mp, dim=0 if kind == "column" else 1)[parallel.mp_rank])
    assert convert_to_float8(torch.nn.ModuleDict({"layer": layer}), parallel, Float8Config(recipe=recipe),
                             device=torch.device("cpu")) == ["layer"]
    if not reduce:
        casts = {name: cast and dataclasses.replace(cast, groups=()) for name, cast in layer.float8.casts.items()}
        layer.float8 = dataclasses.replace(layer.float8, casts=casts)
    return layer


def _case_against_torchao(recipe: str, dtype_name: str) -> dict:
    """World 1: hybridpar's float8 layers and torchao's Float8Linear (convert_to_float8_training,
    emulated) on the same weights, inputs and output gradients."""
    from hybridpar.parallel.float8 import recipe_config, torchao_float8

    parallel, dtype = parallel_dims(mp=1), getattr(torch, dtype_name)
    errors = {}
    for kind in ("column", "row"):
        layer = _layer(kind, parallel, recipe).to(dtype)
        reference = torch.nn.Sequential(torch.nn.Linear(D_IN, D_OUT, bias=layer.bias is not None, dtype=dtype))
        with torch.no_grad():
            reference[0].weight.copy_(layer.weight.full_tensor())
            if layer.bias is not None:
                reference[0].bias.copy_(layer.bias.full_tensor())
        torchao_float8().convert_to_float8_training(reference, config=recipe_config(recipe, emulate=True))
        assert type(reference[0]).__name__ == "Float8Linear"
        torch.manual_seed(1)
        x, grad = torch.randn(BATCH, SEQ, D_IN, dtype=dtype), torch.randn(BATCH, SEQ, D_OUT, dtype=dtype)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = layer(ours), reference(theirs)
        out.backward(grad)
        expected.backward(grad)
        errors[f"{kind} output"] = rel_err(out, expected)
        errors[f"{kind} input_grad"] = rel_err(ours.grad, theirs.grad)
        errors[f"{kind} weight_grad"] = rel_err(layer.weight.grad.full_tensor(), reference[0].weight.grad)
        if layer.bias is not None:
            errors[f"{kind} bias_grad"] = rel_err(layer.bias.grad.full_tensor(), reference[0].bias.grad)
        # Not high precision in disguise: float8's rounding shows against the fp32 linear.
        errors[f"{kind} differs from high precision"] = float(
            rel_err(expected, torch.nn.functional.linear(x, reference[0].weight, reference[0].bias)) > 1e-2)
    return errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_layers_equal_torchaos_float8_linear(workers, check_close, recipe, dtype):
    results = workers(4).run(_case_against_torchao, recipe, dtype)
    for rank_errors in results:
        assert all(rank_errors.pop(f"{kind} differs from high precision") == 1.0 for kind in ("column", "row"))
    check_close(f"{recipe} {dtype} vs torchao", results, BOUND)


def _parts(t: torch.Tensor, parallel, sequence_parallel: bool) -> torch.Tensor:
    """This rank's tokens of t [batch, seq, dim]: its cp share of each sequence, then (sequence
    parallelism) its mp part of those tokens flattened."""
    t = t.chunk(parallel.cp, dim=1)[parallel.cp_rank]
    return t.flatten(0, 1).chunk(parallel.mp, dim=0)[parallel.mp_rank] if sequence_parallel else t


def _case_layout(recipe: str, mp: int, cp: int, sequence_parallel: bool, reduce: bool = True,
                 spread: float = SPREAD) -> dict:
    """Each layer at (mp, cp) against the same layer at world 1 on the whole batch: the outputs and
    the input, weight and bias gradients of this rank's slices (weight gradients summed over cp)."""
    import torch.distributed as dist

    parallel, single = parallel_dims(mp=mp, cp=cp), parallel_dims(mp=1)
    torch.manual_seed(1)
    x, grad = torch.randn(BATCH, SEQ, D_IN), torch.randn(BATCH, SEQ, D_OUT)
    # Halves of a wide range across each split (the second mp rank's features, the second cp rank's
    # tokens), the weights' alike (_layer): a rowwise scale, a power of 2, changes the float8 values
    # only where they fall below e4m3's normal range, which these reach.
    x[..., D_IN // 2:] *= spread
    grad[..., D_OUT // 2:] *= spread
    x[:, SEQ // 2:] *= spread
    grad[:, SEQ // 2:] /= spread
    errors, mp_rank, sp = {}, parallel.mp_rank, sequence_parallel
    for kind in ("column", "row"):
        reference = _layer(kind, single, recipe, spread=spread)
        layer = _layer(kind, parallel, recipe, sequence_parallel=sp, reduce=reduce, spread=spread)
        # The column-parallel layer reads the whole input and writes its out-features' slice; the
        # row-parallel one reads its in-features' slice (input_is_parallel) and writes the whole output.
        column = kind == "column"
        mine_in = (lambda t: t) if column else (lambda t: t.chunk(mp, dim=-1)[mp_rank])
        mine_out = (lambda t: t.chunk(mp, dim=-1)[mp_rank]) if column else (lambda t: t)
        x_ref = x.clone().requires_grad_()
        expected = reference(x_ref)
        expected.backward(grad)
        x_in = mine_in(_parts(x, parallel, sp and column)).clone().requires_grad_()
        out = layer(x_in)
        # Column-parallel under sequence parallelism gathers the tokens: its output holds all of them.
        out_tokens = _parts(expected.detach(), parallel, sp and not column)
        out.backward(mine_out(_parts(grad, parallel, sp and not column)).reshape(out.shape))
        errors[f"{kind} output"] = rel_err(out.reshape(-1, out.shape[-1]),
                                           mine_out(out_tokens).reshape(-1, out.shape[-1]))
        errors[f"{kind} input_grad"] = rel_err(x_in.grad, mine_in(_parts(x_ref.grad, parallel, sp and column)))
        for name in ("weight", "bias"):
            param = getattr(layer, name)
            if param is None:
                continue
            local = param.grad.to_local().clone()
            if parallel.cp > 1:  # each cp rank's share of the tokens: their sum is the whole batch's
                dist.all_reduce(local, group=parallel.cp_group)
            shard_dim = 0 if column else 1
            full = getattr(reference, name).grad.to_local()  # world 1: the whole tensor
            errors[f"{kind} {name}_grad"] = rel_err(local, full.chunk(mp, dim=min(shard_dim, full.dim() - 1))[mp_rank])
    return errors


LAYOUTS = [(2, 1, False), (2, 1, True), (2, 2, True), (1, 2, False)]  # (mp, cp, sequence_parallel)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("mp,cp,sp", LAYOUTS, ids=[f"mp{m}-cp{c}{'-sp' if s else ''}" for m, c, s in LAYOUTS])
def test_float8_at_any_layout_equals_world_1(workers, check_close, recipe, mp, cp, sp):
    results = workers(4).run(_case_layout, recipe, mp, cp, sp)
    check_close(f"{recipe} mp{mp} cp{cp}{' sp' if sp else ''} vs world 1", results, BOUND)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mp,cp,sp", [(2, 1, True), (1, 2, False)], ids=["mp2-sp", "cp2"])
def test_without_the_amax_reduction_the_layouts_differ(workers, recipe, mp, cp, sp):
    """The check above can fail: the same layers with each rank's own amax (its slice's) drift from
    world 1 far beyond the bound."""
    worst = max(max(errors.values()) for errors in workers(4).run(_case_layout, recipe, mp, cp, sp, reduce=False))
    print(f"{recipe} mp{mp} cp{cp}: worst relative error without the amax reduction {worst:.2e}")
    assert worst > 100 * BOUND


def _case_build(recipe: str, preset: str = "tiny") -> dict:
    """build_model with and without float8 at mp 2 x dp 2 (FSDP, sequence parallelism, full AC): the
    linears it converts, the state_dicts, one forward and backward, the notes it logs. The tiny
    preset cut to 2 layers, or `preset` whole."""
    import logging

    from hybridpar.build import build_model
    from hybridpar.config.low_precision import Float8Config
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.models.args import ModelArgs

    parallel = parallel_dims(mp=2)
    args = ModelArgs.from_preset("tiny", n_layers=2) if preset == "tiny" else ModelArgs.from_preset(preset)
    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("hybridpar").addHandler(handler)
    models, losses = {}, {}
    try:
        for name, float8 in (("high", None), ("float8", Float8Config(recipe=recipe))):
            torch.manual_seed(0)
            models[name] = build_model(args, parallel, fsdp=FSDPConfig(activation_checkpointing="full"),
                                       sequence_parallel=True, float8=float8)
            torch.manual_seed(1)
            loss = models[name](torch.randint(0, args.vocab_size, (2, 32))).float().pow(2).mean()
            loss.backward()
            losses[name] = loss.item()
    finally:
        logging.getLogger("hybridpar").removeHandler(handler)
    high, low = (m.state_dict() for m in models.values())
    return {
        "converted": sorted(n for n, m in models["float8"].named_modules() if getattr(m, "float8", None) is not None),
        "same state": list(high) == list(low) and all(
            high[k].dtype == low[k].dtype and torch.equal(high[k].full_tensor(), low[k].full_tensor()) for k in high),
        "float8 dtypes": sorted({str(v.dtype) for v in low.values() if "float8" in str(v.dtype)}),
        "losses": losses, "grads finite": all(p.grad.full_tensor().isfinite().all().item()
                                              for p in models["float8"].parameters()),
        "notes": [n for n in notes if "float8" in n],
    }


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_build_model_converts_the_linears_and_keeps_the_state(workers, recipe):
    results = workers(4).run(_case_build, recipe)
    linears = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
               "feed_forward.w2", "feed_forward.w3"]
    expected = sorted(f"layers.{i}.{name}" for i in range(2) for name in linears)  # the output head skipped
    for rank, result in enumerate(results):
        assert result["converted"] == expected, result["converted"]
        assert result["same state"] and result["float8 dtypes"] == [] and result["grads finite"]
        high, low = result["losses"]["high"], result["losses"]["float8"]
        assert high != low and abs(low - high) < 0.1 * abs(high), result["losses"]  # float8, near high precision
        assert result["notes"] == (["float8: no CUDA device here (cpu), so torchao emulates the float8 matmuls in "
                                    "fp32: float8's numbers, slower than bf16"] if rank == 0 else []), result["notes"]


def test_float8_leaves_the_routed_experts_in_high_precision(workers):
    """Llama 4 (issue 52): float8 in attention's, the dense layers' and the shared experts' linears;
    the routed experts (grouped GEMMs) and the router in high precision, which rank 0 says once."""
    results = workers(4).run(_case_build, "tensorwise", "debug_llama4")
    dense = {0: "feed_forward", 2: "feed_forward", 1: "feed_forward.shared_expert", 3: "feed_forward.shared_expert"}
    expected = sorted([f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wk", "wv", "wo")]
                      + [f"layers.{i}.{ffn}.{w}" for i, ffn in dense.items() for w in ("w1", "w2", "w3")])
    for rank, result in enumerate(results):
        assert result["converted"] == expected, result["converted"]
        assert result["same state"] and result["grads finite"]
        assert result["notes"][1:] == (["float8: the 4 routed experts and their router stay in high precision "
                                        "(fsdp.param_dtype); float8 runs in the linears of attention, the shared "
                                        "experts and the dense feed-forward layers"] if rank == 0 else []), result["notes"]


def _case_skip(mp: int, skip: list) -> list:
    from hybridpar.config.low_precision import Float8Config
    from hybridpar.parallel import ColumnParallelLinear, RowParallelLinear
    from hybridpar.parallel.float8 import convert_to_float8

    parallel = parallel_dims(mp=mp)
    layers = {"layers.0.wq": ColumnParallelLinear(64, 96, parallel=parallel),  # 48 per rank at mp 2
              "layers.1.wq": ColumnParallelLinear(64, 32, parallel=parallel),  # 16 per rank at mp 2
              "layers.1.w2": RowParallelLinear(64, 32, parallel=parallel),
              "small": ColumnParallelLinear(24, 32, parallel=parallel),  # 24 in-features at any mp
              "output": ColumnParallelLinear(64, 64, parallel=parallel)}
    model = torch.nn.Module()
    for name, layer in layers.items():  # nested under their dotted names, as a model's modules are
        parent = model
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(name.split(".")[-1], layer)
    return convert_to_float8(model, parallel, Float8Config(recipe="rowwise", skip=skip), device=torch.device("cpu"))


@pytest.mark.parametrize("mp,skip,converted", [
    (1, ["output"], ["layers.0.wq", "layers.1.wq", "layers.1.w2"]),  # the default: the head, and "small"
    (2, ["output"], ["layers.0.wq", "layers.1.wq", "layers.1.w2"]),  # 48 and 16 per rank: multiples of 16
    (4, ["output"], ["layers.1.w2"]),  # the wq: 24 and 8 outputs per rank
    (1, ["wq", "layers.1.*"], ["output"]),  # names' ends and patterns
    (1, [], ["layers.0.wq", "layers.1.wq", "layers.1.w2", "output"]),
])
def test_which_linears_stay_in_high_precision(workers, mp, skip, converted):
    assert workers(4).run(_case_skip, mp, skip) == [converted] * 4


def _case_model(recipe: str, mp: int, sequence_parallel: bool) -> dict:
    """The debug Llama in float8 at mp (every linear but the head converted) against the same in float8
    at mp 1 on the same full weights: logits, loss and every gradient."""
    from hybridpar.config.low_precision import Float8Config
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from hybridpar.parallel.float8 import convert_to_float8
    from hybridpar.parallel.state import full_state_dict, load_full_state_dict
    from tests.models.test_llama import _batch, _forward_backward

    args, p1, pn = ModelArgs.from_preset("debug"), parallel_dims(mp=1), parallel_dims(mp=mp)
    torch.manual_seed(0)
    reference = Transformer(args, p1)
    model = Transformer(args, pn, sequence_parallel=sequence_parallel)
    load_full_state_dict(model, full_state_dict(reference))
    config, cpu = Float8Config(recipe=recipe), torch.device("cpu")
    assert convert_to_float8(reference, p1, config, device=cpu) == convert_to_float8(model, pn, config, device=cpu)
    inputs, targets = _batch(args)
    ref_logits, ref_loss, ref_grads = _forward_backward(reference, inputs, targets, p1)
    logits, loss, grads = _forward_backward(model, inputs, targets, pn)
    errors = {"local_logits": rel_err(logits, ref_logits.chunk(mp, dim=-1)[pn.mp_rank]), "loss": rel_err(loss, ref_loss)}
    errors.update({f"grad.{name}": rel_err(grad, ref_grads[name]) for name, grad in grads.items()})
    return errors


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mp,sp", [(2, False), (2, True), (4, True)], ids=["mp2", "mp2-sp", "mp4-sp"])
def test_the_float8_model_at_mp_equals_mp_1(workers, check_close, recipe, mp, sp):
    check_close(f"float8 {recipe} debug model mp{mp}{' sp' if sp else ''} vs mp 1", workers(4).run(_case_model, recipe, mp, sp),
                1e-5)
