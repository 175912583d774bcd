"""A mixture of experts' load balance through the Trainer ([moe], hybridpar.train.experts): the tiny
Llama 4 trained with the router's auxiliary loss and DeepSeek-V3's bias update gives world 1's losses,
auxiliary losses, tokens per expert and routing bias at ep 2 of dp_shard 4 and at ep 2 x mp 2
(sequence parallel), and at ep 2 with 2 micro-batches a step as world 1 with 2; the bias resumes from a checkpoint (saved at world 1, resumed at ep 2); the
tokens per expert in metrics.jsonl sum to the step's tokens x top-k; a router forced to one ep
rank's experts is reported as hot, with that ep rank named, in the step line, events.jsonl and
the straggler report; a step trained again (not committed by the replica groups) counts its tokens once."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import rel_err
from tests.runs import make_config

BOUND = 1e-5
STEPS = 6
TOP_K = 2  # debug_llama4: 4 experts, top-2, on layers 1 and 3
BALANCE = {"moe.router_aux_loss_coef": 0.1, "moe.bias_update_rate": 0.01}


def _config(corpus, run_dir, steps=STEPS, **kwargs):
    flags = {"model.preset": "debug_llama4", "checkpoint.folder": str(Path(run_dir) / "checkpoints"), **BALANCE}
    return make_config(corpus, run_dir, steps=steps, **{**flags, **kwargs})


def _case_train(config) -> dict:
    """Train; every rank's routing bias at the end, rank 0's history and metrics.jsonl rows."""
    import torch.distributed as dist

    from hybridpar.train import Trainer
    from hybridpar.train.metrics import read_metrics

    trainer = Trainer(config)
    history = trainer.run()
    biases = [None] * dist.get_world_size()
    dist.all_gather_object(biases, {layer: m.balance.bias.tolist()
                                    for layer, m in zip(trainer.balance.layers, trainer.balance.modules)})
    if dist.get_rank() != 0:
        return None
    return {"history": [{k: m[k] for k in ("step", "loss", "aux_loss", "tokens")} for m in history],
            "biases": biases, "rows": read_metrics(trainer.metrics.jsonl_path)}


@pytest.fixture(scope="module")
def reference(workers, corpus, tmp_path_factory):
    """World 1, saving at step 3 (the checkpoint the resume starts from)."""
    run = tmp_path_factory.mktemp("balance_ref")
    return workers(1).run(_case_train, _config(corpus, run, dp=1, **{"checkpoint.every": 3}))[0], run / "checkpoints"


def _tokens(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("experts/tokens/")} for r in rows if "loss" in r]


def _compare(check_close, label: str, result: dict, reference: dict, since: int = 0) -> None:
    """Losses and auxiliary losses to BOUND; the tokens per expert and every rank's bias exactly."""
    history, expected = result["history"], reference["history"][since:]
    print(f"\n{label}: losses {[round(m['loss'], 6) for m in history]}, aux {[round(m['aux_loss'], 6) for m in history]}")
    assert [m["step"] for m in history] == [m["step"] for m in expected]
    check_close(label, {f"{key} step {a['step']}": rel_err(torch.tensor(a[key]), torch.tensor(b[key]))
                        for a, b in zip(history, expected) for key in ("loss", "aux_loss")}, BOUND)
    assert _tokens(result["rows"]) == _tokens(reference["rows"])[since:]
    assert all(bias == reference["biases"][0] for bias in result["biases"])


LAYOUTS = {  # name: (world, make_config's keyword arguments)
    "ep2-dp_shard4": (4, dict(dp=4, **{"parallel.ep": 2})),
    "ep2-mp2": (4, dict(mp=2, dp=2, strategy="hybrid_shard", **{"parallel.ep": 2})),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_balancing_losses_and_bias_at_ep_equal_world1(workers, check_close, corpus, reference, tmp_path, layout):
    ref = reference[0]
    losses = [m["aux_loss"] for m in ref["history"]]
    # The loss is k (2) x its weight for tokens spread evenly; the bias moved from 0 by whole steps.
    assert all(0.1 * TOP_K * 0.9 < x < 0.1 * TOP_K * 4 for x in losses), losses
    bias = ref["biases"][0]
    assert any(b != 0 for b in bias[1]) and all(abs(b) <= 0.01 * STEPS + 1e-6 for b in bias[1] + bias[3])
    world, kwargs = LAYOUTS[layout]
    result = workers(world).run(_case_train, _config(corpus, tmp_path, **kwargs))[0]
    _compare(check_close, f"debug_llama4 {layout} with [moe] balancing vs world 1", result, ref)
    # Must show: each layer's tokens per expert sum to the step's tokens x top-k, every step.
    rows = [r for r in result["rows"] if "experts/tokens/layer1" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    tokens = {m["step"]: m["tokens"] for m in result["history"]}
    for r in rows:
        assert sum(r["experts/tokens/layer1"]) == sum(r["experts/tokens/layer3"]) == tokens[r["step"]] * TOP_K
        assert sum(r["experts/ep_tokens"]) == 2 * tokens[r["step"]] * TOP_K and len(r["experts/ep_tokens"]) == 2


@pytest.mark.slow
def test_with_micro_batches_the_balancing_equals_world1s_with_as_many(workers, check_close, corpus, tmp_path):
    """grad_accum 2: the auxiliary loss of each micro-batch of the global batch (every dp rank's i-th
    together), their mean; the bias from the step's tokens of both."""
    flags = {"grad_accum": 2, "steps": 4}
    ref = workers(1).run(_case_train, _config(corpus, tmp_path / "world1", dp=1, **flags))[0]
    result = workers(2).run(_case_train, _config(corpus, tmp_path / "ep2", dp=2, **{"parallel.ep": 2, **flags}))[0]
    _compare(check_close, "debug_llama4 ep2 with [moe] balancing vs world 1, 2 micro-batches", result, ref)


@pytest.mark.slow
def test_the_routing_bias_resumes_from_a_checkpoint(workers, check_close, corpus, reference, tmp_path):
    """World 1's step 3, resumed at ep 2: its bias, then world 1's losses and bias at the end."""
    shutil.copytree(reference[1] / "step-00000003", tmp_path / "checkpoints" / "step-00000003")
    config = _config(corpus, tmp_path, dp=2, **{"parallel.ep": 2, "checkpoint.resume": True})
    result = workers(2).run(_case_train, config)[0]
    _compare(check_close, "debug_llama4 world 1 -> ep 2 from step 3", result, reference[0], since=3)


def _case_hot(config, slow_rank: int, sleep_s: float) -> dict:
    """Train with the router of layer 1 forced to experts 2 and 3 (ep rank 1's) by its routing bias, the
    same on every rank (a logit of 100 more than the others', whatever the token), that rank sleeping in its forward as the hot experts' compute would keep it; rank 0's output and files."""
    import contextlib
    import io
    import time

    import torch.distributed as dist

    from hybridpar.train import Trainer
    from hybridpar.train.metrics import read_metrics

    trainer = Trainer(config)
    layer = trainer.model.layers["1"].feed_forward
    layer.balance.bias = torch.tensor([0.0, 0.0, 100.0, 100.0])
    if dist.get_rank() == slow_rank:
        trainer.model.register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        trainer.run()
    named = [trainer.balance.hot_rank(r) for r in range(dist.get_world_size())]
    if dist.get_rank() != 0:
        return None
    run = trainer.metrics.jsonl_path.parent
    return {"out": out.getvalue(), "err": err.getvalue(), "rows": read_metrics(run / "metrics.jsonl"), "events": read_metrics(run / "events.jsonl"),
            "named": named}


@pytest.mark.slow
def test_a_router_forced_to_one_ep_ranks_experts_is_named_hot(workers, corpus, tmp_path):
    line = ("ep rank 1 (experts 2-3) got 100% of layer 1's routed tokens (an even share: 50%), expert 2 alone 50%: "
            "its experts are hot, not its node slow")
    config = _config(corpus, tmp_path, dp=2, steps=4, **{"parallel.ep": 2, "diagnostics.straggler_every": 2,
                                                         "moe.router_aux_loss_coef": 0, "moe.bias_update_rate": 0})
    result = workers(2).run(_case_hot, config, slow_rank=1, sleep_s=0.3)[0]
    print("\n" + result["out"])
    rows = [r for r in result["rows"] if "experts/tokens/layer1" in r]
    assert [r["experts/hot"] for r in rows] == [line] * 4 and all(r["experts/hot_rank"] == 1 for r in rows)
    assert all(r["experts/tokens/layer1"][:2] == [0, 0] and r["experts/imbalance"] == 2.0 for r in rows)
    assert [(e["step"], e["rank"], e["line"]) for e in result["events"] if e["event"] == "hot_experts"] == [(1, 1, line)]
    assert result["named"] == [None, line]  # global rank 1 is ep rank 1
    assert result["err"].count(line) == 1 and f"step 1: {line}" in result["err"]  # a warning when it began
    assert f"hot: {line}" in result["out"]  # and on the step lines
    stragglers = [line for line in result["out"].splitlines() if line.startswith("straggler at step 4: rank 1 ")]
    assert len(stragglers) == 1 and stragglers[0].endswith(f"the others wait for it; {line}")
    assert [r["straggler/hot_experts"] for r in result["rows"] if "straggler/slowest_rank" in r] == [line] * 2


def _case_redone(config) -> list:
    """Train with step 1's first try not committed (as the replica groups answer when a group failed in
    it): each committed step's tokens and its metrics.jsonl row."""
    from hybridpar.train import Trainer
    from hybridpar.train.metrics import read_metrics

    trainer = Trainer(config)
    answers = iter([False])
    trainer.replicas.commit = lambda: next(answers, True)
    tokens = {m["step"]: m["tokens"] for m in trainer.run()}
    return [(tokens[r["step"]], r) for r in read_metrics(trainer.metrics.jsonl_path) if "experts/tokens/layer1" in r]


@pytest.mark.slow
def test_a_step_trained_again_counts_its_tokens_per_expert_once(workers, corpus, tmp_path):
    rows = workers(1).run(_case_redone, _config(corpus, tmp_path, dp=1, steps=2))[0]
    print(f"\nsteps {[r['step'] for _, r in rows]}: routed {[sum(r['experts/tokens/layer1']) for _, r in rows]}, "
          f"tokens {[t for t, _ in rows]}")
    assert [r["step"] for _, r in rows] == [1, 2]
    for tokens, r in rows:  # not 2x on step 1: the try that was not committed counts nothing
        assert sum(r["experts/tokens/layer1"]) == sum(r["experts/tokens/layer3"]) == tokens * TOP_K
