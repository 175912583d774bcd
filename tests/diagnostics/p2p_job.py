"""A pipeline-shaped job with one planted stall, run under torchrun by test_p2p_hang.py.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/diagnostics/p2p_job.py RUN_DIR TIMEOUT

Two stages on a pipeline group (described as a DeviceMesh's `pp` dimension), each step two
micro-batches: stage 0 sends activations forward and receives gradients back, stage 1 the other
way round, through dist.batch_isend_irecv as torch.distributed.pipelining does; then a pp
all-reduce (the global gradient norm). In step STALL_STEP, stage 1 stops inside its step (sleeps)
before sending its first gradient back: stage 0 waits in that receive. The hang watchdog runs as
in training.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hybridpar.diagnostics.timeouts import apply_env_defaults  # noqa: E402
from hybridpar.diagnostics.watchdog import Watchdog  # noqa: E402
from hybridpar.progress import log_to_terminal  # noqa: E402

STALL_STEP, MICROBATCHES, STEPS = 3, 2, 5


def exchange(ops: list) -> None:
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def step(stage: int, peer: int, pp, n: int) -> None:
    x = torch.full((2, 8), float(n))
    for mb in range(MICROBATCHES):  # forward
        if stage == 0:
            exchange([dist.P2POp(dist.isend, x * (mb + 1), peer, pp)])
        else:
            exchange([dist.P2POp(dist.irecv, torch.empty(2, 8), peer, pp)])
    for mb in range(MICROBATCHES):  # backward
        if stage == 1:
            if n == STALL_STEP and mb == 0:
                print(f"STALL on rank {dist.get_rank()} at {time.time():.3f}", file=sys.stderr, flush=True)
                time.sleep(3600)  # the planted stall: stage 1 stops inside its step
            exchange([dist.P2POp(dist.isend, x, peer, pp)])
        else:
            exchange([dist.P2POp(dist.irecv, torch.empty(2, 8), peer, pp)])
    dist.all_reduce(torch.ones(1), group=pp)  # the gradient norm over the stages


def main() -> None:
    run_dir, timeout = Path(sys.argv[1]), float(sys.argv[2])
    log_to_terminal()
    apply_env_defaults(run_dir / "flight_recorder")

    import hybridpar

    parallel = hybridpar.init_parallel()
    # The stages' own group, described as a DeviceMesh describes its pp dimension's ("mesh_pp"); a
    # mesh dimension spanning the whole world would share the default group, which the heartbeat
    # names after the mesh's own dimensions.
    pp = dist.new_group(list(range(dist.get_world_size())), group_desc="mesh_pp")
    stage = dist.get_rank(pp)
    peer = dist.get_global_rank(pp, 1 - stage)
    watchdog = Watchdog(parallel, timeout=timeout, run_dir=run_dir, trace_dir=run_dir / "flight_recorder",
                        interval=0.25).start()
    for n in range(1, STEPS + 1):
        watchdog.step, watchdog.phase = n, "pipeline"
        step(stage, peer, pp, n)
    watchdog.close()


if __name__ == "__main__":
    main()
