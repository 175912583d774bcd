"""A mixture of experts' load balance, the pieces on their own (models/moe.py, hybridpar.train.experts):
the routing bias chooses and does not weigh, the load-balancing loss is transformers' formula and its
gradient rides on the layer's output, a hot ep rank is found and named (the training runs:
tests/train/test_expert_balance.py)."""

import torch
import torch.nn.functional as F

from hybridpar.models.moe import load_balancing_loss, route, with_aux_loss
from hybridpar.train.experts import hot_experts, hot_text


def test_the_routing_bias_chooses_the_experts_and_leaves_their_weights():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 2.0]])
    weights, experts = route(logits, 2, bias=torch.tensor([0.0, 0.0, 10.0]))
    assert experts.tolist() == [[2, 1], [2, 0]]  # expert 2 first for both: its bias, not its logit
    assert torch.equal(weights, torch.sigmoid(torch.tensor([[1.0, 3.0], [2.0, 5.0]])))  # the logits' own
    assert [t.tolist() for t in route(logits, 2, torch.zeros(3))] == [t.tolist() for t in route(logits, 2)]


def _transformers_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func for one layer: the mean one-hot of each token's top-k
    choices against the mean softmax probability, times the number of experts."""
    probabilities = torch.softmax(logits, dim=-1)
    chosen = F.one_hot(torch.topk(probabilities, top_k, dim=-1).indices, logits.shape[-1]).float()
    return (chosen.mean(0) * probabilities.mean(0)).sum() * logits.shape[-1]


def test_the_load_balancing_loss_is_transformers_and_its_gradient_rides_on_the_output():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 4, generator=g)
    _, experts = route(logits, 2)
    counts = torch.bincount(experts.flatten(), minlength=4)
    expected = _transformers_loss(logits, 2)
    assert torch.allclose(load_balancing_loss(logits, counts, 2), expected, rtol=1e-6)
    even = torch.zeros(8, 4)  # every expert equally likely and chosen as often: k
    assert torch.allclose(load_balancing_loss(even, torch.full((4,), 4), 2), torch.tensor(2.0))
    # The loss riding on x: x's backward gives the logits scale x the loss's gradient.
    direct = logits.clone().requires_grad_()
    (3.0 * load_balancing_loss(direct, counts, 2)).backward()
    riding, x = logits.clone().requires_grad_(), torch.randn(5, generator=g, requires_grad=True)
    out = with_aux_loss(x, load_balancing_loss(riding, counts, 2), 3.0)
    assert torch.equal(out, x)
    (out * 2).sum().backward()
    assert torch.allclose(riding.grad, direct.grad, rtol=1e-6) and torch.equal(x.grad, torch.full((5,), 2.0))


def test_a_hot_ep_rank_is_found_and_named():
    counts = torch.tensor([[20, 20, 30, 30], [10, 10, 71, 9]])  # layers 1 and 3, ep 2: ep rank 1 has 80% of layer 3
    hot = hot_experts(counts, 2, 1.5, [1, 3])
    assert (hot["layer"], hot["ep_rank"], hot["experts"], hot["expert"]) == (3, 1, (2, 2), 2)
    assert hot_text(hot) == ("ep rank 1 (experts 2-3) got 80% of layer 3's routed tokens (an even share: 50%), "
                             "expert 2 alone 71%: its experts are hot, not its node slow")
    assert hot_experts(counts, 2, 1.7, [1, 3]) is None  # 80% is 1.6 x 50%
    assert hot_experts(counts, 1, 1.5, [1, 3]) is None  # at ep 1 no rank waits for another's experts
    one = hot_experts(counts, 4, 1.5, [1, 3])  # an expert each: "expert 2", without "alone"
    assert hot_text(one).startswith("ep rank 2 (expert 2) got 71% of layer 3's routed tokens (an even share: 25%): its")
