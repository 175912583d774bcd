"""Checkpoint save/load throughput against the raw disk and against gathering everything to rank 0.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/checkpoint.py [--gb 1.0 --rounds 2]

Three ways to write the same sharded state (tensors split over all ranks), interleaved round by
round so machine noise hits each alike:
  dd        `dd if=/dev/zero bs=16M conv=fsync` of the same size into the same folder (the disk's
            limit), and reading that file back with the page cache dropped
  hybridpar Checkpointer.save: every rank writes its own shards (DCP), fsync, atomic rename
  rank0     the usual baseline: full_tensor() of every tensor to rank 0, torch.save, fsync
and two ways to read it back (hybridpar's load into the sharded layout; rank 0 torch.load then
scatter). Prints a table and writes bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hybridpar.checkpoint.dcp import Checkpointer


def drop_page_cache() -> bool:
    """Make reads come from the disk, not memory, where the machine allows it."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="total state size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--folder", default="", help="where to write (default: a temporary folder)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n_tensors = 16
    rows = int(args.gb * 1e9 / 4 / n_tensors / 1024) // world * world
    torch.manual_seed(0)
    model = torch.nn.Module()
    for i in range(n_tensors):  # each rank creates only its shard: no rank ever holds the whole state
        local = torch.randn(rows // world, 1024)
        model.register_parameter(f"w{i}", torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)])))
    nbytes = sum(p.numel() * 4 for p in model.parameters())

    root = Path(args.folder or tempfile.gettempdir()) / "hybridpar-ckpt-bench"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    checkpointer = Checkpointer(root / "dcp", _ParallelStub(rank, world), keep=1)

    def run_dd(*argv: str) -> None:
        if rank == 0:
            out = subprocess.run(["dd", "bs=16M", *argv], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(out.stderr)

    def dd_write() -> None:
        run_dd("if=/dev/zero", f"of={root / 'dd.bin'}", f"count={max(1, nbytes // (16 << 20))}", "conv=fsync")

    def dd_read() -> None:
        run_dd(f"if={root / 'dd.bin'}", "of=/dev/null")

    step = [0]

    def save_hybridpar() -> None:
        step[0] += 1
        checkpointer.save(step[0], model, None, {}, {})  # the state is the sharded tensors alone

    def save_rank0() -> None:
        full = {name: p.full_tensor() for name, p in model.named_parameters()}  # every rank joins each gather
        if rank == 0:
            with open(root / "rank0.pt", "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
        del full

    def load_hybridpar() -> None:
        checkpointer.load(root / "dcp" / f"step-{step[0]:08d}", model, None, {})

    @torch.no_grad()
    def load_rank0() -> None:
        full = torch.load(root / "rank0.pt", weights_only=True, mmap=False) if rank == 0 else None
        for name, p in model.named_parameters():
            src = full[name] if rank == 0 else torch.empty(p.shape)
            # broadcast then slice: what a script without a sharded format has to do
            dist.broadcast(src, 0)
            p.to_local().copy_(src.chunk(world)[rank])
        del full

    names = ("dd write", "save hybridpar", "save rank0", "dd read", "load hybridpar", "load rank0")
    times: dict[str, list[float]] = {k: [] for k in names}
    cold = False
    for _ in range(args.rounds):
        times["dd write"].append(timed(dd_write))
        times["save hybridpar"].append(timed(save_hybridpar))
        times["save rank0"].append(timed(save_rank0))
        if rank == 0:
            cold = drop_page_cache()
        times["dd read"].append(timed(dd_read))
        if rank == 0:
            drop_page_cache()
        times["load hybridpar"].append(timed(load_hybridpar))
        if rank == 0:
            drop_page_cache()
        times["load rank0"].append(timed(load_rank0))

    if rank == 0:
        gbps = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
        print(f"\n{nbytes / 1e9:.2f} GB of state over {world} ranks, best of {args.rounds} interleaved rounds, "
              f"reads {'from disk (page cache dropped)' if cold else 'possibly from the page cache'}")
        print(f"{'what':<16}{'seconds':>10}{'GB/s':>8}")
        for k, v in times.items():
            print(f"{k:<16}{min(v):>10.2f}{gbps[k]:>8.2f}")
        ratios = {
            "save_vs_disk": gbps["save hybridpar"] / gbps["dd write"],
            "load_vs_disk": gbps["load hybridpar"] / gbps["dd read"],
            "save_vs_rank0": gbps["save hybridpar"] / gbps["save rank0"],
            "load_vs_rank0": gbps["load hybridpar"] / gbps["load rank0"],
        }
        for k, v in ratios.items():
            print(f"{k:<16}{v:>10.2f}x")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"bytes": nbytes, "world": world, "rounds": args.rounds, "cold_reads": cold,
                                   "seconds": times, "gb_per_s": gbps, "ratios": ratios}, indent=2) + "\n")
        print(f"wrote {out}")
        shutil.rmtree(root, ignore_errors=True)
    checkpointer.close()
    dist.destroy_process_group()


class _ParallelStub:
    """The two fields Checkpointer reads from ParallelDims (this bench has no model mesh)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world


if __name__ == "__main__":
    main()
