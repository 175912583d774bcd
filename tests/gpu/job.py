"""A world-1 training job for test_cuda.py, in a fresh process (the flight-recorder variables must be
set before its process group exists):

    python tests/gpu/job.py MODE CONFIG_JSON

MODE "run": train, then print one line `RESULT {json}`: the tracing variables as they were when
torch.distributed.init_process_group was called, the backend, each step's memory_gb, CUDA's peak
allocation, and the collectives hybridpar's flight-recorder dump holds (and NCCL's own recorder's,
when torch has one: the two are separate recorders).
MODE "stall": rank 0 sleeps in step STALL_STEP before the loss all-reduce; the watchdog must report.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hybridpar.config import load_config  # noqa: E402
from hybridpar.diagnostics.timeouts import ENV_DEFAULTS  # noqa: E402
from hybridpar.train import Trainer  # noqa: E402

STALL_STEP = 3
TRACED = (*ENV_DEFAULTS, "TORCH_FR_DUMP_TEMP_FILE")


def _spy_on_init(seen: dict) -> None:
    real = dist.init_process_group

    def init_process_group(*args, **kwargs):
        seen.update({k: os.environ.get(k) for k in TRACED})
        return real(*args, **kwargs)

    dist.init_process_group = init_process_group


def _recorded() -> dict:
    """{recorder: [profiling names]}: hybridpar's dump, and NCCL's own recorder where torch has it."""
    from hybridpar.diagnostics.traces import dump_flight_recorder
    from hybridpar.safe_pickle import loads, no_globals

    out = {}
    try:
        out["hybridpar"] = [e.get("profiling_name") for e in dump_flight_recorder().get("entries", [])]
    except Exception as err:  # noqa: BLE001 - said in the result
        out["hybridpar"] = f"{type(err).__name__}: {err}"
    nccl = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if nccl is not None:
        try:
            dump = loads(nccl(True, False, False), no_globals, "NCCL's flight recorder", "a flight-recorder dump")
            out["nccl"] = [e.get("profiling_name") for e in dump.get("entries", [])]
        except Exception as err:  # noqa: BLE001
            out["nccl"] = f"{type(err).__name__}: {err}"
    return out


def _stall(trainer: Trainer) -> None:
    real_all_reduce, p = dist.all_reduce, trainer.parallel

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if trainer.step + 1 == STALL_STEP and group is p.dp_group:
            print(f"STALL on rank {p.rank} at {time.time():.3f}", file=sys.stderr, flush=True)
            time.sleep(3600)
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


def main() -> None:
    mode, flags = sys.argv[1], json.loads(sys.argv[2])
    seen: dict = {}
    _spy_on_init(seen)
    trainer = Trainer(load_config(None, [f"--{k}={v}" for k, v in flags.items()]))
    if mode == "stall":
        _stall(trainer)
    history = trainer.run()
    device = trainer.device
    result = {
        "env_at_init": seen, "backend": trainer.parallel.backend, "device": str(device),
        "memory_gb": [m["memory_gb"] for m in history], "mfu": [m["mfu"] for m in history],
        "cuda_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "peak_flops": trainer.peak_flops, "recorded": _recorded(),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
