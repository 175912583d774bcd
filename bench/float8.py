"""Float8 against bf16 on the main job: what it does to the validation loss, and what its emulation
costs on this CPU (issue 50).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/float8.py [--steps 200] [--rounds 3]

The local job (`--config local`: the tiny preset on the embedded corpus, mp 2 x dp 2 at 4 ranks,
validated every 50 steps) with fsdp.param_dtype bfloat16 (--param-dtype; the local config itself
computes in float32, bf16 matmuls being slow on CPUs), trained --steps steps three times in the
same processes: float8.recipe none (bf16), tensorwise and rowwise, each from the same weights and
data. Then:
  quality   each run's validation loss after its last step, and float8 / bf16 (the issue: within 2%)
  cost      seconds per optimizer step of each recipe over --rounds short runs of --timing-steps
            steps (the first step of each left out), the recipes interleaved (A B C, B C A, ...),
            and emulated float8 / bf16 per round. Off CUDA torchao emulates the float8 matmuls:
            casts, scales and an fp32 matmul. This is the price of running float8's numbers on a
            CPU, not a speed: on an H100 the same recipes run float8 matmuls (bench/gpu/).
Rank 0 prints a table and writes bench/results/float8.json (--out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPES = ("none", "tensorwise", "rowwise")


def _config(args, recipe: str, steps: int, run_dir: Path, eval_every: int):
    from hybridpar.config import find_config, load_config

    flags = {"float8.recipe": recipe, "fsdp.param_dtype": args.param_dtype, "train.steps": steps,
             "train.eval_every": eval_every, "train.log_every": max(1, steps // 4),
             "output.run_dir": str(run_dir), "output.tensorboard": "false", "output.plot": "false",
             "checkpoint.every": 0, "checkpoint.at_end": "false", "checkpoint.resume": "false"}
    return load_config(find_config("local"), [f"--{k}={v}" for k, v in flags.items()])


def _train(config, parallel) -> dict:
    from hybridpar.train import Trainer

    trainer = Trainer(config, parallel)
    history = trainer.run()
    validation = trainer.validation or {}
    return {"losses": [m["loss"] for m in history], "step_times": [m["step_time"] for m in history],
            "val_loss": validation.get("val_loss")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of each quality run (the local job's 200)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds, the recipes interleaved")
    parser.add_argument("--timing-steps", type=int, default=6, help="steps of each timing run")
    parser.add_argument("--param-dtype", default="bfloat16", help="fsdp.param_dtype of every run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "float8.json"))
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from hybridpar.mesh.device import init_parallel
    from hybridpar.progress import log_to_terminal

    log_to_terminal()
    first = _config(args, "none", args.steps, Path(tempfile.gettempdir()), args.steps)
    parallel = init_parallel(mp=first.parallel.mp, dp_shard=first.parallel.dp_shard,
                             dp_replicate=first.parallel.dp_replicate, backend="gloo")
    root = Path(tempfile.mkdtemp(prefix="hybridpar-float8-")) if parallel.rank == 0 else None
    shared = [str(root)]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])

    # Quality: each recipe's run of --steps steps, validated at the end (and every 50 steps).
    quality = {recipe: _train(_config(args, recipe, args.steps, root / recipe, min(50, args.steps)), parallel)
               for recipe in RECIPES}
    # Cost: short runs, the recipes' order rotated each round.
    rounds = []
    for r in range(args.rounds):
        order = RECIPES[r % 3:] + RECIPES[:r % 3]
        timed = {recipe: _train(_config(args, recipe, args.timing_steps, root / f"t{r}-{recipe}",
                                        args.timing_steps + 1), parallel) for recipe in order}
        rounds.append({"order": list(order), **{recipe: statistics.median(timed[recipe]["step_times"][1:] or
                                                                          timed[recipe]["step_times"])
                                                for recipe in RECIPES}})
    if parallel.rank == 0:
        report = _report(args, parallel, quality, rounds)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(_table(report))
        print(f"wrote {args.out}")
        shutil.rmtree(root, ignore_errors=True)  # the runs' metrics: the report holds what is read
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _report(args, parallel, quality: dict, rounds: list) -> dict:
    base = quality["none"]["val_loss"]
    rows = []
    for recipe in RECIPES:
        ratios = [r[recipe] / r["none"] for r in rounds]
        rows.append({"recipe": recipe, "val_loss": quality[recipe]["val_loss"],
                     "val_ratio": quality[recipe]["val_loss"] / base if base else None,
                     "final_train_loss": quality[recipe]["losses"][-1],
                     "step_s": statistics.median(r[recipe] for r in rounds) if rounds else None,
                     "step_ratio": statistics.median(ratios) if rounds else None, "step_ratios": ratios})
    return {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "world": parallel.world_size,
            "layout": f"mp {parallel.mp} x dp {parallel.dp_size}", "options": vars(args),
            "rows": rows, "rounds": rounds, "losses": {r: q["losses"] for r, q in quality.items()}}


def _table(report: dict) -> str:
    o = report["options"]
    lines = [f"float8 against bf16: the local job ({report['layout']}, param_dtype {o['param_dtype']}), "
             f"{o['steps']} steps each; step cost over {o['rounds']} interleaved rounds of {o['timing_steps']} steps",
             f"{'recipe':<11} {'val loss':>9} {'/ bf16':>7} {'train loss':>10} {'s/step':>7} {'/ bf16 (emulated)':>18}"]
    for r in report["rows"]:
        lines.append(f"{r['recipe']:<11} {r['val_loss']:>9.4f} {r['val_ratio']:>7.4f} {r['final_train_loss']:>10.4f} "
                     f"{r['step_s'] or 0:>7.2f} {r['step_ratio'] or 0:>17.2f}x")
    lines.append("(off CUDA the float8 matmuls are emulated in fp32: the cost of float8's numbers on this CPU, "
                 "not a speed)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
