"""Llama 4's mixture of experts (models/moe.py) and attention (models/llama4.py): the grouped GEMM
against the loop over experts, the model at mp 2 (with and without sequence parallelism) against
mp 1 in logits, loss and every gradient, a few training steps at world 1, the presets' sizes."""

import pytest
import torch

from hybridpar.models.args import ModelArgs, ModelArgsError
from hybridpar.models.moe import expert_matmul, grouped_mm_allowed, route, sort_by_expert
from tests.distributed import parallel_dims, rel_err
from tests.models.test_llama import BOUND, _batch, _case_transformer_matches_mp1

PRESET = "debug_llama4"  # 4 layers, 4 experts top-2 on layers 1 and 3, layer 3 without RoPE, chunks of 8


def _routed(seed: int, n_experts: int = 4, top_k: int = 2, tokens: int = 24, dim: int = 16):
    """Tokens sorted by expert as the MoE layer sorts them; expert 1 chosen by none."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=g)
    logits[:, 1] = -10.0
    _, experts = route(logits, top_k)
    order, counts = sort_by_expert(experts, n_experts)
    x = torch.randn(tokens * top_k, dim, generator=g)[order]
    return x, counts


def test_the_grouped_gemm_equals_the_loop_over_experts_forward_and_backward():
    x, counts = _routed(0)
    assert counts.tolist()[1] == 0 and counts.sum() == 48  # an expert without tokens: an empty group
    weights = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(1))
    assert grouped_mm_allowed(x, weights)  # fp32 on the CPU, rows of 64 and 128 bytes
    results = {}
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = expert_matmul(xi, wi, counts, grouped)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results[grouped] = (out, xi.grad, wi.grad)
    reference = torch.cat([rows @ w.t() for rows, w in zip(x.split(counts.tolist()), weights)])
    errors = {name: rel_err(a, b) for name, a, b in zip(("out", "x.grad", "w.grad"), results[True], results[False])}
    print(f"\ngrouped GEMM vs loop, fp32: {errors}")
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    assert torch.equal(results[True][0], reference)


def test_the_grouped_gemm_runs_where_torch_has_it():
    x = torch.zeros(4, 16)
    assert grouped_mm_allowed(x, torch.zeros(2, 8, 16))  # 32 and 64 bytes per row
    assert not grouped_mm_allowed(x, torch.zeros(2, 6, 16))  # 24 bytes: not 16-byte aligned, the loop
    assert grouped_mm_allowed(x.bfloat16(), torch.zeros(2, 8, 16, dtype=torch.bfloat16))
    assert not grouped_mm_allowed(x.double(), torch.zeros(2, 8, 16, dtype=torch.float64))
    assert not grouped_mm_allowed(x, torch.zeros(2, 8, 16, dtype=torch.bfloat16))  # mixed dtypes


def test_routing_keeps_every_token_and_sorts_stably():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 2.0], [0.5, 0.4, 0.3]])
    weights, experts = route(logits, 2)
    assert experts.tolist() == [[1, 2], [0, 2], [0, 1]]
    assert torch.allclose(weights, torch.sigmoid(torch.tensor([[3.0, 1.0], [5.0, 2.0], [0.5, 0.4]])))
    order, counts = sort_by_expert(experts, 3)
    assert counts.tolist() == [2, 2, 2] and order.tolist() == [2, 4, 0, 5, 1, 3]  # slot t * 2 + j


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
def test_llama4_at_mp2_matches_mp1(workers, check_close, sp):
    """Logits, loss and every gradient (the router's, the stacked experts', the shared expert's)."""
    results = workers(2).run(_case_transformer_matches_mp1, PRESET, 2, sp)
    assert any("experts.w1" in name for name in results[0]) and any("router" in name for name in results[0])
    check_close(f"{PRESET} mp2{' sequence-parallel' if sp else ''}", results, BOUND)


def _case_trains(steps: int) -> dict:
    """Adam on one batch of the tiny Llama 4 at world 1: the losses, the router's and experts' gradient norms,
    and the logits of the grouped GEMM against the loop."""
    from hybridpar.models.llama import Transformer
    from hybridpar.parallel import vocab_parallel_cross_entropy

    parallel = parallel_dims(mp=1)
    args = ModelArgs.from_preset(PRESET)
    torch.manual_seed(0)
    model = Transformer(args, parallel)
    inputs, targets = _batch(args, seq=24)  # three chunks of 8 positions
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, grads = [], {}
    for _ in range(steps):
        optimizer.zero_grad()
        loss = vocab_parallel_cross_entropy(model(inputs), targets, parallel=parallel)
        loss.backward()
        grads = {name: p.grad.full_tensor().norm().item() for name, p in model.named_parameters()
                 if "router" in name or "expert" in name}
        optimizer.step()
        losses.append(loss.item())
    experts = [layer.feed_forward.experts for layer in model.layers.values() if args.is_moe_layer(int(layer.layer_id))]
    logits = {}
    for grouped in (True, False):
        for e in experts:
            e.grouped = grouped
        with torch.no_grad():
            logits[grouped] = model(inputs)
    return {"losses": losses, "grads": grads, "same": torch.equal(logits[True], logits[False])}


def test_the_tiny_llama4_trains_at_world_1(workers):
    result = workers(1).run(_case_trains, 6)[0]
    losses = result["losses"]
    print(f"\ntiny Llama 4, Adam, world 1: losses {[round(x, 4) for x in losses]}")
    assert losses[-1] < 0.9 * losses[0]
    assert len(result["grads"]) == 2 * 7 and all(v > 0 for v in result["grads"].values()), result["grads"]
    assert result["same"]  # the trained model's logits: grouped GEMM and loop alike


def test_llama4_presets_and_their_sizes():
    """Published sizes (text model): Scout 17B active of 109B with its vision tower, Maverick 17B of 400B."""
    scout, maverick = ModelArgs.from_preset("llama4_scout"), ModelArgs.from_preset("llama4_maverick")
    assert (scout.num_params(), scout.num_params(active=True)) == (107_769_861_120, 17_172_894_720)
    assert (maverick.num_params(), maverick.num_params(active=True)) == (400_711_848_960, 17_184_691_200)
    assert [i for i in range(48) if maverick.is_moe_layer(i)] == list(range(1, 48, 2))
    assert all(scout.is_moe_layer(i) for i in range(48)) and not scout.uses_rope(3) and scout.uses_rope(4)
    for args in (scout, maverick):
        args.check(8)
        # MFU counts the matmuls a token runs through: its active parameters but the embedding lookup's.
        embedding = args.vocab_size * args.dim
        assert args.flops_per_token(8192) == 6.0 * (args.num_params(active=True) - embedding) + 12.0 * 48 * 5120 * 8192
        assert args.flops_per_token(8192) < 6.0 * (args.num_params() - embedding) / 5


@pytest.mark.parametrize("fields,message", [
    ({"experts_per_token": 5}, r"experts_per_token = 5 must be between 1 and n_experts = 4"),
    ({"moe_layers": [1, 4]}, r"moe_layers = \[1, 4\] must list distinct layer indices from 0 to n_layers - 1 = 3"),
    ({"nope_layers": [2, 2]}, r"nope_layers = \[2, 2\] must list distinct layer indices"),
    ({"n_experts": 0}, r"moe_layers needs experts: set n_experts \(or remove moe_layers\)"),
    ({"expert_hidden_size": 30}, r"expert_hidden_size \(each expert's hidden size\) = 30 is not divisible by the "
                                 r"model-parallel size mp = 4"),
])
def test_llama4_fields_out_of_range_name_the_field(fields, message):
    args = ModelArgs.from_dict({**vars(ModelArgs.from_preset(PRESET)), **fields})
    with pytest.raises(ModelArgsError, match=message):
        args.check(4)
