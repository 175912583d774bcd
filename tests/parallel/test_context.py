"""Context parallelism's attention (hybridpar.parallel.context) against single-process causal attention.

Every rank of a cp group draws the same whole-sequence q, k, v and upstream gradient (seeded by its
group, so each group has its own problem), computes full causal attention and its gradients
locally, and compares its own chunks of them with what context_attention gives it. The cp groups
are the mesh's mp groups (cp contiguous ranks, two groups at cp 2): a collective over the wrong
group shows up.
"""

import pytest
import torch

from hybridpar.parallel.context import ContextParallelError, chunk_size, local_positions, shard_sequence
from tests.distributed import parallel_dims, rel_err

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8  # GQA: two q heads per kv head


def _group(cp: int):
    """A process group of cp contiguous ranks, standing in for the mesh's cp group."""
    return parallel_dims(mp=cp).mp_group


def _full_problem(seq_len: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq_len, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, seq_len, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, seq_len, KV_HEADS, HEAD_DIM, generator=gen)
    upstream = torch.randn(BATCH, seq_len, HEADS, HEAD_DIM, generator=gen)
    return q, k, v, upstream


def _full_causal(q, k, v):
    """The model's call: models/llama.py's Attention without a kv cache."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def _case_attention(cp: int, seq_lens: tuple, compiled: bool = False) -> dict:
    import torch.distributed as dist

    from hybridpar.parallel.context import context_attention

    if compiled:  # fullgraph: a graph break (one would drop the attention to eager) is an error
        torch._dynamo.reset()
        context_attention = torch.compile(context_attention, fullgraph=True)
    group = _group(cp)
    me = dist.get_rank(group)
    errors = {}
    for seq_len in seq_lens:
        full = _full_problem(seq_len, seed=1000 * seq_len + dist.get_rank() // cp)
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        want = _full_causal(*leaves)
        want.backward(full[3])

        local = [shard_sequence(t, cp, me).requires_grad_() for t in full[:3]]
        out = context_attention(*local, group)
        out.backward(shard_sequence(full[3], cp, me))
        errors[f"S{seq_len} out"] = rel_err(out, shard_sequence(want, cp, me))
        for name, mine, ref in zip("qkv", local, leaves):
            errors[f"S{seq_len} d{name}"] = rel_err(mine.grad, shard_sequence(ref.grad, cp, me))
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_and_its_gradients_match_full_causal_attention(workers, check_close, cp):
    # S = 2 cp: every chunk is one token; 64 and 256: longer chunks. fp32 throughout.
    check_close(f"cp{cp}", workers(4).run(_case_attention, cp, (2 * cp, 64, 256)), 1e-6)


def _case_bf16(cp: int, seq_len: int) -> dict:
    """Errors against float64 causal attention: this rank's cp part in bfloat16, and the model's
    own bfloat16 call (full causal SDPA) on the same tokens."""
    import torch.distributed as dist

    from hybridpar.parallel.context import context_attention

    group = _group(cp)
    me = dist.get_rank(group)
    full = _full_problem(seq_len, seed=11 + dist.get_rank() // cp)
    truth = [t.double().requires_grad_() for t in full[:3]]
    _full_causal(*truth).backward(full[3].double())
    plain = [t.bfloat16().requires_grad_() for t in full[:3]]
    plain_out = _full_causal(*plain)
    plain_out.backward(full[3].bfloat16())
    local = [shard_sequence(t.bfloat16(), cp, me).requires_grad_() for t in full[:3]]
    out = context_attention(*local, group)
    out.backward(shard_sequence(full[3].bfloat16(), cp, me))
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in local)
    mine = {"out": out, **{f"d{n}": t.grad for n, t in zip("qkv", local)}}
    model = {"out": plain_out, **{f"d{n}": t.grad for n, t in zip("qkv", plain)}}
    want = {"out": _full_causal(*(t.detach() for t in truth)), **{f"d{n}": t.grad for n, t in zip("qkv", truth)}}
    return {name: (rel_err(mine[name], shard_sequence(want[name], cp, me)),
                   rel_err(shard_sequence(model[name], cp, me), shard_sequence(want[name], cp, me))) for name in mine}


@pytest.mark.parametrize("cp", [2, 4])
def test_bfloat16_attention_is_as_exact_as_the_models_own_call(workers, cp):
    # bf16 in, bf16 out and gradients (the CPU kernel's backward refuses an fp32 output beside bf16
    # inputs); the error of the two-part merge is bf16 SDPA's own, within 25%.
    for rank, errors in enumerate(workers(4).run(_case_bf16, cp, 256)):
        print(f"rank {rank}: (cp, plain) errors vs float64 {errors}")
        for name, (mine, plain) in errors.items():
            assert mine <= 1.25 * plain + 1e-4, (rank, name, mine, plain)


@pytest.mark.slow
def test_compile_traces_the_attention_in_one_graph(workers, check_close):
    """torch.compile (a compiled block's attention) traces the all-gather and the causal masks whole."""
    check_close("cp2 compiled", workers(2).run(_case_attention, 2, (4, 64), True), 1e-6)


def test_cp1_is_plain_causal_attention(workers, check_close):
    # A group of one rank: the model's own SDPA call, bit for bit.
    check_close("cp1", workers(4).run(_case_attention, 1, (2, 64)), 0.0)
    # No cp group at all, in this process (no process group exists: a collective would raise).
    from hybridpar.parallel.context import context_attention

    q, k, v, _ = _full_problem(16, seed=3)
    assert torch.equal(context_attention(q, k, v, None), _full_causal(q, k, v))


def _case_layout(cp: int, seq_len: int) -> list:
    import torch.distributed as dist

    from hybridpar.parallel.context import gather_sequence

    group = _group(cp)
    me = dist.get_rank(group)
    x = torch.arange(seq_len).view(1, seq_len, 1).expand(2, seq_len, 3) + 1000 * torch.arange(2).view(2, 1, 1)
    part = shard_sequence(x, cp, me)
    # The positions name the tokens the rank holds: token t of the sequence carries the value t.
    assert torch.equal(part[0, :, 0], local_positions(seq_len, cp, me)), (part[0, :, 0], local_positions(seq_len, cp, me))
    assert torch.equal(gather_sequence(part, group), x)  # the inverse, along dim 1
    assert torch.equal(gather_sequence(part.transpose(0, 1), group, dim=0), x.transpose(0, 1))
    with pytest.raises(ContextParallelError, match="odd number"):  # raised before the collective, on every rank
        gather_sequence(part[:, :-1], group)
    return local_positions(seq_len, cp, me).tolist()


@pytest.mark.parametrize("cp", [2, 4])
def test_positions_agree_with_the_sharding_and_gather_inverts_it(workers, cp):
    for seq_len in (2 * cp, 24 * cp):
        per_rank = workers(4).run(_case_layout, cp, seq_len)
        c = seq_len // (2 * cp)
        for rank, positions in enumerate(per_rank[:cp]):
            # chunks rank and 2cp-1-rank, in that order
            want = [*range(rank * c, (rank + 1) * c), *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
            assert positions == want, (rank, positions, want)
        assert sorted(sum(per_rank[:cp], [])) == list(range(seq_len))


def _case_work(cp: int, seq_len: int) -> int:
    """(query, key) pairs this rank's context_attention hands to the attention kernel, per batch row
    and head: counted at the kernel (SDPA's CPU flash op, forward only), whichever way it is called."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridpar.parallel.context import context_attention

    counted = []

    class CountPairs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                query, key = args[0], args[1]
                causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
                mask = kwargs.get("attn_mask")
                lq, lk = query.shape[-2], key.shape[-2]
                if causal:  # the kernel's triangle is top-left: query i sees keys 0..i
                    assert mask is None
                    counted.append(sum(min(i + 1, lk) for i in range(lq)))
                elif mask is None:
                    counted.append(lq * lk)
                else:
                    counted.append(int((mask.bool() if mask.dtype == torch.bool else mask > float("-inf")).sum()))
            return func(*args, **kwargs)

    group = _group(cp)
    me = dist.get_rank(group)
    q, k, v, _ = _full_problem(seq_len, seed=7)
    with CountPairs():
        context_attention(*(shard_sequence(t, cp, me) for t in (q, k, v)), group)
    assert counted, "context_attention made no call to the attention kernel"
    return sum(counted)


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_does_the_same_causal_work(workers, cp):
    seq_len = 64
    pairs = workers(4).run(_case_work, cp, seq_len)
    print(f"cp {cp}: (query, key) pairs per rank {pairs}")
    assert len(set(pairs)) == 1, f"unbalanced causal work across ranks: {pairs}"
    # ... and together exactly the causal triangle: no pair twice, none left out
    assert sum(pairs[:cp]) == seq_len * (seq_len + 1) // 2, pairs


def test_a_sequence_2cp_does_not_divide_is_one_clear_error():
    for call in (lambda: chunk_size(10, 4), lambda: local_positions(10, 4, 0),
                 lambda: shard_sequence(torch.zeros(2, 10, 3), 4, 1)):
        with pytest.raises(ContextParallelError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and isinstance(info.value, ValueError)
        assert "sequence length 10 is not divisible by 2 x cp = 8" in message, message
        assert "use a seq_len that is a multiple of 8" in message, message
    assert chunk_size(16, 4) == 2
