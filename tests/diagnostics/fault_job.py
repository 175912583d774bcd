"""A training job with one planted fault, run under torchrun by test_watchdog.py.

    python -m torch.distributed.run --nproc_per_node 4 tests/diagnostics/fault_job.py FAULT RANK STEP CONFIG_JSON

FAULT: sleep_mp (RANK sleeps before an all-reduce on its mp group), skip_dp (RANK skips the loss
all-reduce on its dp group), exit (RANK calls os._exit in the middle of the forward pass), shape
(RANK all-reduces a tensor of another shape on its dp group). The fault fires once, in step STEP.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hybridpar.config import load_config  # noqa: E402
from hybridpar.train import Trainer  # noqa: E402


def plant(trainer: Trainer, fault: str, rank: int, step: int) -> None:
    p = trainer.parallel
    real_all_reduce = dist.all_reduce
    fired = []

    def due(group) -> bool:
        wanted = p.mp_group if fault in ("sleep_mp", "exit") else p.dp_group
        return not fired and p.rank == rank and trainer.step + 1 == step and group is wanted

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if due(group):
            fired.append(fault)
            print(f"FAULT {fault} on rank {rank} at {time.time():.3f}", file=sys.stderr, flush=True)
            if fault == "sleep_mp":
                time.sleep(3600)  # the planted straggler
            elif fault == "skip_dp":
                return None  # the planted skipped collective
            elif fault == "exit":
                os._exit(1)  # the planted dead rank
            elif fault == "shape":
                return real_all_reduce(torch.zeros(tensor.numel() + 64), op=op, group=group, async_op=async_op)
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


def main() -> None:
    fault, rank, step, flags = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    trainer = Trainer(load_config(None, [f"--{k}={v}" for k, v in flags.items()]))
    plant(trainer, fault, rank, step)
    trainer.run()


if __name__ == "__main__":
    main()
