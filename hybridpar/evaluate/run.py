"""Evaluate a checkpoint of any kind hybridpar reads, at any mesh: the settings and tasks checked first
(rank 0), the model loaded as `hybridpar generate` loads it, then the harness run by rank 0 over HybridparLM."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ..config.evaluation import COMMAND_FLAGS, harness_fewshot, harness_limit, require_lm_eval
from ..config.options import ConfigError
from ..mesh.ranks import on_rank0
from .loading import checkpoint_tokenizer, load
from .tasks import check_expert_parallel, check_tasks, fewshot_of, task_manager, task_names


def evaluate_checkpoint(checkpoint: str | Path, tasks: str | Sequence[str], *, mp: int = 1, ep: int = 1,
                        tokenizer: Optional[str] = None, include_path: Optional[str] = None,
                        limit: Optional[float] = None, num_fewshot: Optional[int] = None, dtype: Optional[str] = None,
                        batch_tokens: Optional[int] = None, add_bos_token: Optional[bool] = None,
                        log_samples: bool = False, parallel=None) -> Optional[dict]:
    """Run lm-evaluation-harness's tasks on a checkpoint. Collective: every rank calls it; rank 0 gets the
    harness's output (its `results`, `versions`, `n-shot`, ... and `samples` with log_samples) with
    `checkpoint` and `step` added, the others None. The settings are `hybridpar eval`'s (limit: None,
    N >= 1 documents or a share below 1; num_fewshot: None for each task's own, or K >= 0). Before the
    model loads, rank 0 finds the tokenizer and checks the tasks (a ConfigError on every rank, one line
    per task that cannot run, said once). ep > 1 splits a mixture of experts' experts over ep of the
    data-parallel ranks (generating tasks refused); add_bos_token None: as the tokenizer's own default
    encoding (Tokenizer.adds_bos), as the harness's Hugging Face backend encodes."""
    require_lm_eval()
    names = task_names(tasks)
    limit = harness_limit(limit, COMMAND_FLAGS.limit, zero_is_all=False)
    num_fewshot = harness_fewshot(num_fewshot, COMMAND_FLAGS.num_fewshot)
    from ..mesh.device import init_parallel

    parallel = parallel or init_parallel(mp=mp, ep=ep)
    manager = None

    def check() -> str:
        nonlocal manager
        found = str(checkpoint_tokenizer(checkpoint, tokenizer))  # refused before the work when there is none
        manager = task_manager(include_path, names)
        kinds = check_tasks(names, manager, num_fewshot=num_fewshot, include_path=include_path)
        check_expert_parallel(names, kinds, parallel.ep)
        return found

    tokenizer = on_rank0(check, "check the tasks", error_type=ConfigError)
    from .backend import HybridparLM

    loaded = load(checkpoint, tokenizer=tokenizer, dtype=dtype, parallel=parallel)
    lm = HybridparLM(loaded=loaded, add_bos_token=add_bos_token, **({"batch_tokens": batch_tokens} if batch_tokens else {}))
    output = run_harness(lm, names, manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples)
    if output is not None:
        output.update(checkpoint=str(checkpoint), step=loaded.step)
    return output


def run_harness(lm, names: Sequence[str], manager, *, limit=None, num_fewshot: Optional[int] = None,
                log_samples: bool = False) -> Optional[dict]:
    """lm-eval's tasks `names` (from its TaskManager `manager`) over the HybridparLM `lm`, collective:
    rank 0 runs the harness while the other ranks serve its commands; rank 0 gets the harness's output,
    the others None. A failure on rank 0 releases the others, which raise too."""
    if lm.loaded.parallel.rank != 0:
        lm.serve()
        return None
    try:
        output = _harness(lm, names, manager, limit, num_fewshot, log_samples)
    except BaseException as err:
        lm.stop(err)
        raise
    lm.stop()
    return dict(output or {})


def _harness(lm, names: Sequence[str], manager, limit, num_fewshot: Optional[int], log_samples: bool):
    """What lm-eval's simple_evaluate does for a model already built, through its evaluate(): the same
    seeds and the same few-shot settings, without simple_evaluate's account of the machine, which runs
    `git describe` (its "fatal: not a git repository" reaching the terminal outside a repository) and
    torch's collect_env (seconds of subprocesses) for entries of its output nobody reads here."""
    import random

    import numpy as np
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    loaded = manager.load(list(names))
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=fewshot_of(task, num_fewshot))
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    return evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=log_samples)


def results_json(output: dict) -> dict:
    """What `hybridpar eval --json` writes: the harness's results (every metric with its stderr), groups,
    task versions, n-shot and configs' names, with the checkpoint and its step."""
    keep = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples")
    shown = {key: output[key] for key in keep if key in output}
    return {"checkpoint": output.get("checkpoint"), "step": output.get("step"), **shown}


def results_table(output: dict) -> str:
    """The harness's own table(s) of the results."""
    from lm_eval.utils import make_table

    text = make_table(output)
    if output.get("groups"):
        text += "\n" + make_table(output, "groups")
    return text
