"""The [eval] config section, without torch: lm-evaluation-harness's tasks run on the model being trained,
every `every` steps and after the last one (hybridpar.train.downstream runs them)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import NamedTuple, Optional, Union

from .options import ConfigError, option

INSTALL = "pip install -e '.[eval]' (or pip install lm-eval)"

# Tokens per forward when scoring (batch x padded length): a batch of short requests holds many of them.
DEFAULT_BATCH_TOKENS = 8192


class EvalNames(NamedTuple):
    """What the user wrote for each setting, so that a refusal names it: `hybridpar eval`'s flags
    (COMMAND_FLAGS), or the [eval] section's keys (CONFIG_KEYS) for the evaluations of a training run."""
    tasks: str
    include_path: str
    limit: str
    num_fewshot: str


COMMAND_FLAGS = EvalNames("--tasks", "--include-path", "--limit", "--num-fewshot")
CONFIG_KEYS = EvalNames("eval.tasks", "eval.include_path", "eval.limit", "eval.num_fewshot")


def harness_limit(limit: Optional[float], name: str, *, zero_is_all: bool) -> Union[None, float, int]:
    """A limit of documents per task as lm-eval takes it: None (every document), a share below 1 or a
    whole count; ConfigError naming `name` for anything else. 0 is every document where zero_is_all
    (the [eval] section's default); a flag says that by being left out, and its 0 is refused."""
    if limit is None or (zero_is_all and limit == 0):
        return None
    if 0 < limit < 1:
        return float(limit)
    if limit >= 1 and limit == int(limit):
        return int(limit)
    if zero_is_all:
        raise ConfigError(f"{name} must be 0 (every document), a whole number of documents or a share below 1, "
                          f"got {limit:g}")
    raise ConfigError(f"{name} must be a whole number of documents or a share below 1, above 0 (leave {name} out "
                      f"for every document), got {limit:g}")


def harness_fewshot(num_fewshot: Optional[int], name: str, *, own: Optional[int] = None) -> Optional[int]:
    """Few-shot examples as lm-eval takes them: None (each task's own) for None or `own` (the [eval]
    section's -1), else a count of 0 or more; ConfigError naming `name` below that."""
    if num_fewshot is None or num_fewshot == own:
        return None
    if num_fewshot < 0:
        own_is = f"{own}: each task's own" if own is not None else f"leave {name} out for each task's own"
        raise ConfigError(f"{name} must be 0 or more examples ({own_is}), got {num_fewshot}")
    return int(num_fewshot)


def split_task_names(tasks) -> list[str]:
    """"a,b" or ["a", "b"] (or ["a,b"]) as a list of names, empty ones dropped; a list written out on
    the command line ("[]", "['a', 'b']": a config's values given back as flags) as that list."""
    if isinstance(tasks, str) and tasks.strip().startswith("[") and tasks.strip().endswith("]"):
        tasks = tasks.strip()[1:-1]
    names = tasks.split(",") if isinstance(tasks, str) else [t for n in tasks for t in str(n).split(",")]
    return [n.strip().strip("'\"") for n in names if n.strip().strip("'\"")]


@dataclasses.dataclass
class EvalConfig:
    tasks: list = option(list, "lm-evaluation-harness tasks to run on the model in training, e.g. "
                               "[\"arc_easy\", \"hellaswag\"] or \"arc_easy,hellaswag\" (empty: none)")
    every: int = option(0, "steps between downstream evaluations, and after the last step (0: after the last only)")
    limit: float = option(0.0, "documents per task: 0 all of them, N >= 1 the first N, below 1 that share")
    num_fewshot: int = option(-1, "few-shot examples per prompt (-1: each task's own)")
    include_path: str = option("", "a folder of task files of your own (a YAML over a local JSON file runs "
                                   "without network; \"\": none)")
    batch_tokens: int = option(DEFAULT_BATCH_TOKENS, "tokens per scoring forward (requests x padded length)")

    def validate(self) -> None:
        """ConfigError naming the eval.* key; eval.tasks given as "a,b" becomes a list."""
        self.tasks = split_task_names(self.tasks)
        for key, low in (("every", 0), ("batch_tokens", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"eval.{key} must be >= {low}, got {getattr(self, key)}")
        self.harness_limit()
        self.harness_fewshot()

    def harness_limit(self) -> Union[None, float, int]:
        """eval.limit as lm-eval takes it: None, a share, or a count."""
        return harness_limit(self.limit, CONFIG_KEYS.limit, zero_is_all=True)

    def harness_fewshot(self) -> Optional[int]:
        return harness_fewshot(self.num_fewshot, CONFIG_KEYS.num_fewshot, own=-1)


def require_lm_eval(what: str = "hybridpar eval") -> None:
    """ConfigError in one line, saying how to install it, when lm-evaluation-harness is not importable."""
    try:
        missing = importlib.util.find_spec("lm_eval") is None
    except (ImportError, ValueError):  # a broken or blocked installation
        missing = True
    if missing:
        raise ConfigError(f"{what} needs lm-evaluation-harness, which is not installed: {INSTALL}")
