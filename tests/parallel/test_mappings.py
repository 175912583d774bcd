"""Region functions (copy / reduce / scatter / gather, and sequence parallelism's gather / reduce-scatter /
scatter of the tokens, dim 0) against single-process math.

Every rank draws its own input and its own upstream gradient from a seed that depends on its global
rank, so each rank can rebuild what every member of its model-parallel group holds and compute the
exact answer locally. Values are small integers stored as floats: every sum is exact, so results
must match bit for bit (bound 0).
"""

import pytest
import torch

from tests.distributed import parallel_dims, rel_err

SHAPES = [(5, 12), (2, 3, 4, 8)]  # 2-D and 4-D; the last dim divides mp = 1, 2 and 4
SEQ_SHAPES = [(12, 3), (8, 2, 4)]  # [tokens, ...]: the tokens divide mp = 1, 2 and 4


def _draw(seed: int, shape: tuple, strided: bool) -> torch.Tensor:
    """Integer-valued float tensor of `shape`; with `strided`, a non-contiguous (dims-reversed) view."""
    gen = torch.Generator().manual_seed(seed)
    if not strided:
        return torch.randint(-8, 9, shape, generator=gen).float()
    t = torch.randint(-8, 9, shape[::-1], generator=gen).float().permute(*reversed(range(len(shape))))
    assert not t.is_contiguous()
    return t


def _expected(name: str, xs: list, grads: list, me: int, mp: int):
    """(forward output, input gradient) of region `name` on group member `me`.

    xs[j] / grads[j] are member j's input and upstream gradient.
    """
    if name == "copy":  # identity; gradient summed over the group
        return xs[me], sum(grads)
    if name == "reduce":  # sum over the group; gradient passes through
        return sum(xs), grads[me]
    if name == "scatter":  # my chunk of the last dim; gradient is every member's chunk concatenated
        return xs[me].chunk(mp, dim=-1)[me], torch.cat(grads, dim=-1)
    if name == "gather_seq":  # every member's part of the tokens; gradient: my part of the sum
        return torch.cat(xs, dim=0), sum(grads).chunk(mp, dim=0)[me]
    if name == "reduce_scatter_seq":  # my part of the tokens of the sum; gradient: all parts
        return sum(xs).chunk(mp, dim=0)[me], torch.cat(grads, dim=0)
    if name == "scatter_seq":  # my part of the tokens; gradient: every member's part
        return xs[me].chunk(mp, dim=0)[me], torch.cat(grads, dim=0)
    # gather: concatenation along the last dim; gradient is my chunk of the upstream gradient
    return torch.cat(xs, dim=-1), grads[me].chunk(mp, dim=-1)[me]


def _case_regions(mp: int, dp_shard: int = -1, dp_replicate: int = 1) -> dict:
    import hybridpar.parallel as P

    parallel = parallel_dims(mp, dp_shard, dp_replicate)
    me, rank = parallel.mp_rank, parallel.rank
    members = [rank - me + j for j in range(mp)]  # the mesh contract: an mp group is mp contiguous ranks
    functions = {
        "copy": P.copy_to_region,
        "reduce": P.reduce_from_region,
        "scatter": P.scatter_to_region,
        "gather": P.gather_from_region,
        "gather_seq": P.gather_from_sequence_region,
        "reduce_scatter_seq": P.reduce_scatter_to_sequence_region,
        "scatter_seq": P.scatter_to_sequence_region,
    }
    errors: dict = {}
    for shape_no, (full, seq_full) in enumerate(zip(SHAPES, SEQ_SHAPES)):
        part = (*full[:-1], full[-1] // mp)
        seq_part = (seq_full[0] // mp, *seq_full[1:])
        in_out = {"copy": (full, full), "reduce": (full, full), "scatter": (full, part), "gather": (part, full),
                  "gather_seq": (seq_part, seq_full), "reduce_scatter_seq": (seq_full, seq_part),
                  "scatter_seq": (seq_full, seq_part)}
        for strided in (False, True):
            for fn_no, (name, fn) in enumerate(functions.items()):
                in_shape, out_shape = in_out[name]
                seed = 10_000 * fn_no + 1_000 * shape_no + 100 * strided
                xs = [_draw(seed + r, in_shape, strided) for r in members]
                grads = [_draw(seed + 50 + r, out_shape, strided) for r in members]
                want_out, want_grad = _expected(name, xs, grads, me, mp)

                x = xs[me].clone().requires_grad_()
                upstream = grads[me].clone()
                out = fn(x, parallel.mp_group)
                out.backward(upstream)

                where = f"{name} {in_shape} strided={strided}"
                assert out.dtype == x.dtype, where
                assert torch.equal(x.detach(), xs[me]) and torch.equal(upstream, grads[me]), f"{where}: modified in place"
                for key, err in ((f"{name} forward", rel_err(out, want_out)), (f"{name} backward", rel_err(x.grad, want_grad))):
                    errors[key] = max(errors.get(key, 0.0), err)
    return errors


@pytest.mark.parametrize("mp", [1, 2, 4])
def test_regions_match_single_process_math(workers, check_close, mp):
    # mp = 1: a group of one rank, where every region must be the identity.
    check_close(f"mp{mp}", workers(4).run(_case_regions, mp), 0.0)


def test_regions_with_several_mp_groups(workers, check_close):
    # Four mp groups of two ranks, each with its own data: a collective over the wrong group shows up.
    check_close("mp2 dp_shard2 dp_replicate2", workers(8).run(_case_regions, 2, 2, 2), 0.0)


def _case_scatter_indivisible(mp: int) -> str:
    import hybridpar.parallel as P

    parallel = parallel_dims(mp)
    with pytest.raises(ValueError) as info:
        P.scatter_to_region(torch.zeros(3, mp + 1), parallel.mp_group)
    # Nothing was left half-done: the group still works.
    ones = P.gather_from_region(torch.ones(2, 1), parallel.mp_group)
    assert torch.equal(ones, torch.ones(2, mp))
    return str(info.value)


@pytest.mark.parametrize("mp", [2, 4])
def test_scatter_rejects_indivisible_last_dim(workers, mp):
    for message in workers(4).run(_case_scatter_indivisible, mp):
        assert "not divisible" in message and str(mp + 1) in message and str(mp) in message, message


def _case_sequence_indivisible(mp: int) -> list[str]:
    import hybridpar.parallel as P

    parallel = parallel_dims(mp)
    messages = []
    for fn in (P.reduce_scatter_to_sequence_region, P.scatter_to_sequence_region):
        with pytest.raises(ValueError) as info:
            fn(torch.zeros(mp + 1, 4), parallel.mp_group)
        messages.append(str(info.value))
    ones = P.gather_from_sequence_region(torch.ones(1, 3), parallel.mp_group)  # the group still works
    assert torch.equal(ones, torch.ones(mp, 3))
    return messages


@pytest.mark.parametrize("mp", [2, 4])
def test_sequence_regions_reject_a_sequence_mp_does_not_divide(workers, mp):
    for messages in workers(4).run(_case_sequence_indivisible, mp):
        for message in messages:
            assert f"{mp + 1} tokens (batch x sequence length) are not divisible by the model-parallel size mp = {mp}" \
                in message, message
            assert "parallel.sequence_parallel = false" in message
