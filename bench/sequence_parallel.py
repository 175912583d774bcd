"""Sequence parallelism: per-rank activation memory and tensor-parallel traffic with and without it,
measured on the real model and set against `hybridpar plan`'s estimate.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/sequence_parallel.py [--shape small]

For mp 2 and mp 4 (the other ranks data-parallel), with parallel.sequence_parallel off and on:
  activations   the distinct storages autograd saves during one forward + loss (a saved-tensors
                hook; parameters excluded), sized when backward would start: the activation peak.
                Largest rank; the planner's activation estimate beside it.
  mp traffic    payload and ring wire bytes of every collective over the mp group in one forward +
                backward (bench/comm.py's counter), by kind, against plan.collective_bytes: the
                collectives nccl runs (HYBRIDPAR_FAST_PATHS=0 while counting; on gloo the fast
                path sends the same bytes as all-to-alls).
The model runs without FSDP here (FSDP does not touch activations or the mp group). Tokens/s with
and without it: `bench/run.py --engines hybridpar,variant --sequence-parallel 0` (paired steps).
Prints a table and writes bench/results/sequence_parallel.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.comm import CollectiveCounter  # noqa: E402
from bench.run import BATCH, shape_dict  # noqa: E402


def saved_activation_bytes(model, loss_fn) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `loss_fn()` runs."""
    from torch.autograd.graph import saved_tensors_hooks
    from torch.distributed.tensor import DTensor

    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    total = sum(saved.values())
    loss.backward()
    return total


def measure(args, parallel, sp: bool, micro_batch: int, seq_len: int) -> dict:
    from hybridpar import fastpaths
    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(args, parallel, sequence_parallel=sp)
    g = torch.Generator().manual_seed(1 + parallel.dp_rank)
    tokens = torch.randint(0, args.vocab_size, (micro_batch, seq_len + 1), generator=g)

    def loss_fn():
        return vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], parallel=parallel)

    loss_fn().backward()  # warm-up: lazily built state is not counted
    model.zero_grad(set_to_none=True)
    activations = saved_activation_bytes(model, loss_fn)
    model.zero_grad(set_to_none=True)
    os.environ[fastpaths.ENV] = "0"  # count the collectives nccl runs, not gloo's all-to-all fast path
    try:
        with CollectiveCounter() as counter:
            loss_fn().backward()
    finally:
        os.environ.pop(fastpaths.ENV)
    mp_records = [r for r in counter.records if r.group_size == parallel.mp]
    by_kind: dict[str, int] = {}
    for r in mp_records:
        by_kind[r.kind] = by_kind.get(r.kind, 0) + r.payload
    return {"activations": activations, "payload": by_kind, "wire": sum(r.wire for r in mp_records),
            "calls": len(mp_records)}


def planned(args, mp: int, dp: int, sp: bool, micro_batch: int, seq_len: int) -> dict:
    from hybridpar.plan import Layout, Workload, activation_bytes, collective_bytes

    layout = Layout(mp, dp, 1, "none", sequence_parallel=sp)
    workload = Workload(seq_len=seq_len, micro_batch=micro_batch, param_dtype="float32", reduce_dtype="float32")
    comm = collective_bytes(args, layout, workload)
    payload = {"all_reduce": comm.tp_all_reduce, "all_gather": comm.tp_all_gather,
               "reduce_scatter": comm.tp_reduce_scatter}
    return {"activations": activation_bytes(args, mp, micro_batch, seq_len, 4, 0, sp).saved,
            "payload": {k: v for k, v in payload.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small", help="bench/run.py's shape name or a preset")
    parser.add_argument("--mps", default="2,4")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sequence_parallel.json"))
    opts = parser.parse_args()

    import hybridpar
    from hybridpar.models.args import ModelArgs

    torch.set_num_threads(1)
    args = ModelArgs.from_dict(shape_dict(opts.shape))
    micro_batch, seq_len = BATCH.get(opts.shape, (2, 256))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = []
    for mp in (int(x) for x in opts.mps.split(",")):
        parallel = hybridpar.init_parallel(mp=mp, dp_shard=world // mp)
        for sp in (False, True):
            mine = measure(args, parallel, sp, micro_batch, seq_len)
            every = [None] * world
            dist.all_gather_object(every, mine)
            plan = planned(args, mp, world // mp, sp, micro_batch, seq_len)
            rows.append({"mp": mp, "dp": world // mp, "sequence_parallel": sp,
                         "activations": max(m["activations"] for m in every), "planned": plan,
                         "payload": every[0]["payload"], "wire": every[0]["wire"], "calls": every[0]["calls"]})
    if dist.get_rank() == 0:
        report(rows, opts.shape, micro_batch, seq_len, Path(opts.out))
    dist.destroy_process_group()


def report(rows: list[dict], shape: str, micro_batch: int, seq_len: int, out: Path) -> None:
    mib = 2**20
    print(f"sequence parallelism, shape {shape}, micro-batch {micro_batch} x seq_len {seq_len}, fp32, per rank")
    print(f"{'layout':<10} {'seq-par':<8} {'activations MiB':>16} {'planned':>9} {'ratio':>6}   "
          f"{'mp payload MiB (measured = planned)':<58} {'mp wire MiB':>11} {'calls':>6}")
    base: dict[int, dict] = {}
    for row in rows:
        base.setdefault(row["mp"], row)
        kinds = ", ".join(f"{k.replace('_', '-')} {v / mib:.1f}" for k, v in sorted(row["payload"].items()))
        equal = all(abs(row["payload"].get(k, 0) - v) < 1 for k, v in row["planned"]["payload"].items()) and \
            set(row["payload"]) == set(row["planned"]["payload"])
        row["payload_equals_plan"] = equal
        row["activation_ratio"] = row["activations"] / base[row["mp"]]["activations"]
        print(f"mp{row['mp']} x dp{row['dp']:<3} {'on' if row['sequence_parallel'] else 'off':<8} "
              f"{row['activations'] / mib:>16.2f} {row['planned']['activations'] / mib:>9.2f} "
              f"{row['activation_ratio']:>6.3f}   {kinds + ('  (=)' if equal else '  (DIFFERS)'):<58} "
              f"{row['wire'] / mib:>11.1f} {row['calls']:>6}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": shape, "micro_batch": micro_batch, "seq_len": seq_len, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
