"""Each tensor-parallel layer against single-process nn.Linear / nn.Embedding on the same full weights."""

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import parallel_dims, rel_err

BOUND = 1e-5


def _case_layer(kind: str, mp: int, flag: bool) -> dict:
    from hybridpar.parallel import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, VocabParallelEmbedding

    parallel = parallel_dims(mp=mp)
    torch.manual_seed(1234)
    batch, seq, d_in, d_out, vocab = 3, 5, 16, 24, 32
    if kind == "column":
        layer = ColumnParallelLinear(d_in, d_out, bias=True, gather_output=flag, parallel=parallel)
        torch.nn.init.normal_(layer.bias.to_local())  # a zero bias would hide bias bugs
    elif kind == "row":
        layer = RowParallelLinear(d_in, d_out, bias=True, input_is_parallel=flag, parallel=parallel)
        with torch.no_grad():
            layer.bias.to_local().normal_()
    elif kind == "vocab_embedding":
        layer = VocabParallelEmbedding(vocab, d_out, parallel=parallel)
    else:
        layer = ParallelEmbedding(vocab, d_out, parallel=parallel)
    weight = layer.weight.full_tensor().detach().requires_grad_()
    bias = layer.bias.full_tensor().detach().requires_grad_() if getattr(layer, "bias", None) is not None else None

    if kind in ("column", "row"):
        x = torch.randn(batch, seq, d_in, requires_grad=True)
        ref = F.linear(x, weight, bias)
    else:
        x = torch.randint(0, vocab, (batch, seq))
        ref = F.embedding(x, weight)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)

    mp_rank = parallel.mp_rank
    if kind == "row" and flag:  # the input arrives already split along its last dim
        x_in = x.detach().chunk(mp, dim=-1)[mp_rank].clone().requires_grad_()
    elif x.is_floating_point():
        x_in = x.detach().clone().requires_grad_()
    else:
        x_in = x
    out = layer(x_in)
    expected_out, grad_in = ref, grad_out
    if kind == "column" and not flag:  # output stays split along its last dim
        expected_out, grad_in = ref.chunk(mp, dim=-1)[mp_rank], grad_out.chunk(mp, dim=-1)[mp_rank]
    out.backward(grad_in)

    errors = {"output": rel_err(out, expected_out), "weight_grad": rel_err(layer.weight.grad.full_tensor(), weight.grad)}
    if bias is not None:
        errors["bias_grad"] = rel_err(layer.bias.grad.full_tensor(), bias.grad)
    if x.is_floating_point():
        expected_gx = x.grad.chunk(mp, dim=-1)[mp_rank] if (kind == "row" and flag) else x.grad
        errors["input_grad"] = rel_err(x_in.grad, expected_gx)
    # The local shard is fairscale's: rows for column/vocab, columns for row/parallel embedding.
    shard_dim = 0 if kind in ("column", "vocab_embedding") else 1
    errors["shard_layout"] = rel_err(layer.weight.to_local(), weight.detach().chunk(mp, dim=shard_dim)[mp_rank])
    return errors


CASES = [("column", True), ("column", False), ("row", False), ("row", True), ("vocab_embedding", None), ("parallel_embedding", None)]


@pytest.mark.parametrize("mp", [1, 2, 4])
@pytest.mark.parametrize("kind,flag", CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_layer_matches_single_process(workers, check_close, kind, flag, mp):
    results = workers(4).run(_case_layer, kind, mp, flag)
    check_close(f"{kind} mp{mp}", results, BOUND)
