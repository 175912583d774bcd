"""Context parallelism: per-rank activation memory and step time at cp 1, 2 and 4 on long sequences,
measured on the real model and set against `hybridpar plan`'s activation estimate.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/context_parallel.py [--seq-lens 2048,8192]

For each seq_len and cp in 1, 2, 4 (the other ranks data-parallel, mp 1, one sequence per dp rank):
  activations   the distinct storages autograd saves during one forward + loss (bench/sequence_parallel's
                saved-tensors hook; parameters excluded): the activation peak. Largest rank; the
                planner's estimate beside it, and the ratio to cp 1's. (On the CPU the attention
                saves no causal mask: hybridpar/parallel/context.py's _LowerRightCausalCPU.)
  step          seconds of one forward + backward, the median of --rounds, the layouts interleaved
                (cp 1, 2, 4, cp 1, 2, 4, ...); tokens/s of the whole world.
The model runs without FSDP (FSDP does not touch activations). Prints a table and writes
bench/results/context_parallel.json (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sequence_parallel import saved_activation_bytes  # noqa: E402


def _setup(args, parallel, seq_len: int):
    """The model and a loss function over this rank's chunks of one sequence per dp rank."""
    from hybridpar.models.llama import Transformer
    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.parallel.context import shard_sequence

    torch.manual_seed(0)
    model = Transformer(args, parallel)
    g = torch.Generator().manual_seed(1 + parallel.dp_rank)  # cp peers read the same sequence
    tokens = torch.randint(0, args.vocab_size, (1, seq_len + 1), generator=g)
    inputs = shard_sequence(tokens[:, :-1], parallel.cp, parallel.cp_rank)
    targets = shard_sequence(tokens[:, 1:], parallel.cp, parallel.cp_rank)

    def loss_fn():
        return vocab_parallel_cross_entropy(model(inputs), targets, parallel=parallel)

    return model, loss_fn


def _step_seconds(model, loss_fn) -> float:
    dist.barrier()
    began = time.perf_counter()
    loss_fn().backward()
    model.zero_grad(set_to_none=True)
    took = torch.tensor([time.perf_counter() - began])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
    return float(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "context_parallel.json"))
    opts = parser.parse_args()

    import hybridpar
    from hybridpar.models.args import ModelArgs
    from hybridpar.plan import activation_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cps = [int(c) for c in opts.cps.split(",")]
    meshes = {cp: hybridpar.init_parallel(mp=1, cp=cp, dp_shard=world // cp) for cp in cps}
    rows = []
    for seq_len in (int(s) for s in opts.seq_lens.split(",")):
        args = dataclasses.replace(ModelArgs.from_preset(opts.preset), max_seq_len=seq_len)
        built = {cp: _setup(args, meshes[cp], seq_len) for cp in cps}
        times: dict[int, list[float]] = {cp: [] for cp in cps}
        for cp in cps:  # warm-up: lazily built state is not counted
            _step_seconds(*built[cp])
        for _ in range(opts.rounds):
            for cp in cps:
                times[cp].append(_step_seconds(*built[cp]))
        for cp in cps:
            mine = saved_activation_bytes(*built[cp])
            built[cp][0].zero_grad(set_to_none=True)
            every = [None] * world
            dist.all_gather_object(every, mine)
            step = statistics.median(times[cp])
            rows.append({"seq_len": seq_len, "cp": cp, "dp": world // cp, "activations": max(every),
                         "planned": activation_bytes(args, 1, 1, seq_len, 4, 0, False, cp=cp).saved,
                         "step_seconds": step, "steps": times[cp],
                         "tokens_per_s": (world // cp) * seq_len / step})
        del built
    if dist.get_rank() == 0:
        report(rows, opts.preset, world, Path(opts.out))
    dist.destroy_process_group()


def report(rows: list[dict], preset: str, world: int, out: Path) -> None:
    mib = 2**20
    print(f"context parallelism, preset {preset}, {world} ranks (mp 1, the rest dp), one sequence per dp rank, fp32")
    print(f"{'seq_len':>8} {'layout':<10} {'activations MiB':>16} {'planned':>9} {'vs cp1':>7} "
          f"{'step s':>8} {'tokens/s':>9}")
    base: dict[int, dict] = {}
    for row in rows:
        base.setdefault(row["seq_len"], row)
        row["activation_ratio"] = row["activations"] / base[row["seq_len"]]["activations"]
        print(f"{row['seq_len']:>8} cp{row['cp']} x dp{row['dp']:<3} {row['activations'] / mib:>16.2f} "
              f"{row['planned'] / mib:>9.2f} {row['activation_ratio']:>7.3f} "
              f"{row['step_seconds']:>8.3f} {row['tokens_per_s']:>9.0f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": preset, "world": world, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
