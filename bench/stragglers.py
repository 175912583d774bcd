"""Overhead of straggler detection: the same training with diagnostics.straggler_every on and off.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/stragglers.py [--rounds 40 --steps 10]

One Trainer (debug model, mp 2 x dp_shard 2, the embedded corpus) trains in blocks of `steps` steps,
alternately with reports every `every` steps and with detection off (on off, off on, ...), in the same
processes so that both see the same load. Per block: the median of the trainer's step times, the
wall time per step (reports included) and the CPU time per step summed over ranks (gloo does not
spin while it waits: the work done, robust to other load). Then one healthy run of `healthy` steps
with reports every `every`: its warnings are counted. Last, the cost from the bottom up: collective
calls in a step, the wrapper's cost per call on a stand-in collective, and a report's. Rank 0
prints a table and writes bench/results/stragglers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
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

from hybridpar.config import load_config  # noqa: E402
from hybridpar.diagnostics.stragglers import CPU_SAMPLES, CollectiveTimer, StragglerMonitor  # noqa: E402
from hybridpar.progress import log_to_terminal  # noqa: E402
from hybridpar.train import Trainer  # noqa: E402
from hybridpar.train.metrics import read_metrics  # noqa: E402


def block(trainer: Trainer, steps: int, every: int) -> dict:
    """Train `steps` more steps with reports every `every` (0: off); rank 0's figures."""
    c = trainer.config
    c.diagnostics.straggler_every, c.train.steps = every, trainer.step + steps
    first = trainer.step + 1
    dist.barrier()
    out, start, cpu = io.StringIO(), time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        history = trainer.run()
    wall = time.perf_counter() - start
    cpu_total = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(cpu_total)
    # Read now: the next run() starts metrics.jsonl afresh.
    rows = read_metrics(trainer.metrics.jsonl_path) if trainer.is_main else []
    return {
        "every": every, "first_step": first, "wall_per_step": wall / steps, "cpu_per_step": cpu_total.item() / steps,
        "median_step": statistics.median(m["step_time"] for m in history[-steps:]),
        "ratios": [r["straggler/ratio"] for r in rows if r["step"] >= first and "straggler/ratio" in r],
        "warnings": [line for line in out.getvalue().splitlines() if line.startswith("straggler at")],
    }


def wrapper_cost(calls: int = 200_000) -> dict:
    """Seconds the wrapper adds to one call, idle and measuring, on a stand-in for dist.barrier."""
    real, out = dist.barrier, {}
    dist.barrier = stand_in = lambda *args, **kwargs: None
    try:
        start = time.perf_counter()
        for _ in range(calls):
            stand_in()
        bare = (time.perf_counter() - start) / calls
        for measuring in (False, True):
            with CollectiveTimer() as timer:
                timer.measuring, wrapped = measuring, dist.barrier
                start = time.perf_counter()
                for _ in range(calls):
                    wrapped()
                out["measuring" if measuring else "idle"] = (time.perf_counter() - start) / calls - bare
    finally:
        dist.barrier = real
    return out


def bottom_up(trainer: Trainer, off_step: float, every: int) -> dict:
    """Collective calls in one step (bench/comm.py counts them), the wrapper's cost per call, a
    report's cost (its all-gather and rank 0's analysis), and what they add to a step."""
    from bench.comm import CollectiveCounter

    with CollectiveCounter() as counter:
        trainer.train_step()
    calls, per_call = len(counter.records), wrapper_cost()
    monitor, times = StragglerMonitor(trainer.parallel, every=1, threshold=1.5, start_step=-1), []
    for step in range(1, 31):
        monitor.measured = [(0.1, 0.1)]
        dist.barrier()
        start = time.perf_counter()
        monitor.report(step)
        times.append(time.perf_counter() - start)
    report = statistics.median(times)
    share = {}
    for e in sorted({every, 50}):
        measured = min(CPU_SAMPLES, e) / e  # the share of steps measured on the CPU
        per_step = calls * (per_call["idle"] * (1 - measured) + per_call["measuring"] * measured) + report / e
        share[f"every_{e}"] = per_step / off_step
    return {"calls_per_step": calls, "wrapper_s": per_call, "report_s": report, "share_of_step": share}


FIGURES = {"median_step": "median step time (ms)", "wall_per_step": "wall time per step (ms)",
           "cpu_per_step": "CPU time per step (ms)"}


def summarise(blocks: list[dict]) -> dict:
    """Per round, on / off of each figure; the median over rounds, and the mean of the totals."""
    on = [b for b in blocks if b["every"]]
    off = [b for b in blocks if not b["every"]]
    out = {}
    for key in FIGURES:
        per_round = [a[key] / b[key] for a, b in zip(on, off)]
        out[key] = {"median_of_rounds": statistics.median(per_round), "per_round": per_round,
                    "ratio_of_sums": sum(b[key] for b in on) / sum(b[key] for b in off),
                    "on_s": statistics.median(b[key] for b in on), "off_s": statistics.median(b[key] for b in off)}
    return out


def bench_trainer(*flags: str) -> Trainer:
    """The diagnostics benches' Trainer: the debug model at mp 2 x dp_shard 2 on the embedded
    corpus, in a fresh temporary run folder; `flags` override."""
    return Trainer(load_config(None, [
        "--model.preset=debug", "--model.vocab_size=512", "--parallel.mp=2", "--parallel.dp_shard=2",
        "--fsdp.sharding_strategy=hybrid_shard", "--fsdp.param_dtype=float32", "--data.source=default",
        "--data.tokenizer_vocab_size=512", "--data.seq_len=64", "--data.micro_batch_size=4",
        "--train.log_every=1000000", "--train.peak_flops=1e12", "--checkpoint.at_end=false",
        f"--output.run_dir={tempfile.mkdtemp(prefix='hybridpar-bench-')}",
        "--output.tensorboard=false", "--output.plot=false", *flags,
    ]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--every", type=int, default=5, help="straggler_every of the 'on' blocks and the healthy run")
    parser.add_argument("--healthy", type=int, default=200, help="steps of the healthy run (0: none)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "stragglers.json"))
    args = parser.parse_args()

    log_to_terminal()  # the straggler lines block() reads from stdout are the library's records
    trainer = bench_trainer()
    load_before = os.getloadavg()
    block(trainer, 10, 0)  # warm-up
    blocks = []
    for r in range(args.rounds):
        for every in ((args.every, 0) if r % 2 == 0 else (0, args.every)):
            blocks.append(block(trainer, args.steps, every))
    healthy = block(trainer, args.healthy, args.every) if args.healthy else None
    costs = bottom_up(trainer, statistics.median(b["median_step"] for b in blocks if not b["every"]), args.every)
    if trainer.is_main:
        report(args, trainer, blocks, healthy, costs, load_before)
    dist.destroy_process_group()


def report(args, trainer: Trainer, blocks: list[dict], healthy, costs: dict, load_before) -> None:
    s = summarise(blocks)
    print(f"\ndebug model, mp 2 x dp_shard 2, {args.rounds} rounds of {args.steps} steps on / off "
          f"(on: a report every {args.every} steps); load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'figure':<26}{'on':>9}{'off':>9}{'on/off: median of rounds':>26}{'ratio of sums':>15}")
    for key, name in FIGURES.items():
        f = s[key]
        print(f"{name:<26}{1e3 * f['on_s']:>9.2f}{1e3 * f['off_s']:>9.2f}{f['median_of_rounds']:>26.4f}"
              f"{f['ratio_of_sums']:>15.4f}")
    if healthy is not None:
        ratios = healthy["ratios"]
        print(f"healthy run: {args.healthy} steps, {len(ratios)} reports, max/median compute "
              f"{min(ratios, default=0):.2f}-{max(ratios, default=0):.2f}, {len(healthy['warnings'])} warnings")
        for line in healthy["warnings"]:
            print("  " + line)
    w = costs["wrapper_s"]
    print(f"bottom up: {costs['calls_per_step']} collective calls per step, wrapper {1e6 * w['idle']:.2f} us per "
          f"call idle / {1e6 * w['measuring']:.2f} us measuring, a report {1e3 * costs['report_s']:.2f} ms: "
          + ", ".join(f"{k.replace('_', ' ')}: {100 * v:.3f}% of a step" for k, v in costs["share_of_step"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "world": trainer.parallel.world_size, "load_before": load_before,
                               "load_after": os.getloadavg(), "summary": s, "healthy": healthy, "bottom_up": costs,
                               "blocks": blocks},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
