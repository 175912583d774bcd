"""lm-evaluation-harness's command line with hybridpar's model registered (lm-eval finds external models
only when they are imported; it reads no entry points):

    python -m hybridpar.evaluate --model hybridpar --model_args checkpoint=PATH --tasks T1,T2

Under torchrun with N ranks (add mp=N to --model_args for tensor parallelism) rank 0 runs the harness
and prints; the other ranks compute and leave when it is done. A failure is said as `hybridpar eval`
says it: one line, once (hybridpar.reporting), exit code 2 for a mistake.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    from ..config.evaluation import require_lm_eval
    from ..reporting import report_error

    if os.environ.get("RANK", "0") != "0":  # the others only serve rank 0: its notes are said once, by it
        os.environ.setdefault("LMEVAL_LOG_LEVEL", "WARNING")
    try:
        require_lm_eval("python -m hybridpar.evaluate")
        from lm_eval.__main__ import cli_evaluate

        from . import backend  # noqa: F401 - registers the model "hybridpar"

        cli_evaluate()
    except Exception as err:  # noqa: BLE001 - reported as the hybridpar command reports it
        return report_error(err, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
