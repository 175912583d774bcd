"""A pipeline-shaped job with one planted stall, run under torchrun by test_p2p_hang.py.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/diagnostics/p2p_job.py RUN_DIR TIMEOUT [engine]

Two stages on a pipeline group (described as a DeviceMesh's `pp` dimension), each step two
micro-batches: stage 0 sends activations forward and receives gradients back, stage 1 the other
way round, through dist.batch_isend_irecv as torch.distributed.pipelining does; then a pp
all-reduce (the global gradient norm). In step STALL_STEP, stage 1 stops inside its step (sleeps)
before sending its first gradient back: stage 0 waits in that receive. The hang watchdog runs as
in training.

With `engine`: the mesh's own pp dimension (init_parallel(pp=2); at world 2 torch gives it the
default group) and torch.distributed.pipelining's 1F1B through hybridpar's PipelineEngine over two
stage models cut with build_stage; stage 1 stops in its first forward of step STALL_STEP (a forward
pre-hook), as a rank of a pipelined training run would.
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


def engine_job(watchdog: Watchdog, parallel) -> None:
    """STEPS steps of a two-stage Transformer through PipelineEngine; stage 1 stalls in step STALL_STEP."""
    from hybridpar.models.args import ModelArgs
    from hybridpar.pipeline.engine import PipelineEngine
    from hybridpar.pipeline.schedules import stage_layer_counts
    from hybridpar.pipeline.cutting import build_stage

    args = ModelArgs.from_preset("tiny", dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, n_layers=2)
    stage = parallel.pp_rank
    torch.manual_seed(0)
    model = build_stage(args, parallel, stage, stage_layer_counts(args.n_layers, 2))

    def stall(module, inputs):
        if stage == 1 and watchdog.step == STALL_STEP:
            print(f"STALL on rank {dist.get_rank()} at {time.time():.3f}", file=sys.stderr, flush=True)
            time.sleep(3600)  # the planted stall: stage 1 stops inside its step

    model.register_forward_pre_hook(stall)
    engine = PipelineEngine([model], [stage], parallel.pp_group, "1F1B", MICROBATCHES, torch.device("cpu"),
                            parallel.mp_group)
    tokens = torch.randint(0, args.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    for n in range(1, STEPS + 1):
        watchdog.step, watchdog.phase = n, "pipeline"
        engine.step(tokens, tokens, 1.0)


def main() -> None:
    run_dir, timeout = Path(sys.argv[1]), float(sys.argv[2])
    log_to_terminal()
    apply_env_defaults(run_dir / "flight_recorder")

    import hybridpar

    if sys.argv[3:] == ["engine"]:
        parallel = hybridpar.init_parallel(pp=2)
        watchdog = Watchdog(parallel, timeout=timeout, run_dir=run_dir, trace_dir=run_dir / "flight_recorder",
                            interval=0.25).start()
        engine_job(watchdog, parallel)
        watchdog.close()
        return
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
