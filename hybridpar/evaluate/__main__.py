"""lm-evaluation-harness's command line with hybridpar's model registered (lm-eval finds external models
only when they are imported; it reads no entry points):

    python -m hybridpar.evaluate --model hybridpar --model_args checkpoint=PATH --tasks T1,T2

Under torchrun with N ranks (add mp=N to --model_args for tensor parallelism) rank 0 runs the harness
and prints; the other ranks compute and leave when it is done.
"""

from __future__ import annotations

import sys


def main() -> int:
    from ..config.evaluation import require_lm_eval

    try:
        require_lm_eval("python -m hybridpar.evaluate")
    except ValueError as err:
        raise SystemExit(f"hybridpar: error: {err}") from None
    from lm_eval.__main__ import cli_evaluate

    from . import backend  # noqa: F401 - registers the model "hybridpar"

    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
