"""What the always-on diagnostics cost a training step: the hang watchdog and the data guard.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/diagnostics_cost.py [--rounds 10 --steps 10]

One Trainer (debug model, mp 2 x dp_shard 2, the embedded corpus) trains blocks of `steps` steps with
the watchdog on and off, alternately (on off, off on, ...), in the same processes; per block the
median step time and the CPU time per step summed over ranks. Then the costs from the bottom up:
one watchdog round (publish the heartbeat, look at the host's other ranks, and on rank 0 read every
heartbeat), against its interval; one data-guard check (fingerprint a step's batches, one
all-gather, the verdict), against a step. Rank 0 prints a table and writes
bench/results/diagnostics_cost.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.stragglers import bench_trainer  # noqa: E402
from hybridpar.diagnostics.data_guard import check_data, step_fingerprint  # noqa: E402
from hybridpar.diagnostics.watchdog import Watchdog  # noqa: E402
from hybridpar.train import Trainer  # noqa: E402


def block(trainer: Trainer, steps: int, watchdog: bool) -> dict:
    c = trainer.config
    c.diagnostics.watchdog, c.train.steps = watchdog, trainer.step + steps
    dist.barrier()
    cpu = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        history = trainer.run()
    cpu_total = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(cpu_total)
    return {"watchdog": watchdog, "median_step": statistics.median(m["step_time"] for m in history[-steps:]),
            "cpu_per_step": cpu_total.item() / steps}


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def watchdog_round(trainer: Trainer, repeats: int) -> float:
    """One round of the beat thread (monitoring on rank 0), run here in the main thread."""
    wd = Watchdog(trainer.parallel, timeout=300.0, run_dir=Path(tempfile.mkdtemp(prefix="hybridpar-bench-")),
                  trace_dir=Path(tempfile.mkdtemp(prefix="hybridpar-bench-")), interval=5.0)
    wd.beat.connect()
    wd.beat.register()
    wd.beat.publish()
    dist.barrier()  # every rank registered: the neighbour look is the full one

    def one_round():
        wd.beat.look_at_neighbours()
        wd.beat.publish()
        if wd.rank == 0:
            wd.monitor.check()

    return median_seconds(one_round, repeats)


def guard_check(trainer: Trainer, repeats: int) -> float:
    batches = [next(trainer.loader) for _ in range(trainer.config.train.grad_accum)]
    dist.barrier()
    return median_seconds(lambda: check_data(step_fingerprint(batches), trainer.parallel, 1), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "diagnostics_cost.json"))
    args = parser.parse_args()
    trainer = bench_trainer("--diagnostics.straggler_every=0")
    block(trainer, args.steps, False)  # warm-up
    blocks = []
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            blocks.append(block(trainer, args.steps, on))
    step = statistics.median(b["median_step"] for b in blocks if not b["watchdog"])
    round_s = torch.tensor([watchdog_round(trainer, 200)], dtype=torch.float64)
    dist.all_reduce(round_s, op=dist.ReduceOp.MAX)
    guard_s = guard_check(trainer, 50)
    if trainer.is_main:
        report(args, blocks, step, round_s.item(), guard_s)
    dist.destroy_process_group()


def report(args, blocks: list[dict], step: float, round_s: float, guard_s: float) -> None:
    pairs = [(a, b) if a["watchdog"] else (b, a) for a, b in zip(blocks[::2], blocks[1::2])]
    ratio = statistics.median(on["median_step"] / off["median_step"] for on, off in pairs)
    cpu_ratio = statistics.median(on["cpu_per_step"] / off["cpu_per_step"] for on, off in pairs)
    result = {
        "layout": "debug, mp 2 x dp_shard 2, 4 ranks", "rounds": args.rounds, "steps_per_block": args.steps,
        "step_s": step, "watchdog_on_off_step_time": ratio, "watchdog_on_off_cpu": cpu_ratio,
        "watchdog_round_s": round_s, "watchdog_share_at_5s": round_s / 5.0, "watchdog_share_at_0.25s": round_s / 0.25,
        "data_guard_check_s": guard_s, "data_guard_share_of_a_step": guard_s / step, "blocks": blocks,
    }
    print(f"median step {step * 1e3:.1f} ms (watchdog off)")
    print(f"watchdog on/off: step time {ratio:.3f}, CPU per step {cpu_ratio:.3f} (median of {len(pairs)} pairs)")
    print(f"watchdog round (slowest rank; rank 0 also reads every heartbeat): {round_s * 1e3:.2f} ms = "
          f"{100 * round_s / 5.0:.3f}% of the default 5 s interval, {100 * round_s / 0.25:.2f}% at 0.25 s")
    print(f"data guard check: {guard_s * 1e3:.2f} ms = {100 * guard_s / step:.1f}% of one step "
          "(run at step 1 only unless diagnostics.data_guard_every is set)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
