"""Mistakes in what is asked of an evaluation, each one line before any model loads, naming what the user
wrote (`hybridpar eval`'s flag, or the [eval] section's key); and lm-eval's own command line with
hybridpar's model (`python -m hybridpar.evaluate`) saying its mistakes as `hybridpar eval` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import child_pythonpath
from tests.evaluate.local_tasks import QUESTIONS, write_tasks

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")


@pytest.fixture(scope="module")
def weightless(tmp_path_factory) -> Path:
    """A hybridpar checkpoint's folder without its weights (loading it fails: a refusal that comes
    first comes before the model loads), recording its run's tokenizer; the local task files, and
    one more multiple-choice task that draws its few-shot examples from the questions themselves."""
    from hybridpar.data import default_corpus_documents, train_tokenizer

    root = tmp_path_factory.mktemp("refusals")
    documents = list(default_corpus_documents(max_documents=100))
    tokenizer = train_tokenizer(documents, 600, root / "tokenizer.model")
    step = root / "ckpt" / "step-00000003"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "params.json").write_text("{}")
    recorded = {"path": str(tokenizer.path), "sha256": tokenizer.sha256}
    (step / "train_state.json").write_text(json.dumps({"step": 3, "tokenizer": recorded}))
    write_tasks(root / "tasks", documents[:4])
    mc = (root / "tasks" / "tiny_mc.yaml").read_text()
    (root / "tasks" / "tiny_mc_self.yaml").write_text(mc.replace("task: tiny_mc", "task: tiny_mc_self")
                                                      + "fewshot_split: test\n")
    return root


def _env() -> dict:
    return {"OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"], "PYTHONPATH": child_pythonpath(),
            "HOME": os.environ.get("HOME", "/tmp"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


# --- --limit and --num-fewshot ------------------------------------------------------------------


@pytest.mark.parametrize("flags,line", [
    (["--limit", "0"], "--limit must be a whole number of documents or a share below 1, above 0 (leave --limit "
                       "out for every document), got 0"),
    (["--limit", "-1"], "--limit must be a whole number of documents or a share below 1, above 0 (leave --limit "
                        "out for every document), got -1"),
    (["--limit", "2.5"], "--limit must be a whole number of documents or a share below 1, above 0 (leave --limit "
                         "out for every document), got 2.5"),
    (["--num-fewshot", "-1"], "--num-fewshot must be 0 or more examples (leave --num-fewshot out for each task's "
                              "own), got -1"),
], ids=["limit 0", "limit -1", "limit 2.5", "num-fewshot -1"])
def test_a_limit_or_few_shot_count_out_of_range_is_one_line_naming_the_flag(weightless, capsys, flags, line):
    from hybridpar.cli import main

    assert main(["eval", str(weightless / "ckpt"), "--tasks", "tiny_mc", "--include-path", str(weightless / "tasks"),
                 *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [f"hybridpar: error: {line}"]


def test_the_eval_sections_limit_and_few_shot_count_are_refused_naming_the_key():
    from hybridpar.config import ConfigError, load_config

    for flag, value, line in [
        ("eval.limit", "-1", "eval.limit must be 0 (every document), a whole number of documents or a share below 1, "
                             "got -1"),
        ("eval.num_fewshot", "-2", "eval.num_fewshot must be 0 or more examples (-1: each task's own), got -2"),
    ]:
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"--{flag}", value])
        assert str(refused.value) == line
    config = load_config(None, ["--eval.limit", "0", "--eval.num_fewshot", "-1"])
    assert config.eval.harness_limit() is None and config.eval.harness_fewshot() is None


def test_more_few_shot_examples_than_a_task_has_is_one_line_naming_the_task_its_pool_and_the_setting(weightless):
    """The pool is what lm-eval samples from: tiny_mc's 6 questions; tiny_mc_self's 5, as it draws from the
    evaluated split and leaves the question itself out. lm-eval builds every prompt at that many
    examples and fails at one more (so the check refuses exactly what would fail later)."""
    from lm_eval.tasks import TaskManager

    from hybridpar.config import ConfigError
    from hybridpar.config.evaluation import CONFIG_KEYS
    from hybridpar.evaluate.tasks import check_tasks

    manager = TaskManager(include_path=str(weightless / "tasks"), include_defaults=False)
    for name, pool in (("tiny_mc", len(QUESTIONS)), ("tiny_mc_self", len(QUESTIONS) - 1)):
        with pytest.raises(ConfigError) as refused:
            check_tasks([name], manager, num_fewshot=10)
        assert str(refused.value) == (f"task {name} has {pool} documents to draw few-shot examples from, fewer than "
                                      f"--num-fewshot 10: give --num-fewshot {pool} or fewer")
        with pytest.raises(ConfigError) as refused:
            check_tasks([name], manager, num_fewshot=pool + 1, named=CONFIG_KEYS)
        assert str(refused.value).endswith(f"fewer than eval.num_fewshot {pool + 1}: give eval.num_fewshot {pool} or "
                                           "fewer")
        assert check_tasks([name], manager, num_fewshot=pool) == {name: {"multiple_choice"}}
        task = manager.load([name])["tasks"][name]
        docs = list(task.eval_docs)
        assert all(task.fewshot_context(doc, num_fewshot=pool) for doc in docs)
        with pytest.raises(ValueError, match="Sample larger than population"):
            task.fewshot_context(docs[0], num_fewshot=pool + 1)


@pytest.mark.slow
def test_the_command_refuses_too_many_few_shot_examples_before_the_model_loads(weightless, tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybridpar", "eval", str(weightless / "ckpt"), "--tasks", "tiny_mc",
                          "--include-path", str(weightless / "tasks"), "--num-fewshot", "10"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("hybridpar:")]
    assert said == ["hybridpar: error: task tiny_mc has 6 documents to draw few-shot examples from, fewer than "
                    "--num-fewshot 10: give --num-fewshot 6 or fewer"], out.stderr[-3000:]


# --- the folder of task files ------------------------------------------------------------------------


def test_a_task_not_in_the_folder_of_task_files_names_the_users_setting(tmp_path):
    """`hybridpar eval`'s --include-path, or the [eval] section's eval.include_path; an empty folder says so."""
    from lm_eval.tasks import TaskManager

    from hybridpar.config import ConfigError
    from hybridpar.config.evaluation import CONFIG_KEYS
    from hybridpar.evaluate.tasks import check_tasks, task_manager

    empty = tmp_path / "tasks"
    empty.mkdir()
    manager = TaskManager(include_path=str(empty), include_defaults=False)
    for named, setting in ((None, "--include-path"), (CONFIG_KEYS, "eval.include_path")):
        with pytest.raises(ConfigError) as refused:
            check_tasks(["tiny_mc"], manager, include_path=str(empty), **({"named": named} if named else {}))
        assert str(refused.value) == (f"task tiny_mc is not known to lm-eval: check its name (lm-eval ls tasks), or "
                                      f"give the folder of its task file with {setting} ({empty} holds no task file: "
                                      "*.yaml)")
        with pytest.raises(ConfigError) as refused:
            task_manager(str(tmp_path / "nowhere"), ["tiny_mc"], **({"named": named} if named else {}))
        assert str(refused.value) == (f"{setting} {tmp_path / 'nowhere'} is not a folder; give the folder holding "
                                      "your task files")


# --- lm-eval's command line with hybridpar's model ------------------------------------------------


def _lm_eval_command(tmp_path: Path, tasks: Path, ranks: int) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={ranks}"]
    return subprocess.run([*launcher, "-m", "hybridpar.evaluate", "--model", "hybridpar", "--model_args",
                           "checkpoint=missing", "--tasks", "tiny_mc", "--include_path", str(tasks)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_lm_evals_command_line_says_a_missing_checkpoint_as_hybridpar_eval_does(weightless, tmp_path, monkeypatch,
                                                                              capsys, ranks):
    """One line, once (under torchrun too: no rank's traceback, only torchrun's own summary), exit code 2
    alone as `hybridpar eval`'s; and the same line as `hybridpar eval` says (its main, in this process:
    what `python -m hybridpar` exits with, without a second process importing torch and lm-eval)."""
    from hybridpar.cli import main

    out = _lm_eval_command(tmp_path, weightless / "tasks", ranks)
    said = [line for line in out.stderr.splitlines() if line.startswith("hybridpar:")]
    assert said == ["hybridpar: error: missing does not exist"], out.stderr[-3000:]
    assert out.stderr.count("Traceback") == (0 if ranks == 1 else 1), out.stderr[-3000:]  # torchrun's, at 2 ranks
    assert out.returncode == (2 if ranks == 1 else 1), out.stderr[-3000:]  # torchrun exits 1 when a rank fails
    if ranks == 1:
        monkeypatch.chdir(tmp_path)  # "missing", relative to where the command runs
        capsys.readouterr()
        code = main(["eval", "missing", "--tasks", "tiny_mc", "--include-path", str(weightless / "tasks")])
        err = capsys.readouterr().err
        assert (code, err.strip()) == (2, said[0]), err[-3000:]
