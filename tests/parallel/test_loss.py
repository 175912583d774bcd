"""vocab_parallel_cross_entropy against F.cross_entropy on the full (never split) logits.

Every rank of a model-parallel group builds the same full logits (seeded by its data-parallel rank,
so different groups hold different data), feeds its vocabulary shard to the parallel loss, and
compares the loss and its shard of the logits gradient with single-process fp32 F.cross_entropy.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import parallel_dims, rel_err

VOCAB = 16
SHAPE = (3, 5)  # [batch, seq]: the logits are [batch, seq, vocab]
IGNORES = [-100, -1, VOCAB - 1]  # the default, a custom negative value, and a real id in the last shard
FP32_BOUND = 1e-6
BF16_GRAD_BOUND = 1e-2  # bf16 keeps 8 bits of mantissa: about 4e-3 relative rounding per element
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(seed: int, ignore_index: int, extreme: bool = False, vocab: int = VOCAB):
    """Full fp32 logits [*SHAPE, vocab], targets with two ignored positions, and an upstream weight."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*SHAPE, vocab, generator=gen)
    target = torch.randint(0, vocab, SHAPE, generator=gen)
    target[1, :4] = torch.arange(4) * (vocab // 4) + 1  # a real target in each shard at mp = 4
    target[0, 1] = target[2, 3] = ignore_index
    if extreme:
        # Per-token offsets up to +-3e4, a token spread over +-1e4, a target logit 1e4 above the rest,
        # and a max far above the target in another shard: exp() overflows without the max shift.
        logits += torch.tensor([1e4, -1e4, 0.0, 3e4, -3e4]).view(1, SHAPE[1], 1)  # one offset per position
        logits[0, 0] = 1e4 * torch.randn(vocab, generator=gen)
        logits[1, 2, target[1, 2]] += 1e4
        target[1, 3] = 0
        logits[1, 3, vocab - 1] += 1e4
    weight = torch.rand(SHAPE, generator=gen) + 0.5  # upstream gradient for reduction="none"
    return logits, target, weight


def _errors(full, target, ignore_index, reduction, weight, mp=1, mp_rank=0, **where) -> dict:
    """Relative errors of the parallel loss on this rank's shard of `full` against the fp32 reference.

    `full` may be bf16: the reference sees the same values upcast to fp32. `where` is parallel= or
    group= (or nothing). Asserts the dtype contract: fp32 loss, gradient in the logits' dtype.
    """
    from hybridpar.parallel import vocab_parallel_cross_entropy

    upstream = weight if reduction == "none" else torch.tensor(0.7)
    ref_logits = full.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction=reduction)
    ref = ref.view(target.shape) if reduction == "none" else ref
    (ref * upstream).sum().backward()

    local = full.chunk(mp, dim=-1)[mp_rank].detach().clone().requires_grad_()
    kwargs = {} if ignore_index == -100 else {"ignore_index": ignore_index}  # -100 through the default
    loss = vocab_parallel_cross_entropy(local, target, reduction=reduction, **kwargs, **where)
    (loss * upstream).sum().backward()

    assert loss.dtype == torch.float32 and local.grad.dtype == full.dtype, (loss.dtype, local.grad.dtype)
    assert torch.isfinite(loss).all() and torch.isfinite(local.grad).all()
    return {"loss": rel_err(loss, ref), "grad": rel_err(local.grad, ref_logits.grad.chunk(mp, dim=-1)[mp_rank])}


def _worst(into: dict, errors: dict, suffix: str = "") -> None:
    for name, err in errors.items():
        into[name + suffix] = max(into.get(name + suffix, 0.0), err)


def _case_matches_reference(mp: int, dtype: str, reduction: str) -> dict:
    parallel = parallel_dims(mp)
    worst: dict = {}
    for variant, extreme in (("", False), (" extreme", True)):
        for i, ignore_index in enumerate(IGNORES):
            full, target, weight = _inputs(100 * parallel.dp_rank + 10 * i + extreme, ignore_index, extreme)
            errors = _errors(full.to(DTYPES[dtype]), target, ignore_index, reduction, weight, mp, parallel.mp_rank, parallel=parallel)
            _worst(worst, errors, variant)
    return worst


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mp", [1, 2, 4])
def test_matches_cross_entropy_on_full_logits(workers, check_close, mp, dtype, reduction):
    results = workers(4).run(_case_matches_reference, mp, dtype, reduction)
    label = f"mp{mp} {dtype} {reduction}"
    # The loss is fp32 arithmetic whatever the logits' dtype; a bf16 gradient carries bf16 rounding.
    check_close(label, [{k: v for k, v in r.items() if k.startswith("loss")} for r in results], FP32_BOUND)
    grad_bound = FP32_BOUND if dtype == "fp32" else BF16_GRAD_BOUND
    check_close(label, [{k: v for k, v in r.items() if k.startswith("grad")} for r in results], grad_bound)


def _case_banned_token(mp: int) -> dict:
    parallel = parallel_dims(mp)
    worst: dict = {}
    for i, ignore_index in enumerate(IGNORES):
        full, target, weight = _inputs(100 * parallel.dp_rank + i, ignore_index)
        full[..., 0] = float("-inf")  # token 0 masked out, as when banning a pad or special token
        target[target == 0] = 1
        _worst(worst, _errors(full, target, ignore_index, "mean", weight, mp, parallel.mp_rank, parallel=parallel))
    return worst


@pytest.mark.parametrize("mp", [2, 4])
def test_minus_inf_logits_of_a_banned_token(workers, check_close, mp):
    check_close(f"mp{mp} -inf", workers(4).run(_case_banned_token, mp), FP32_BOUND)


def _case_all_ignored(mp: int) -> None:
    from hybridpar.parallel import vocab_parallel_cross_entropy

    parallel = parallel_dims(mp)
    torch.manual_seed(mp)
    for ignore_index in IGNORES:
        local = torch.randn(*SHAPE, VOCAB // mp, requires_grad=True)
        target = torch.full(SHAPE, ignore_index)
        kwargs = {} if ignore_index == -100 else {"ignore_index": ignore_index}
        for reduction in ("mean", "sum", "none"):
            local.grad = None
            loss = vocab_parallel_cross_entropy(local, target, parallel=parallel, reduction=reduction, **kwargs)
            loss.sum().backward()
            assert torch.equal(loss, torch.zeros_like(loss)), (ignore_index, reduction, loss)
            assert torch.equal(local.grad, torch.zeros_like(local)), (ignore_index, reduction)


@pytest.mark.parametrize("mp", [1, 2, 4])
def test_all_targets_ignored_gives_zero_loss_and_grad(workers, mp):
    workers(4).run(_case_all_ignored, mp)


# Every collective that could move the logits; only all_reduce is allowed, and only of [tokens] sizes.
_MOVERS = (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "gather", "broadcast",
    "scatter", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv",
)


@contextlib.contextmanager
def _watch_collectives():
    """Yield the list of shapes passed to all_reduce; any other collective raises."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    shapes: list = []
    real_all_reduce = c10d.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return real_all_reduce(tensor, *args, **kwargs)

    def forbidden(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"vocab_parallel_cross_entropy called dist.{name}")

        return fail

    saved = []
    for module in (dist, c10d):
        for name in ("all_reduce",) + _MOVERS:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, all_reduce if name == "all_reduce" else forbidden(name))
    try:
        yield shapes
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _case_collective_sizes(mp: int, vocab: int) -> list:
    from hybridpar.parallel import vocab_parallel_cross_entropy

    parallel = parallel_dims(mp)
    full, target, _ = _inputs(7, -100, vocab=vocab)
    local = full.chunk(mp, dim=-1)[parallel.mp_rank].clone().requires_grad_()
    with _watch_collectives() as shapes:
        vocab_parallel_cross_entropy(local, target, parallel=parallel).backward()
    return shapes


@pytest.mark.parametrize("mp", [2, 4])
def test_full_logits_are_never_gathered(workers, mp):
    vocab = 256
    tokens = SHAPE[0] * SHAPE[1]
    for shapes in workers(4).run(_case_collective_sizes, mp, vocab):
        assert shapes, "no all_reduce seen: the watcher is not hooked in"
        sizes = [torch.Size(s).numel() for s in shapes]
        # At most [2, tokens] (two sums stacked); a local shard alone is tokens * vocab / mp elements.
        assert max(sizes) <= 2 * tokens < tokens * vocab // mp, shapes


def test_shape_mismatch_and_bad_reduction_are_clear_errors():
    from hybridpar.parallel import vocab_parallel_cross_entropy

    logits = torch.randn(*SHAPE, VOCAB)
    for target in (torch.zeros(SHAPE[0], SHAPE[1] - 1, dtype=torch.long), torch.zeros(SHAPE[0] * SHAPE[1], dtype=torch.long)):
        with pytest.raises(ValueError, match=r"logits \(3, 5, 16\) and target .* disagree"):
            vocab_parallel_cross_entropy(logits, target)
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(logits, torch.zeros(SHAPE, dtype=torch.long), reduction="avg")


def _case_without_group() -> str:
    from hybridpar.parallel import vocab_parallel_cross_entropy

    with pytest.raises(ValueError) as info:
        vocab_parallel_cross_entropy(torch.zeros(*SHAPE, VOCAB // 4), torch.zeros(SHAPE, dtype=torch.long))
    return str(info.value)


def test_multi_process_job_without_group_is_a_clear_error(workers):
    for message in workers(4).run(_case_without_group):
        assert "parallel=" in message and "group=" in message, message


def _full_logits_errors(**where) -> dict:
    """Full logits (mp = 1) in every reduction and with each ignore index."""
    worst: dict = {}
    for i, ignore_index in enumerate(IGNORES):
        for reduction in ("mean", "sum", "none"):
            full, target, weight = _inputs(i, ignore_index)
            _worst(worst, _errors(full, target, ignore_index, reduction, weight, **where), f" {reduction}")
    return worst


def _case_world_of_one() -> dict:
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == 1
    worst: dict = {}
    for label, where in (("no group", {}), ("group=WORLD", {"group": dist.group.WORLD}), ("parallel", {"parallel": parallel_dims(1)})):
        _worst(worst, _full_logits_errors(**where), f" ({label})")
    return worst


def test_world_of_one_process_works_on_full_logits(workers, check_close):
    check_close("world 1", workers(1).run(_case_world_of_one), FP32_BOUND)


def test_no_process_group_works_on_full_logits(check_close):
    import torch.distributed as dist

    assert not dist.is_initialized()  # the pytest process itself never joins a process group
    check_close("no process group", _full_logits_errors(), FP32_BOUND)
