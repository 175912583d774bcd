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
    elif kind == "vocab_embedding":  # flag: padding_idx, a global id
        layer = VocabParallelEmbedding(vocab, d_out, padding_idx=flag, parallel=parallel)
    else:
        layer = ParallelEmbedding(vocab, d_out, padding_idx=flag, parallel=parallel)
    weight = layer.weight.full_tensor().detach().requires_grad_()
    bias = layer.bias.full_tensor().detach().requires_grad_() if getattr(layer, "bias", None) is not None else None

    if kind in ("column", "row"):
        x = torch.randn(batch, seq, d_in, requires_grad=True)
        ref = F.linear(x, weight, bias)
    else:
        x = torch.randint(0, vocab, (batch, seq))
        x[0, :2] = 20  # the padding id of the padded cases: its row's gradient stays zero
        ref = F.embedding(x, weight, padding_idx=flag)
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


CASES = [("column", True), ("column", False), ("row", False), ("row", True), ("vocab_embedding", None),
         ("vocab_embedding", 20), ("parallel_embedding", None), ("parallel_embedding", 20)]


@pytest.mark.parametrize("mp", [1, 2, 4])
@pytest.mark.parametrize("kind,flag", CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_layer_matches_single_process(workers, check_close, kind, flag, mp):
    results = workers(4).run(_case_layer, kind, mp, flag)
    check_close(f"{kind} mp{mp}", results, BOUND)


def _case_unsupported_options(mp: int) -> list:
    from hybridpar.parallel import ColumnParallelLinear, ParallelEmbedding, VocabParallelEmbedding

    parallel = parallel_dims(mp=mp)
    errors = []
    for make in (lambda: VocabParallelEmbedding(32, 8, max_norm=1.0, parallel=parallel),
                 lambda: ColumnParallelLinear(8, 8, keep_master_weight_for_test=True, parallel=parallel),
                 lambda: ParallelEmbedding(32, 8, keep_master_weight_for_test=True, parallel=parallel)):
        try:
            make()
            errors.append("no error")
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_fairscale_options_without_an_implementation_are_refused(workers):
    errors = workers(2).run(_case_unsupported_options, 2)[0]
    assert errors[0] == "VocabParallelEmbedding: max_norm is not supported with mp > 1", errors
    assert all(e.startswith("keep_master_weight_for_test=True is not supported") for e in errors[1:]), errors
