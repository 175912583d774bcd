"""Expert parallelism (parallel.ep, hybridpar.parallel.experts): the token exchange alone (a rank whose
experts no token chose included), and the tiny Llama 4 at ep 2, ep 4 and ep 2 x mp 2 (with sequence
parallelism), each ep rank on its own sequences, against world 1 on all of them: logits, loss and
every gradient (an expert's on the rank holding it, the others summed over the ep ranks)."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import parallel_dims, rel_err
from tests.models.test_llama import BOUND

PRESET = "debug_llama4"  # 4 experts top-2 on layers 1 and 3


def _case_exchange(counts_by_rank: list, dim: int = 8) -> dict:
    """dispatch -> a per-expert scale -> combine, forward and backward, against the same done locally."""
    from hybridpar.parallel.experts import combine, dispatch

    parallel = parallel_dims(ep=dist.get_world_size())
    rank, n_experts = parallel.ep_rank, len(counts_by_rank[0])
    g = torch.Generator().manual_seed(rank)
    counts = torch.tensor(counts_by_rank[rank])
    x = torch.randn(int(counts.sum()), dim, generator=g, requires_grad=True)
    scales = torch.arange(1.0, n_experts + 1)  # expert e multiplies by e + 1
    local = n_experts // parallel.ep
    mine = scales[rank * local:(rank + 1) * local]
    rows, local_counts, exchange = dispatch(x, counts, parallel.ep_group)
    out = combine(rows * mine.repeat_interleave(local_counts)[:, None], exchange)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    expected = x.detach() * scales.repeat_interleave(counts)[:, None]
    grad = torch.linspace(-1, 1, out.numel()).view_as(out) * scales.repeat_interleave(counts)[:, None]
    received = sum(c[rank * local:(rank + 1) * local] for c in map(torch.tensor, counts_by_rank))
    return {"out": rel_err(out, expected), "grad": rel_err(x.grad, grad),
            "counts": local_counts.tolist() == received.tolist()}


@pytest.mark.parametrize("counts", [
    [[3, 0, 2, 5], [1, 4, 0, 0]],  # rank 1's experts get only rank 0's slots
    [[2, 1, 0, 0], [0, 3, 0, 0]],  # rank 1 receives nothing at all (its experts chosen by none)
], ids=["uneven", "a-rank-receives-nothing"])
def test_dispatch_and_combine_bring_every_slot_to_its_expert_and_back(workers, counts):
    results = workers(2).run(_case_exchange, counts)
    for r in results:
        assert r["counts"] and r["out"] == 0 and r["grad"] == 0, r


def _case_balanced_exchange(slots: int, n_experts: int, dim: int = 8) -> dict:
    """dispatch with balanced=True (the dry run's: sizes computed on the host, nothing read back) against
    the counted dispatch of the same balanced counts: the same rows, counts and exchange."""
    from hybridpar.parallel.experts import balanced_counts, combine, dispatch

    parallel = parallel_dims(ep=dist.get_world_size())
    counts = torch.tensor(balanced_counts(slots, n_experts))
    x = torch.randn(slots, dim, generator=torch.Generator().manual_seed(parallel.ep_rank))
    counted, balanced = (dispatch(x, counts, parallel.ep_group, b) for b in (False, True))
    back = combine(balanced[0], balanced[2])
    return {"rows": torch.equal(counted[0], balanced[0]), "counts": counted[1].tolist() == balanced[1].tolist(),
            "exchange": (counted[2].sent, counted[2].received) == (balanced[2].sent, balanced[2].received)
            and torch.equal(counted[2].index, balanced[2].index) and balanced[2].counts == counted[1].tolist(),
            "back": torch.equal(back, x)}


@pytest.mark.parametrize("slots,n_experts", [(16, 4), (10, 4), (3, 8)], ids=["even", "uneven", "fewer-slots"])
def test_the_dry_runs_balanced_dispatch_is_the_counted_one_of_balanced_counts(workers, slots, n_experts):
    for r in workers(2).run(_case_balanced_exchange, slots, n_experts):
        assert all(r.values()), r


def _case_ep_matches_world1(mp: int, ep: int, sequence_parallel: bool) -> dict:
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.parallel.state import full_state_dict, load_full_state_dict
    from tests.models.test_llama import _batch

    args = ModelArgs.from_preset(PRESET)
    p1, pn = parallel_dims(mp=1), parallel_dims(mp=mp, ep=ep)
    torch.manual_seed(0)
    reference = Transformer(args, p1)
    torch.manual_seed(1)  # other weights, then overwritten: the load must do all the work
    model = Transformer(args, pn, sequence_parallel=sequence_parallel)
    load_full_state_dict(model, full_state_dict(reference))
    experts = [name for name, p in model.named_parameters() if "experts." in name]
    assert all(p.device_mesh.mesh_dim_names == ("ep", "mp") for n, p in model.named_parameters() if n in experts)

    inputs, targets = _batch(args, batch=2 * ep, seq=16)  # every ep rank two sequences of its own
    mine = slice(2 * pn.ep_rank, 2 * pn.ep_rank + 2)
    results = {}
    for name, m, p, (x, t) in (("reference", reference, p1, (inputs, targets)),
                               ("ep", model, pn, (inputs[mine], targets[mine]))):
        logits = m(x, gather_logits=True)
        loss = vocab_parallel_cross_entropy(m(x), t, parallel=p, reduction="sum")
        loss.backward()
        grads = {n: q.grad.full_tensor() for n, q in m.named_parameters()}
        results[name] = logits.detach(), loss.detach(), grads
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = results["reference"], results["ep"]
    dist.all_reduce(loss, group=pn.ep_group)
    errors = {"logits": rel_err(logits, ref_logits[mine]), "loss": rel_err(loss, ref_loss)}
    for name, grad in grads.items():
        if name not in experts:  # this rank's tokens' share: summed over the ep ranks
            dist.all_reduce(grad, group=pn.ep_group)
        errors[f"grad.{name}"] = rel_err(grad, ref_grads[name])
    return errors


@pytest.mark.parametrize("mp,ep,sp", [(1, 2, False), (1, 4, False), (2, 2, True)],
                         ids=["ep2", "ep4", "ep2-mp2-sequence_parallel"])
def test_llama4_at_ep_matches_world1(workers, check_close, mp, ep, sp):
    results = workers(mp * ep).run(_case_ep_matches_world1, mp, ep, sp)
    assert any("experts.w1" in name for name in results[0]) and any("router" in name for name in results[0])
    check_close(f"{PRESET} ep{ep} mp{mp}{' sequence-parallel' if sp else ''}", results, BOUND)


def _case_refused(mp: int, ep: int, preset: str) -> str:
    from hybridpar.models.args import ModelArgs, ModelArgsError
    from hybridpar.models.llama import Transformer

    with pytest.raises(ModelArgsError) as err:
        Transformer(ModelArgs.from_preset(preset, n_experts=6) if preset == PRESET else ModelArgs.from_preset(preset),
                    parallel_dims(mp=mp, ep=ep))
    return str(err.value)


def test_a_model_ep_cannot_split_is_refused_naming_the_numbers(workers):
    assert workers(4).run(_case_refused, 1, 4, PRESET)[0] == (
        "n_experts = 6 is not divisible by the expert-parallel size ep = 4; choose an ep that divides 6")
    assert workers(2).run(_case_refused, 1, 2, "debug")[0] == (
        "expert parallelism (ep = 2) splits the experts, and this model has none (n_experts = 0, a dense model): "
        "use ep = 1")
