"""Downstream evaluation through lm-evaluation-harness, on any checkpoint hybridpar reads, at any mesh.

    hybridpar eval CHECKPOINT --tasks T1,T2 [--mp N] [--include-path DIR] [--limit N] [--num-fewshot K] [--json PATH]

`evaluate_checkpoint` is the command's work; `HybridparLM` the harness's model backend (registered as
`hybridpar`; `python -m hybridpar.evaluate` is lm-eval's own command line with it registered). lm-eval
is an extra (`pip install -e '.[eval]'`): this package imports it only when a name below is used.
"""

from __future__ import annotations

from typing import Any

from ..config.evaluation import require_lm_eval

__all__ = ["HybridparLM", "Loaded", "evaluate_checkpoint", "load", "require_lm_eval", "results_json", "results_table"]


def __getattr__(name: str) -> Any:
    # The backend subclasses lm-eval's LM: imported on first use, so that `hybridpar eval` without lm-eval
    # reaches require_lm_eval's one line.
    if name == "HybridparLM":
        require_lm_eval(f"hybridpar.evaluate.{name}")
        from . import backend

        return getattr(backend, name)
    if name in ("Loaded", "load"):
        from . import loading

        return getattr(loading, name)
    if name in ("evaluate_checkpoint", "results_json", "results_table"):
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
