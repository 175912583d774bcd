"""`hybridpar train` as torchrun starts it, with one mistake planted, for the one-screen tests.

    python -m torch.distributed.run --nproc_per_node 4 tests/diagnostics/cli_job.py MISTAKE -- TRAIN_ARGS...

MISTAKE: same_data (every rank's loader is built as data-parallel rank 0's: the duplicate-data
bug the data guard exists for), low_estimate (a checkpoint's size is taken for 1 byte, so a save
on a full disk passes the check before it and fails while writing), none (the arguments alone
carry the mistake, e.g. mesh sizes, a small checkpoint folder).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hybridpar.cli import main  # noqa: E402


def plant(mistake: str) -> None:
    if mistake == "same_data":
        from hybridpar.data import training_data as pipeline

        real = pipeline.build_dataloader
        pipeline.build_dataloader = lambda dataset, **kw: real(dataset, **{**kw, "dp_rank": 0})
    elif mistake == "low_estimate":
        from hybridpar.checkpoint import dcp

        dcp.checkpoint_bytes = lambda state, world_size: 1


if __name__ == "__main__":
    plant(sys.argv[1])
    sys.exit(main(["train", *sys.argv[3:]]))
