"""Evaluate a checkpoint of any kind hybridpar reads, at any mesh: the tasks checked first (rank 0),
the model loaded as `hybridpar generate` loads it, then the harness run by rank 0 over HybridparLM."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from ..config.options import ConfigError
from ..mesh.ranks import on_rank0
from .loading import checkpoint_tokenizer, load
from ..config.evaluation import require_lm_eval
from .tasks import check_tasks, task_manager, task_names


def evaluate_checkpoint(checkpoint: str | Path, tasks: str | Sequence[str], *, mp: int = 1,
                        tokenizer: Optional[str] = None, include_path: Optional[str] = None,
                        limit: Optional[float] = None, num_fewshot: Optional[int] = None, dtype: Optional[str] = None,
                        batch_tokens: Optional[int] = None, add_bos_token: bool = False, log_samples: bool = False,
                        parallel=None) -> Optional[dict]:
    """Run lm-evaluation-harness's tasks on a checkpoint. Collective: every rank calls it; rank 0 gets the
    harness's output (its `results`, `versions`, `n-shot`, ... and `samples` with log_samples) with
    `checkpoint` and `step` added, the others None. The tasks are checked on rank 0 before the model
    loads (ConfigError on every rank, one line per task that cannot run)."""
    require_lm_eval()
    names = task_names(tasks)
    tokenizer = str(checkpoint_tokenizer(checkpoint, tokenizer))  # refused before the work when there is none
    from ..mesh.device import init_parallel

    parallel = parallel or init_parallel(mp=mp)
    manager = None

    def check() -> None:
        nonlocal manager
        manager = task_manager(include_path, names)
        check_tasks(names, manager)

    on_rank0(check, "check the tasks", error_type=ConfigError)
    from .backend import HybridparLM

    loaded = load(checkpoint, tokenizer=tokenizer, dtype=dtype, parallel=parallel)
    lm = HybridparLM(loaded=loaded, add_bos_token=add_bos_token, **({"batch_tokens": batch_tokens} if batch_tokens else {}))
    output = run_harness(lm, names, manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples)
    if output is not None:
        output.update(checkpoint=str(checkpoint), step=loaded.step)
    return output


def run_harness(lm, names: Sequence[str], manager, **options) -> Optional[dict]:
    """lm-eval's simple_evaluate(**options) over the HybridparLM `lm`, collective: rank 0 runs the
    harness while the other ranks serve its commands; rank 0 gets the harness's output, the others
    None. A failure on rank 0 releases the others, which raise too."""
    if lm.loaded.parallel.rank != 0:
        lm.serve()
        return None
    from lm_eval.evaluator import simple_evaluate

    try:
        output = simple_evaluate(model=lm, tasks=list(names), task_manager=manager, **options)
    except BaseException as err:
        lm.stop(err)
        raise
    lm.stop()
    return dict(output or {})


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
