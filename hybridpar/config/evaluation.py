"""The [eval] config section, without torch: lm-evaluation-harness's tasks run on the model being trained,
every `every` steps and after the last one (hybridpar.train.downstream runs them)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional

from .options import ConfigError, option

INSTALL = "pip install -e '.[eval]' (or pip install lm-eval)"

# Tokens per forward when scoring (batch x padded length): a batch of short requests holds many of them.
DEFAULT_BATCH_TOKENS = 8192


def split_task_names(tasks) -> list[str]:
    """"a,b" or ["a", "b"] (or ["a,b"]) as a list of names, empty ones dropped."""
    names = tasks.split(",") if isinstance(tasks, str) else [t for n in tasks for t in str(n).split(",")]
    return [n.strip() for n in names if n.strip()]


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
        for key, low in (("every", 0), ("num_fewshot", -1), ("batch_tokens", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"eval.{key} must be >= {low}, got {getattr(self, key)}")
        if self.limit < 0 or (self.limit >= 1 and self.limit != int(self.limit)):
            raise ConfigError(f"eval.limit must be 0 (every document), a whole number of documents or a share "
                              f"below 1, got {self.limit:g}")

    def harness_limit(self) -> Optional[float]:
        """eval.limit as lm-eval's simple_evaluate takes it: None, a share, or a count."""
        return None if not self.limit else self.limit if self.limit < 1 else int(self.limit)

    def harness_fewshot(self) -> Optional[int]:
        return None if self.num_fewshot < 0 else self.num_fewshot


def require_lm_eval(what: str = "hybridpar eval") -> None:
    """ConfigError in one line, saying how to install it, when lm-evaluation-harness is not importable."""
    try:
        missing = importlib.util.find_spec("lm_eval") is None
    except (ImportError, ValueError):  # a broken or blocked installation
        missing = True
    if missing:
        raise ConfigError(f"{what} needs lm-evaluation-harness, which is not installed: {INSTALL}")
