"""Per-rank training state (parameters + gradients + AdamW moments) against the ideal total / (mp * dp_shard).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/memory.py [--mp 2 --dp-shard 2]

Counts the bytes of the real local tensors after two optimizer steps (so gradients and optimizer
state exist), prints a table on rank 0 and writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridpar.config import load_config
from hybridpar.train import Trainer


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mp", type=int, default=2)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hybridpar-bench-"))
    config = load_config(None, [
        f"--model.preset={args.preset}", f"--parallel.mp={args.mp}", f"--parallel.dp_shard={args.dp_shard}",
        f"--parallel.dp_replicate={args.dp_replicate}", "--fsdp.sharding_strategy=hybrid_shard",
        "--fsdp.param_dtype=float32", "--data.source=default",
        "--data.seq_len=64", "--train.steps=2", "--train.peak_flops=1e12", f"--output.run_dir={work / 'run'}",
        "--output.tensorboard=false", "--output.plot=false",
    ])
    trainer = Trainer(config)
    trainer.run()
    # Gradients are freed by zero_grad after each step: run one more backward to count them.
    inputs, targets = next(trainer.loader)
    from hybridpar.parallel import vocab_parallel_cross_entropy

    vocab_parallel_cross_entropy(trainer.model(inputs), targets, parallel=trainer.parallel).backward()

    params = list(trainer.model.parameters())
    full_numel = sum(p.numel() for p in params)  # DTensor.numel() is the global size
    counted = {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(v) for state in trainer.optimizer.state.values()
                         for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")),
    }
    p = trainer.parallel
    shards = p.mp * p.dp_shard
    ideal = {"parameters": full_numel * 4 / shards, "gradients": full_numel * 4 / shards, "optimizer": 2 * full_numel * 4 / shards}
    per_rank = torch.tensor([counted[k] for k in ideal], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(p.world_size)]
    dist.all_gather(gathered, per_rank)
    if p.rank == 0:
        worst = torch.stack(gathered).max(dim=0).values.tolist()
        rows = {k: {"bytes_per_rank_max": w, "ideal": ideal[k], "ratio": w / ideal[k]} for k, w in zip(ideal, worst)}
        total_ratio = sum(worst) / sum(ideal.values())
        print(f"\n{args.preset}: {full_numel / 1e6:.2f}M parameters, mp {p.mp} x dp_shard {p.dp_shard} x dp_replicate {p.dp_replicate}")
        print(f"{'state':<12}{'max bytes/rank':>16}{'ideal':>14}{'ratio':>8}")
        for k, r in rows.items():
            print(f"{k:<12}{r['bytes_per_rank_max']:>16,.0f}{r['ideal']:>14,.0f}{r['ratio']:>8.4f}")
        print(f"{'total':<12}{sum(worst):>16,.0f}{sum(ideal.values()):>14,.0f}{total_ratio:>8.4f}")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"preset": args.preset, "mp": p.mp, "dp_shard": p.dp_shard,
                                   "dp_replicate": p.dp_replicate, "params": full_numel, "rows": rows,
                                   "total_ratio": total_ratio}, indent=2) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
