"""Before any model loads: lm-evaluation-harness is installed, and every task asked for is known and
its data can be read here (offline, a cluster's usual state). One line per problem, naming the task
and how to make it available."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ..config.evaluation import split_task_names
from ..config.options import ConfigError
from ..progress import note

OFFLINE_ADVICE = ("make it available offline: run once with network so the dataset is in the Hugging Face cache, "
                  "then set HF_DATASETS_OFFLINE=1; or write a local task file (a YAML with dataset_path: json over a "
                  "local file) and give its folder with --include-path (docs/evaluation.md)")


def task_names(tasks: str | Sequence[str]) -> list[str]:
    """"a,b" or ["a", "b"] as a list of names (empty ones dropped)."""
    names = split_task_names(tasks)
    if not names:
        raise ConfigError("no task given: name at least one with --tasks (lm-eval's names, or a local task's)")
    return names


def task_manager(include_path: Optional[str] = None, names: Sequence[str] = ()):
    """lm-eval's TaskManager over the task files under include_path, and over lm-eval's own tasks unless
    every one of `names` is among those files (indexing lm-eval's ~15,000 task files takes seconds)."""
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path} is not a folder; give the folder holding your task files")
    if include_path and names:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    return TaskManager(include_path=include_path or None)


def check_tasks(names: Sequence[str], manager) -> dict[str, set[str]]:
    """Every task is known and builds here (its dataset read); ConfigError naming each one that does not.
    Each name's output types (loglikelihood, multiple_choice, generate_until, ...: a group's tasks' all)."""
    problems, kinds = [], {}
    for name in names:
        if name not in manager.all_tasks and not (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            problems.append((name, f"task {name} is not known to lm-eval: check its name (lm-eval ls tasks), or give the "
                            "folder of its task file with --include-path"))
            continue
        try:
            loaded = manager.load([name])
            kinds[name] = {task.OUTPUT_TYPE for task in loaded["tasks"].values()}
        except Exception as err:  # noqa: BLE001 - any failure to read the data is the same advice
            reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            offline = " (HF_DATASETS_OFFLINE is set)" if os.environ.get("HF_DATASETS_OFFLINE") else ""
            problems.append((name, f"task {name}: its dataset cannot be loaded{offline} ({reason}); {OFFLINE_ADVICE}"))
    if len(problems) > 1:
        for _, line in problems:
            note(line)
        raise ConfigError(f"{len(problems)} of the tasks cannot be evaluated (one line each above): "
                          f"{', '.join(name for name, _ in problems)}")
    if problems:
        raise ConfigError(problems[0][1])
    return kinds
