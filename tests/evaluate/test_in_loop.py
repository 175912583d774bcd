"""Downstream evaluation in the training loop ([eval], hybridpar.train.downstream): scores logged every N
steps in metrics.jsonl, TensorBoard and summary.json, equal to `hybridpar eval` on the checkpoint saved
at that step, and a training run bit-equal to the same run without them; the refusals before training;
the data-parallel ranks' scoring in lockstep (FSDP's all-gathers need every rank's forward)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.evaluate.local_tasks import QUESTIONS, write_tasks
from tests.runs import make_config

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")

TASKS = "tiny_mc,tiny_ppl"
BOUND = 1e-4  # perplexities in the loop against `hybridpar eval` on the checkpoint, relative, in float32


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    from hybridpar.data import default_corpus_documents

    documents = [d[:300] for d in default_corpus_documents(max_documents=20)][:4]
    folder = tmp_path_factory.mktemp("in_loop") / "tasks"
    write_tasks(folder, documents)
    return folder


def _eval_flags(tasks: Path, **more) -> dict:
    return {"eval.tasks": TASKS, "eval.every": 2, "eval.include_path": str(tasks), **more}


# --- the config and the refusals before training ---------------------------------------------


def test_the_eval_section_parses_round_trips_and_refuses_bad_values(tmp_path):
    from hybridpar.config import ConfigError, dump_toml, load_config

    config = load_config(None, ["--eval.tasks", "arc_easy, hellaswag", "--eval.limit", "50", "--eval.every", "500"])
    assert config.eval.tasks == ["arc_easy", "hellaswag"] and config.eval.harness_limit() == 50
    assert config.eval.harness_fewshot() is None and load_config(None).eval.tasks == []
    (tmp_path / "c.toml").write_text(dump_toml(config))
    assert load_config(tmp_path / "c.toml").eval == config.eval
    assert load_config(None, ["--eval.limit", "0.25"]).eval.harness_limit() == 0.25
    for flag, value, line in [("eval.limit", "2.5", "eval.limit must be 0 (every document), a whole number of "
                               "documents or a share below 1, got 2.5"),
                              ("eval.every", "-1", "eval.every must be >= 0, got -1"),
                              ("eval.batch_tokens", "0", "eval.batch_tokens must be >= 1, got 0")]:
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"--{flag}", value])
        assert str(refused.value) == line


def test_the_docs_example_is_a_valid_config(tmp_path):
    from hybridpar.config import load_config

    text = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    example = text.split("## In the loop", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "example.toml").write_text(example)
    config = load_config(tmp_path / "example.toml")
    assert config.eval.tasks == ["arc_easy", "hellaswag"] and config.eval.every == 1000


@pytest.mark.parametrize("case", ["lm-eval missing", "include_path", "pp", "cp"])
def test_a_section_that_cannot_run_is_one_line_before_any_process_group(corpus, tasks, tmp_path, monkeypatch, case):
    import importlib.util

    from hybridpar.config import ConfigError
    from hybridpar.preflight import resolve_job

    flags, world = _eval_flags(tasks), 1
    if case == "lm-eval missing":
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else
                            find_spec(name, *a))
        line = ("the [eval] section needs lm-evaluation-harness, which is not installed: pip install -e '.[eval]' "
                "(or pip install lm-eval)")
    elif case == "include_path":
        flags["eval.include_path"] = str(tmp_path / "nowhere")
        line = f"eval.include_path: {tmp_path / 'nowhere'} is not a folder; give the folder holding your task files"
    else:
        flags[f"parallel.{case}"], world = 2, 2
        line = (f"evaluation in the loop runs at pp 1 and cp 1, and this job has pp {2 if case == 'pp' else 1}, cp "
                f"{2 if case == 'cp' else 1}; use hybridpar eval on a checkpoint (or empty eval.tasks)")
    config = make_config(corpus, tmp_path / "run", **flags)
    with pytest.raises(ConfigError) as refused:
        resolve_job(config, world)
    assert str(refused.value) == line
    assert not (tmp_path / "run").exists()


def _case_refused(config):
    from hybridpar.train import Trainer

    try:
        Trainer(config).run()
    except Exception as err:  # noqa: BLE001 - the test reads what it was
        return f"{type(err).__name__}: {err}"
    return "trained"


EMPTY = "<an empty folder>"  # stands for one the test makes


@pytest.mark.parametrize("flags,line", [
    # A name not among the local tasks has lm-eval index its own ~15,000 task files: seconds.
    pytest.param({"eval.tasks": "tiny_mc,no_such_task"}, "task no_such_task is not known to lm-eval: check its name "
                 "(lm-eval ls tasks), or give the folder of its task file with eval.include_path",
                 marks=pytest.mark.slow, id="unknown"),
    pytest.param({"eval.tasks": "tiny_mc", "eval.include_path": EMPTY}, "task tiny_mc is not known to lm-eval: check "
                 f"its name (lm-eval ls tasks), or give the folder of its task file with eval.include_path ({EMPTY} "
                 "holds no task file: *.yaml)", marks=pytest.mark.slow, id="empty include_path"),
    pytest.param({"eval.tasks": "tiny_mc,tiny_gen"}, "eval.tasks: tiny_gen generate text (generate_until), which the "
                 "training loop does not run; score it with hybridpar eval on a checkpoint", id="generate_until"),
    pytest.param({"eval.tasks": "tiny_mc", "eval.num_fewshot": 10}, f"task tiny_mc has {len(QUESTIONS)} documents "
                 f"to draw few-shot examples from, fewer than eval.num_fewshot 10: give eval.num_fewshot "
                 f"{len(QUESTIONS)} or fewer", id="num_fewshot"),
])
def test_a_task_that_cannot_run_in_the_loop_is_one_line_before_training(workers, corpus, tasks, tmp_path, flags, line):
    (tmp_path / "empty").mkdir()
    flags = {key: str(tmp_path / "empty") if value == EMPTY else value for key, value in flags.items()}
    config = make_config(corpus, tmp_path / "run", **_eval_flags(tasks, **flags))
    assert workers(1).run(_case_refused, config)[0] == f"ConfigError: {line.replace(EMPTY, str(tmp_path / 'empty'))}"
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "config.toml").exists()


# --- lockstep scoring ----------------------------------------------------------------------


def _case_lockstep() -> dict:
    import torch

    from hybridpar.evaluate.scoring import batches_by_length, score, score_batch
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from tests.distributed import parallel_dims

    parallel = parallel_dims(mp=1)  # dp 2
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_preset("debug"), parallel)
    forwards = []
    model.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape[0]))
    requests = [([1 + (i * 7 + j) % 100 for j in range(4 + i % 5)], 1 + i % 3) for i in range(10)]
    batches = batches_by_length([len(t) for t, _ in requests], 16)
    scores = score(model, parallel, requests, batch_tokens=16)
    counted = len(forwards)
    alone = [score_batch(model, parallel, [r])[0] for r in requests]
    return {"batches": len(batches), "forwards": counted, "scores": scores, "alone": alone}


def test_scoring_runs_the_same_forwards_on_every_dp_rank_with_an_odd_number_of_batches(workers):
    first, second = workers(2).run(_case_lockstep)
    assert first["batches"] % 2 == 1 and first["batches"] >= 3, first["batches"]
    assert first["forwards"] == second["forwards"] == (first["batches"] + 1) // 2
    assert first["scores"] == second["scores"]
    for (got, greedy), (alone, alone_greedy) in zip(first["scores"], first["alone"], strict=True):
        assert abs(got - alone) <= 1e-5 * abs(alone) and greedy == alone_greedy  # the repeat's results dropped


# --- a run with [eval] -----------------------------------------------------------------------


def _case_train(config) -> dict:
    """The run's losses, weights and evaluation time, and draws from Python's, NumPy's and torch's
    random states after it (the harness seeds them: the loop must put them back)."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    from torch.distributed.tensor import DTensor

    from hybridpar.train import Trainer

    random.seed(5)
    np.random.seed(5)
    trainer = Trainer(config)  # seeds torch (train.seed)
    history = trainer.run()
    # This rank's shards, compared rank by rank: the same layout in both runs, and no collective.
    params = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
              for k, v in trainer.model.state_dict().items()}
    draws = [random.random(), float(np.random.rand()), torch.rand(1).item()]
    return {"losses": [m["loss"] for m in history], "params": params, "eval_seconds": trainer.eval_seconds,
            "draws": draws, "training": trainer.model.training, "rank": dist.get_rank()}


def _case_offline(checkpoint: str, tasks: str) -> dict:
    from hybridpar.evaluate import evaluate_checkpoint
    from tests.distributed import parallel_dims

    output = evaluate_checkpoint(checkpoint, TASKS, include_path=tasks, parallel=parallel_dims(mp=2))
    return None if output is None else {"results": output["results"], "step": output["step"]}


@pytest.mark.slow
def test_a_run_with_eval_logs_scores_and_trains_bit_equal_to_one_without(workers, corpus, tasks, tmp_path):
    """mp 2 x dp 2, 4 steps, [eval] every 2: eval/... at steps 2 and 4 in metrics.jsonl, TensorBoard and
    summary.json (the last), the losses and the weights == the run without [eval]; the step-2 scores are
    `hybridpar eval`'s on the checkpoint saved at step 2."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    layout = dict(mp=2, dp_shard=2, dp=2, steps=4)
    common = {"checkpoint.every": 2, "output.tensorboard": True, "output.plot": True}
    plains = workers(4).run(_case_train, make_config(corpus, tmp_path / "plain", **layout, **common))
    run = tmp_path / "eval"
    evaluateds = workers(4).run(_case_train, make_config(corpus, run, **layout, **common, **_eval_flags(tasks)))
    plain, evaluated = plains[0], evaluateds[0]
    assert evaluated["losses"] == plain["losses"] and len(plain["losses"]) == 4
    for mine, theirs in zip(evaluateds, plains, strict=True):  # every rank's random states
        assert mine["draws"] == theirs["draws"], mine["rank"]
    assert all(r["training"] for r in evaluateds)
    for mine, theirs in zip(evaluateds, plains, strict=True):
        assert mine["params"].keys() == theirs["params"].keys() and mine["rank"] == theirs["rank"]
        assert all(torch.equal(mine["params"][k], theirs["params"][k]) for k in theirs["params"])
    assert plain["eval_seconds"] == 0 and evaluated["eval_seconds"] > 0

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows if "eval_s" in r}
    assert sorted(scored) == [2, 4], rows
    print(f"\nin-loop evaluation seconds (mp 2 x dp 2): {[r['eval_s'] for r in rows if 'eval_s' in r]}")
    names = {"eval/tiny_mc/acc", "eval/tiny_mc/acc_stderr", "eval/tiny_mc/acc_norm", "eval/tiny_mc/acc_norm_stderr",
             "eval/tiny_ppl/word_perplexity", "eval/tiny_ppl/byte_perplexity", "eval/tiny_ppl/bits_per_byte"}
    assert names <= scored[2].keys() and scored[2].keys() == scored[4].keys(), scored[2]
    for scores in scored.values():
        assert scores["eval/tiny_mc/acc"] * len(QUESTIONS) in range(len(QUESTIONS) + 1)
        assert math.isfinite(scores["eval/tiny_ppl/word_perplexity"]) and scores["eval/tiny_ppl/word_perplexity"] > 1
    assert scored[2] != scored[4]  # the model trained in between

    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    for name in names:
        assert [(e.step, e.value) for e in board.Scalars(name)] == [
            (step, pytest.approx(scored[step][name], rel=1e-6)) for step in (2, 4)], name
    assert [e.step for e in board.Scalars("perf/downstream_eval_s")] == [2, 4]
    assert json.loads((run / "summary.json").read_text())["downstream"] == scored[4]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    offline = workers(4).run(_case_offline, str(run / "checkpoints" / "step-00000002"), str(tasks))[0]
    assert offline["step"] == 2
    for metric in ("acc", "acc_norm"):  # the same accuracies
        assert offline["results"]["tiny_mc"][f"{metric},none"] == scored[2][f"eval/tiny_mc/{metric}"], metric
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        theirs = offline["results"]["tiny_ppl"][f"{metric},none"]
        assert abs(scored[2][f"eval/tiny_ppl/{metric}"] / theirs - 1) < BOUND, metric


def test_scores_take_lm_evals_metrics_without_the_filter_suffix():
    from hybridpar.train.downstream import due, scores_of
    from hybridpar.train.metrics import validation_text

    results = {"arc": {"alias": "arc", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_stderr,bad": "N/A"},
               "gsm": {"exact_match,strict-match": 0.25, "sample_len": 3}}
    scores = scores_of(results)
    assert scores == {"eval/arc/acc": 0.5, "eval/arc/acc_stderr": 0.1, "eval/gsm/exact_match_strict-match": 0.25}
    assert validation_text({**scores, "eval_s": 12.34}) == "  eval 12.3s arc/acc 0.5 gsm/exact_match_strict-match 0.25"
    assert [s for s in range(1, 8) if due(s, 3, 7)] == [3, 6, 7] and [s for s in range(1, 8) if due(s, 0, 7)] == [7]


def test_the_dashboard_has_a_panel_of_the_scores_against_the_step():
    from hybridpar.train.dashboard import draw_dashboard

    rows = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": 0.01,
             "step_time": 0.1, "memory_gb": 1.0} for s in range(1, 5)]
    for row, acc in ((rows[1], 0.25), (rows[3], 0.5)):
        row.update({"eval/arc/acc": acc, "eval/arc/acc_stderr": 0.1, "eval_s": 3.0})
    fig = draw_dashboard(rows, [], "run")
    [panel] = [ax for ax in fig.axes if ax.get_title() == "downstream scores ([eval])"]
    [line] = panel.get_lines()
    assert line.get_label() == "arc/acc" and list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [0.25, 0.5]
    assert [ax.get_visible() for ax in fig.axes].count(False) == 1  # six panels and this one; the eighth hidden
