"""`hybridpar eval` and the harness backend against lm-evaluation-harness's own Hugging Face backend on
hybridpar's export of the same checkpoint: identical accuracies, per-request log-likelihoods and
word/byte perplexities within 1e-4, at world 1, mp 2, dp 2 and mp 2 x dp 2; offline, over task files
the test writes (a multiple-choice task, a rolling-loglikelihood task, a generation task on local JSON,
and loglikelihood requests made for the model: continuations that are its greedy ones, and a request
longer than its window)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import child_pythonpath
from tests.evaluate.local_tasks import (QUESTIONS, per_request, relative_errors, write_loglikelihood_task,
                                        write_tasks)

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
os.environ["HF_DATASETS_OFFLINE"] = "1"  # no network: every dataset is a local file
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[2]
BOUND = 1e-4  # per-request log-likelihoods and perplexities, relative, in float32
STEP = 7
TASKS = "tiny_mc,tiny_ppl,tiny_gen"
COMPARED = TASKS + ",tiny_ll"  # what the harness's backends are compared on

def _case_save(folder: str, tokenizer: str) -> None:
    """A debug-preset model saved by hybridpar at step STEP (recording its run's tokenizer), and its
    Hugging Face export with the tokenizer, in float32."""
    import torch

    from hybridpar.checkpoint.convert import convert
    from hybridpar.checkpoint.dcp import Checkpointer, params_dict
    from hybridpar.data import Tokenizer
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from tests.distributed import parallel_dims

    tok = Tokenizer(tokenizer)
    args = ModelArgs.from_preset("debug", vocab_size=tok.vocab_size)
    parallel = parallel_dims(mp=1)
    torch.manual_seed(0)
    model = Transformer(args, parallel)
    with torch.no_grad():  # sharper predictions than the init's near-uniform ones: choices far apart
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    recorded = {"tokenizer": {"path": str(tok.path), "sha256": tok.sha256}}
    Checkpointer(Path(folder) / "ckpt", parallel).save(STEP, model, None, recorded, params_dict(args))
    convert(Path(folder) / "ckpt", Path(folder) / "hf", "hf", parallel, tokenizer=tokenizer, dtype=torch.float32)


@pytest.fixture(scope="module")
def saved(workers, tmp_path_factory):
    from hybridpar.data import default_corpus_documents, train_tokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    documents = list(default_corpus_documents(max_documents=300))
    train_tokenizer(documents, 600, root / "tokenizer.model")
    workers(2).run(_case_save, str(root), str(root / "tokenizer.model"))
    # Documents of several lengths: the longest spans more than one 64-token window.
    write_tasks(root / "tasks", [documents[i] for i in (3, 10, 25, 40)])
    write_loglikelihood_task(root / "tasks", _loglikelihood_requests(root / "hf", max(documents[:50], key=len)))
    return root


def _loglikelihood_requests(hf: Path, long_document: str) -> list[dict]:
    """Requests made for the model (the random model's continuations of the other tasks are never
    greedy, so whether a continuation is greedy would be compared only as False): after each question
    of QUESTIONS, the export's own greedy continuation, computed first with lm-eval's Hugging Face
    backend (two tokens, each the argmax by a clear margin, whose text encodes back to the same tokens
    after the question's as the harness splits a pair), one at least with a token of the upper half of
    the vocabulary (the second shard at mp 2, whose ids the argmax over the shards offsets); and a
    request longer than the model's window (truncated from the left)."""
    import torch
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=1)
    requests, half = [], lm.model.config.vocab_size // 2
    for question, _, _ in QUESTIONS:
        context = f"Question: {question}\nAnswer:"
        ids, new = lm.tok_encode(context), []
        with torch.no_grad():
            while len(new) < 2:
                top = lm.model(torch.tensor([ids + new])).logits[0, -1].topk(2)
                if top.values[0] - top.values[1] < 1e-3:  # a near tie: float32 rounding may choose either
                    break
                new.append(int(top.indices[0]))
        prefix, text = lm.tok_decode(ids), lm.tok_decode(ids + new)
        continuation = text[len(prefix):]
        if len(new) == 2 and text.startswith(prefix) and lm.tok_encode(context + continuation) == ids + new:
            requests.append({"context": context, "continuation": continuation, "made_greedy": True,
                             "upper_half": max(new) >= half})
    print(f"\ngreedy continuations: {[(r['context'][10:], r['continuation'], r['upper_half']) for r in requests]}")
    assert any(r["upper_half"] for r in requests), requests
    ending = " and so on."
    assert len(lm.tok_encode(long_document + ending)) > lm.max_length + 1
    return requests + [{"context": long_document, "continuation": ending, "made_greedy": False, "upper_half": False}]


@pytest.fixture(scope="module")
def reference(saved):
    """lm-eval's Hugging Face backend on the export, in float32."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="hf", model_args=f"pretrained={saved / 'hf'},dtype=float32", tasks=COMPARED.split(","),
                           task_manager=TaskManager(include_path=str(saved / "tasks"), include_defaults=False),
                           log_samples=True,
                           device="cpu", batch_size=4)


def _compare(output: dict, reference: dict, check_close, label: str) -> None:
    for task in COMPARED.split(","):
        assert output["results"][task].keys() == reference["results"][task].keys()
    # Greedy continuations cut at the stop string, as text up to the first byte that is no UTF-8 (the random
    # model emits lone byte pieces, which sentencepiece decodes one by one, transformers as one replacement).
    generated, expected = ([re.match(r"[ -~]*", s["resps"][0][0]).group() for s in sorted(o["samples"]["tiny_gen"],
                                                                                           key=lambda s: s["doc_id"])]
                           for o in (output, reference))
    assert all(g.startswith(e) or e.startswith(g) for g, e in zip(generated, expected, strict=True)), (generated, expected)
    assert sum(map(len, expected)) > 20 and not any(" " in g for g in generated), (generated, expected)
    for metric in ("acc,none", "acc_norm,none"):  # accuracies identical
        assert output["results"]["tiny_mc"][metric] == reference["results"]["tiny_mc"][metric], metric
    made = [("tiny_ll", s["doc_id"], 0) for s in reference["samples"]["tiny_ll"] if s["doc"]["made_greedy"]]
    greedy = per_request(reference, greedy=True)
    assert made and all(greedy[k] for k in made), ("the model's own greedy continuations", greedy)
    assert per_request(output, greedy=True) == greedy
    ours, theirs = per_request(output), per_request(reference)
    assert ours.keys() == theirs.keys()
    assert len(ours) == sum(len(q[1]) for q in QUESTIONS) + 4 + len(reference["samples"]["tiny_ll"])
    check_close(label, relative_errors(output, reference), BOUND)


def _case_evaluate(root: str, mp: int, limit, source: str = "ckpt") -> dict:
    from hybridpar.evaluate import evaluate_checkpoint
    from tests.distributed import parallel_dims

    output = evaluate_checkpoint(Path(root) / source, COMPARED, include_path=str(Path(root) / "tasks"), limit=limit,
                                 log_samples=True, parallel=parallel_dims(mp=mp), batch_tokens=100)
    return None if output is None else {k: output[k] for k in ("results", "samples", "step", "versions")}


@pytest.mark.slow
@pytest.mark.parametrize("mp,source", [(2, "ckpt"), (1, "hf")], ids=["mp2", "dp2-hf-folder"])
def test_eval_at_mp_2_and_dp_2_equals_the_harness_on_the_export(workers, saved, reference, check_close, mp, source):
    """hybridpar's checkpoint at mp 2, and the Hugging Face export itself (its tokenizer from the folder) at dp 2."""
    results = workers(2).run(_case_evaluate, str(saved), mp, None, source)
    assert results[1] is None, "only rank 0 returns the harness's output"
    output = results[0]
    assert output["step"] == (STEP if source == "ckpt" else None) and output["versions"]["tiny_ppl"] == 2.0
    _compare(output, reference, check_close, f"{source} at mp{mp} x dp{2 // mp} vs lm-eval hf")


@pytest.mark.slow
def test_eval_at_mp_2_x_dp_2_equals_the_harness_on_the_export(workers, saved, reference, check_close):
    output = workers(4).run(_case_evaluate, str(saved), 2, None)[0]
    _compare(output, reference, check_close, "mp2 x dp2 vs lm-eval hf")


def _env() -> dict:
    return {"OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"], "PYTHONPATH": child_pythonpath(),
            "HOME": os.environ.get("HOME", "/tmp"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_the_command_at_world_1_prints_the_table_and_writes_the_json(saved, reference, tmp_path):
    """`hybridpar eval` alone (a world of one), as a user runs it: the harness's table on stdout, and the
    JSON with every metric, its stderr, the task versions and the checkpoint's step."""
    out = subprocess.run([sys.executable, "-m", "hybridpar", "eval", str(saved / "ckpt"), "--tasks", TASKS,
                          "--include-path", str(saved / "tasks"), "--json", str(tmp_path / "eval.json")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{saved / 'ckpt'} (step {STEP})" in out.stdout and "|Tasks" in out.stdout.replace(" ", ""), out.stdout
    _said_once(out.stderr)
    for name in ("tiny_mc", "tiny_ppl", "acc_norm", "word_perplexity", "bits_per_byte"):
        assert name in out.stdout, (name, out.stdout)
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["step"] == STEP and written["checkpoint"] == str(saved / "ckpt")
    assert written["versions"] == {"tiny_mc": 1.0, "tiny_ppl": 2.0, "tiny_gen": 1.0}
    mine, theirs = written["results"], reference["results"]
    for metric in ("acc,none", "acc_norm,none", "acc_stderr,none"):
        assert mine["tiny_mc"][metric] == theirs["tiny_mc"][metric], metric
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert abs(mine["tiny_ppl"][metric] / theirs["tiny_ppl"][metric] - 1) < BOUND, metric


def _said_once(stderr: str) -> None:
    """The tokenizer's line once, and nothing from git: the command runs outside a repository (its cwd)."""
    assert [line.startswith("tokenizer: ") for line in stderr.splitlines()].count(True) == 1, stderr[-3000:]
    assert "not a git repository" not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_the_command_under_torchrun_says_each_line_once(saved, tmp_path):
    """At mp 2 over 2 ranks: the tokenizer's line and the table once (rank 0's), no word from lm-eval's
    probe of git."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                          "hybridpar", "eval", str(saved / "ckpt"), "--mp", "2", "--tasks", "tiny_mc",
                          "--include-path", str(saved / "tasks")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count(f"{saved / 'ckpt'} (step {STEP})") == 1 and out.stdout.count("|tiny_mc") == 1, out.stdout
    _said_once(out.stderr)


def _hub_task(folder: Path) -> Path:
    """A task over a Hugging Face dataset this machine has never downloaded."""
    folder.mkdir()
    (folder / "tiny_hub.yaml").write_text("task: tiny_hub\ndataset_path: nobody/not_cached_here\ntest_split: test\n"
                                          "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: \"{{c}}\"\n"
                                          "doc_to_target: 0\n")
    return folder


@pytest.mark.slow
def test_a_task_whose_data_is_not_here_is_one_line_before_the_model_loads(saved, tmp_path):
    import shutil

    # The checkpoint without its weights: loading it would fail otherwise.
    ckpt = tmp_path / "ckpt" / f"step-{STEP:08d}"
    shutil.copytree(saved / "ckpt" / ckpt.name, ckpt)
    for shard in ckpt.glob("*.distcp"):
        shard.unlink()
    out = subprocess.run([sys.executable, "-m", "hybridpar", "eval", str(ckpt), "--tasks", "tiny_hub",
                          "--include-path", str(_hub_task(tmp_path / "tasks"))],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("hybridpar: error: task tiny_hub: its dataset cannot be loaded (HF_DATASETS_OFFLINE is "
                           "set) ("), line
    assert "HF_DATASETS_OFFLINE=1" in line and "Hugging Face cache" in line and "--include-path" in line, line


def test_several_tasks_that_cannot_run_are_one_line_each(tmp_path, capsys):
    from lm_eval.tasks import TaskManager

    from hybridpar.config.options import ConfigError
    from hybridpar.evaluate.tasks import check_tasks

    manager = TaskManager(include_path=str(_hub_task(tmp_path / "tasks")), include_defaults=False)
    with pytest.raises(ConfigError) as refused:
        check_tasks(["no_such_task", "tiny_hub"], manager)
    assert str(refused.value) == "2 of the tasks cannot be evaluated (one line each above): no_such_task, tiny_hub"
    unknown, hub = [line for line in capsys.readouterr().err.splitlines() if line.startswith("task ")]
    assert unknown == ("task no_such_task is not known to lm-eval: check its name (lm-eval ls tasks), or give the "
                       "folder of its task file with --include-path")
    assert hub.startswith("task tiny_hub: its dataset cannot be loaded") and "--include-path" in hub


def test_without_lm_eval_the_command_says_how_to_install_it(tmp_path):
    script = ("import sys\nsys.modules['lm_eval'] = None  # as if not installed\n"
              "from hybridpar.cli import main\n"
              f"sys.exit(main(['eval', {str(tmp_path)!r}, '--tasks', 'hellaswag']))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip() == ("hybridpar: error: hybridpar eval needs lm-evaluation-harness, which is not "
                                  "installed: pip install -e '.[eval]' (or pip install lm-eval)"), out.stderr


@pytest.mark.slow
def test_lm_evals_own_command_line_runs_the_hybridpar_model(saved, reference, tmp_path):
    """`python -m hybridpar.evaluate`: lm-eval's command line with the model registered as `hybridpar`."""
    out = subprocess.run([sys.executable, "-m", "hybridpar.evaluate", "--model", "hybridpar", "--model_args",
                          f"checkpoint={saved / 'ckpt'}", "--tasks", "tiny_mc", "--include_path", str(saved / "tasks"),
                          "--output_path", str(tmp_path / "out")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    written = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    for metric in ("acc,none", "acc_norm,none"):
        assert written["results"]["tiny_mc"][metric] == reference["results"]["tiny_mc"][metric], metric


def _case_scoring_pieces() -> dict:
    """The argmax over vocabulary shards against torch's over the whole (ties across the shards
    included), at mp 2; and score() at dp 2: each rank runs part of the requests, all get every result."""
    import torch
    import torch.distributed as dist

    from hybridpar.evaluate.scoring import batches_by_length, score, vocab_parallel_argmax
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from tests.distributed import parallel_dims

    full = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    full[0, 0, 3] = full[0, 0, 12] = 9.0  # a tie across the shards: the lower id wins
    full[0, 1, 9] = full[0, 1, 14] = 9.0  # a tie inside the second shard
    full[1, 2, :] = 0.0  # all equal: id 0
    parallel = parallel_dims(mp=2)
    local = full.chunk(2, dim=-1)[parallel.mp_rank]
    argmax_same = bool(torch.equal(vocab_parallel_argmax(local, parallel), full.argmax(dim=-1)))
    dp = parallel_dims(mp=1)
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_preset("debug"), dp)
    rows = []
    model.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    requests = [([1 + (i * 7 + j) % 100 for j in range(4 + i % 5)], 1 + i % 3) for i in range(12)]
    scores = score(model, dp, requests, batch_tokens=16)
    shared = sum(rows)
    alone = [score_one for r in requests for score_one in _alone(model, r)]
    dist.barrier()
    batches = batches_by_length([len(t) for t, _ in requests], 16)
    repeat = len(batches[-1]) if len(batches) % 2 else 0  # the rank short of a batch repeats the last
    return {"argmax": argmax_same, "rows": shared, "scores": scores, "alone": alone, "repeat": repeat}


def _alone(model, request):
    from hybridpar.evaluate.scoring import score_batch
    from tests.distributed import parallel_dims

    return score_batch(model, parallel_dims(mp=1), [request])


def test_scoring_takes_the_argmax_from_shards_and_shares_requests_over_dp(workers):
    results = workers(2).run(_case_scoring_pieces)
    assert all(r["argmax"] for r in results)
    assert all(0 < r["rows"] < 12 for r in results), results
    assert sum(r["rows"] for r in results) == 12 + results[0]["repeat"], results
    assert results[0]["scores"] == results[1]["scores"]
    for (got, greedy), (alone, alone_greedy) in zip(results[0]["scores"], results[0]["alone"]):
        assert abs(got - alone) <= 1e-5 * abs(alone) and greedy == alone_greedy  # batched with padding, or alone
