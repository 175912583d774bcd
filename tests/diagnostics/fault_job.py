"""A training job with one planted fault, run under torchrun by test_watchdog.py.

    python -m torch.distributed.run --nproc_per_node 4 tests/diagnostics/fault_job.py FAULT RANK STEP CONFIG_JSON

FAULT: sleep_mp (RANK sleeps before an all-reduce on its mp group), skip_dp (RANK skips the loss
all-reduce on its dp group), exit (RANK calls os._exit in the middle of the forward pass), shape
(RANK all-reduces a tensor of another shape on its dp group), exit_optimizer (os._exit(1) in the
optimizer step), kill_forward (SIGKILL in the middle of the forward), kill_save (SIGKILL while
writing a checkpoint: the job saves every step), kill_setup (SIGKILL while the data is set up),
stop_hang (every rank gets SIGTERM in the forward, and RANK hangs there: the stop cannot finish),
sleep_stage (RANK, of a pipeline stage, stops in its stage's first forward: its peer stages wait in
their sends and receives), kill_stage (SIGKILL there instead). The fault fires once, in step STEP (kill_setup: before step 1).
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hybridpar.config import load_config  # noqa: E402
from hybridpar.progress import log_to_terminal  # noqa: E402
from hybridpar.train import Trainer  # noqa: E402


def plant(trainer: Trainer, fault: str, rank: int, step: int) -> None:
    p = trainer.parallel
    real_all_reduce = dist.all_reduce
    fired = []

    def due(group) -> bool:
        if fault in HOOKED:
            return False
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
    if fault in HOOKED:
        HOOKED[fault](trainer, rank, step, fired)


def _announce(fault: str, rank: int) -> None:
    print(f"FAULT {fault} on rank {rank} at {time.time():.3f}", file=sys.stderr, flush=True)


def _exit_in_optimizer(trainer: Trainer, rank: int, step: int, fired: list) -> None:
    real_step = trainer.optimizer.step

    def optimizer_step(*args, **kwargs):
        if trainer.parallel.rank == rank and trainer.step + 1 == step:
            _announce("exit_optimizer", rank)
            os._exit(1)
        return real_step(*args, **kwargs)

    trainer.optimizer.step = optimizer_step


def _kill_in_forward(trainer: Trainer, rank: int, step: int, fired: list) -> None:
    def hook(module, args):
        if trainer.parallel.rank == rank and trainer.step + 1 == step:
            _announce("kill_forward", rank)
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.model.layers["1"].register_forward_pre_hook(hook)


def _kill_in_save(trainer: Trainer, rank: int, step: int, fired: list) -> None:
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def save(state, *args, storage_writer=None, **kwargs):
        if trainer.parallel.rank == rank and trainer.step == step:
            real_write = storage_writer.write_data

            def write_data(plan, planner):  # after the plan is agreed, while the files are written
                _announce("kill_save", rank)
                os.kill(os.getpid(), signal.SIGKILL)
                return real_write(plan, planner)

            storage_writer.write_data = write_data
        return real_save(state, *args, storage_writer=storage_writer, **kwargs)

    dcp.save = save


def _stop_and_hang(trainer: Trainer, rank: int, step: int, fired: list) -> None:
    def hook(module, args):
        if trainer.step + 1 == step and not fired:
            fired.append("stop_hang")
            if trainer.parallel.rank == rank:
                _announce("stop_hang", rank)
            os.kill(os.getpid(), signal.SIGTERM)
            if trainer.parallel.rank == rank:
                time.sleep(3600)

    trainer.model.register_forward_pre_hook(hook)


def _stage_modules(trainer: Trainer) -> list:
    """The model, or under pipeline parallelism this rank's stage modules (the trainer's model_parts)."""
    parts = getattr(trainer, "model_parts", None)
    return list(parts) if parts else [trainer.model]


def _in_stage(fault: str):
    """sleep_stage or kill_stage: RANK stalls or dies in its first stage's first forward of the step."""
    def plant(trainer: Trainer, rank: int, step: int, fired: list) -> None:
        def hook(module, args):
            if trainer.parallel.rank == rank and trainer.step + 1 == step and not fired:
                fired.append(fault)
                _announce(fault, rank)
                if fault == "kill_stage":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)  # the planted stall, inside the step: the other stages wait in sends and receives

        _stage_modules(trainer)[0].register_forward_pre_hook(hook)

    return plant


# Faults planted by a hook of their own (not in all_reduce).
HOOKED = {"exit_optimizer": _exit_in_optimizer, "kill_forward": _kill_in_forward, "kill_save": _kill_in_save,
          "stop_hang": _stop_and_hang, "sleep_stage": _in_stage("sleep_stage"), "kill_stage": _in_stage("kill_stage")}


def _kill_in_setup(rank: int) -> None:
    """SIGKILL while the data is set up, after the mesh exists (before any training step)."""
    from hybridpar.train import trainer as trainer_module

    real_build = trainer_module.build_training_data

    def build_training_data(config, parallel, **kwargs):
        if parallel.rank == rank:
            _announce("kill_setup", rank)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_build(config, parallel, **kwargs)

    trainer_module.build_training_data = build_training_data


def main() -> None:
    fault, rank, step, flags = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    log_to_terminal()  # a torchrun child, as `hybridpar train`'s: the library's lines as the command line shows them
    if fault == "kill_setup":
        _kill_in_setup(rank)
    trainer = Trainer(load_config(None, [f"--{k}={v}" for k, v in flags.items()]))
    plant(trainer, fault, rank, step)
    trainer.run()


if __name__ == "__main__":
    main()
