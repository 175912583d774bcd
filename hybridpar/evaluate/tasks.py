"""Before any model loads: lm-evaluation-harness is installed, and every task asked for is known and
its data can be read here (offline, a cluster's usual state). One line per problem, naming the task
and how to make it available."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ..config.evaluation import COMMAND_FLAGS, EvalNames, split_task_names
from ..config.options import ConfigError
from ..progress import note


def offline_advice(named: EvalNames) -> str:
    """How to make a task's data readable here, naming the user's setting for a folder of task files."""
    return ("make it available offline: run once with network so the dataset is in the Hugging Face cache, then set "
            "HF_DATASETS_OFFLINE=1; or write a local task file (a YAML with dataset_path: json over a local file) and "
            f"give its folder with {named.include_path} (docs/evaluation.md)")


def task_names(tasks: str | Sequence[str], named: EvalNames = COMMAND_FLAGS) -> list[str]:
    """"a,b" or ["a", "b"] as a list of names (empty ones dropped)."""
    names = split_task_names(tasks)
    if not names:
        raise ConfigError(f"no task given: name at least one with {named.tasks} (lm-eval's names, or a local task's)")
    return names


def task_manager(include_path: Optional[str] = None, names: Sequence[str] = (), named: EvalNames = COMMAND_FLAGS):
    """lm-eval's TaskManager over the task files under include_path, and over lm-eval's own tasks unless
    every one of `names` is among those files (indexing lm-eval's ~15,000 task files takes seconds)."""
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise ConfigError(f"{named.include_path} {include_path} is not a folder; give the folder holding your task "
                          "files")
    if include_path and names:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    return TaskManager(include_path=include_path or None)


def check_tasks(names: Sequence[str], manager, *, num_fewshot: Optional[int] = None, include_path: Optional[str] = None,
                named: EvalNames = COMMAND_FLAGS) -> dict[str, set[str]]:
    """Every task is known and builds here (its dataset read), and has the few-shot examples it is to be
    shown (num_fewshot as lm-eval takes it: None, each task's own); ConfigError naming each one that
    does not, and the user's setting (`named`: a command's flags or the config's keys). Each name's
    output types (loglikelihood, multiple_choice, generate_until, ...: a group's tasks' all)."""
    problems, kinds = [], {}
    for name in names:
        if name not in manager.all_tasks and not (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            problems.append((name, f"task {name} is not known to lm-eval: check its name (lm-eval ls tasks), or give the "
                            f"folder of its task file with {named.include_path}{_no_task_files(include_path)}"))
            continue
        try:
            loaded = manager.load([name])
            kinds[name] = {task.OUTPUT_TYPE for task in loaded["tasks"].values()}
        except Exception as err:  # noqa: BLE001 - any failure to read the data is the same advice
            reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            offline = " (HF_DATASETS_OFFLINE is set)" if os.environ.get("HF_DATASETS_OFFLINE") else ""
            problems.append((name, f"task {name}: its dataset cannot be loaded{offline} ({reason}); "
                                   f"{offline_advice(named)}"))
            continue
        short = _fewshot_short(name, loaded["tasks"], num_fewshot, named)
        if short:
            problems.append((name, short))
    if len(problems) > 1:
        for _, line in problems:
            note(line)
        raise ConfigError(f"{len(problems)} of the tasks cannot be evaluated (one line each above): "
                          f"{', '.join(name for name, _ in problems)}")
    if problems:
        raise ConfigError(problems[0][1])
    return kinds


def generate_at_ep(what: str, at: str, instead: str) -> str:
    """The line refusing generation (`what`: the tasks, or the harness's requests) at expert parallelism
    (`at`: the user's setting of it, as "--ep 2"; `instead`: the same at 1)."""
    # Each data-parallel rank generates its own prompts for its own number of steps; the ep ranks must
    # run every forward together (their tokens go to each other's experts).
    return (f"{what} generate text (generate_until), which hybridpar eval does not run at {at}: the ep ranks run "
            f"every forward together and generation runs each rank's own number of steps; score them at {instead} "
            "(each rank holding every expert)")


def check_expert_parallel(names: Sequence[str], kinds: dict[str, set[str]], ep: int) -> None:
    """ConfigError naming the tasks of `names` that generate text when ep > 1 (kinds: check_tasks')."""
    generating = [name for name in names if "generate_until" in kinds[name]]
    if ep > 1 and generating:
        raise ConfigError(generate_at_ep(f"--tasks: {', '.join(generating)}", f"--ep {ep}", "--ep 1"))


def _no_task_files(include_path: Optional[str]) -> str:
    """What a folder of task files without any says ("" for one that has some, or none given)."""
    if include_path and not any(Path(include_path).rglob("*.yaml")):
        return f" ({include_path} holds no task file: *.yaml)"
    return ""


def fewshot_of(task, num_fewshot: Optional[int]) -> int:
    """The examples lm-eval shows before each of the task's questions: num_fewshot unless the task's
    file sets 0 (which lm-eval keeps), else the task's own (0 when it has none)."""
    own = task.get_config("num_fewshot")
    return num_fewshot if num_fewshot is not None and own != 0 else own or 0


def fewshot_pool(task) -> int:
    """How many documents lm-eval can draw a task's few-shot examples from: its sampler's documents,
    less the question itself when they come from the evaluated split (lm-eval then draws one more and
    drops the question)."""
    sampler = getattr(task, "sampler", None)
    docs = sampler.fewshot_docs() if sampler is not None else task.fewshot_docs()
    size = 0 if docs is None else len(docs) if hasattr(docs, "__len__") else sum(1 for _ in docs)
    fewshot = getattr(task, "fewshot_cfg", None)
    if fewshot is not None and fewshot.split == task.config.test_split:
        size -= 1
    return max(size, 0)


def _fewshot_short(name: str, tasks: dict, num_fewshot: Optional[int], named: EvalNames) -> str:
    """The line refusing `name` (a task, or a group of `tasks`) when one of its tasks has fewer documents
    than the few-shot examples it is to show: the one with fewest; "" when every one has enough."""
    short = []
    for task_name, task in tasks.items():
        shots = fewshot_of(task, num_fewshot)
        pool = fewshot_pool(task) if shots > 0 else 0
        if shots > pool:
            short.append((pool, shots, task_name))
    if not short:
        return ""
    pool, shots, task_name = min(short)
    asked = f"{named.num_fewshot} {shots}" if num_fewshot is not None else f"the {shots} its task file asks for"
    fewer = f"{named.num_fewshot} {pool}" + (" or fewer" if pool else "")
    more = f" ({len(short) - 1} more of {name}'s tasks too)" if len(short) > 1 else ""
    return (f"task {task_name} has {pool} documents to draw few-shot examples from, fewer than {asked}: give "
            f"{fewer}{more}")
