"""Checkpoint save/load throughput against the raw disk and against gathering everything to rank 0.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/checkpoint.py [--gb 1.0 --rounds 2]

Three ways to write the same sharded state (tensors split over all ranks), interleaved round by
round so machine noise hits each alike:
  dd        `dd if=/dev/zero bs=16M conv=fsync` of the same size into the same folder (the disk's
            limit)
  hybridpar Checkpointer.save: every rank writes its own shards (DCP), fsync, atomic rename
  rank0     the usual baseline: full_tensor() of every tensor to rank 0, torch.save, fsync
and the ways to read it back:
  dd read           one `dd bs=16M` of the 1-file copy to /dev/null (one stream)
  dd read parallel  every rank `dd`s its own checkpoint files at once: the same bytes, files and
                    parallelism as hybridpar's load, with nothing done to them
  load hybridpar    Checkpointer.load into the sharded layout
  load rank0        rank 0 torch.load, then broadcast and keep each rank's slice
"Cold" rows drop the page cache first (sync; echo 3 > /proc/sys/vm/drop_caches: needs root,
otherwise the JSON says cold_reads false), so bytes come from the disk; "warm" rows run right
after the cold one, with the files still in the page cache, and measure the CPU cost of loading.
The raw disk read speed is the faster of the two dd reads. Prints a table and writes
bench/results/checkpoint.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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


def sharded_state(gb: float, world: int, n_tensors: int = 16) -> torch.nn.Module:
    """`gb` GB of float32 parameters, 16 tensors split by rows over the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    rows = int(gb * 1e9 / 4 / n_tensors / 1024) // world * world
    torch.manual_seed(0)
    model = torch.nn.Module()
    for i in range(n_tensors):  # each rank creates only its shard: no rank ever holds the whole state
        local = torch.randn(rows // world, 1024)
        model.register_parameter(f"w{i}", torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)])))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="total state size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--folder", default="", help="where to write (default: a temporary folder)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_state(args.gb, world)
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

    def dd_read_parallel() -> None:
        for part in sorted((root / "dcp" / f"step-{step[0]:08d}").glob(f"__{rank}_*.distcp")):
            out = subprocess.run(["dd", "bs=16M", f"if={part}", "of=/dev/null"], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(out.stderr)

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

    names = ("dd write", "save hybridpar", "save rank0", "dd read", "dd read parallel", "load hybridpar",
             "load rank0", "load hybridpar warm", "load rank0 warm")
    times: dict[str, list[float]] = {k: [] for k in names}
    cold = False

    def cold_timed(fn) -> float:
        nonlocal cold
        if rank == 0:
            cold = drop_page_cache()
        return timed(fn)

    load_before = os.getloadavg()[0]  # other work on the machine, reported beside the figures
    writes = [("dd write", dd_write), ("save hybridpar", save_hybridpar), ("save rank0", save_rank0)]
    for i in range(args.rounds):
        # Each writer follows each other one in turn: a disk still busy with the previous burst
        # (host-side caching, discards of deleted files) slows whoever comes next.
        for name, fn in writes[i % 3:] + writes[: i % 3]:
            times[name].append(timed(fn))
            checkpointer.wait()  # old checkpoints are deleted in the background: not during the others
        times["dd read"].append(cold_timed(dd_read))
        times["dd read parallel"].append(cold_timed(dd_read_parallel))
        times["load hybridpar"].append(cold_timed(load_hybridpar))
        times["load hybridpar warm"].append(timed(load_hybridpar))
        times["load rank0"].append(cold_timed(load_rank0))
        times["load rank0 warm"].append(timed(load_rank0))

    if rank == 0:
        report(times, nbytes, world, args.rounds, cold, (load_before, os.getloadavg()[0]), Path(args.out))
        shutil.rmtree(root, ignore_errors=True)
    checkpointer.close()
    dist.destroy_process_group()


def report(times: dict[str, list[float]], nbytes: int, world: int, rounds: int, cold: bool,
           load_average: tuple[float, float], out: Path) -> None:
    """Best-of-rounds speeds and their ratios, and the median of the per-round ratios (a round's
    figures are taken seconds apart, so they pair fairly when the disk's speed drifts)."""
    gbps = {k: nbytes / min(v) / 1e9 for k, v in times.items()}

    def per_round(num: str, *den: str) -> float:
        # seconds of the baseline / seconds of hybridpar = how many times faster hybridpar is
        return statistics.median(min(times[d][i] for d in den) / times[num][i] for i in range(rounds))

    disk_read = max(gbps["dd read"], gbps["dd read parallel"])
    ratios = {
        "save_vs_disk": gbps["save hybridpar"] / gbps["dd write"],
        "save_vs_rank0": gbps["save hybridpar"] / gbps["save rank0"],
        "load_vs_disk": gbps["load hybridpar"] / disk_read,
        "load_vs_dd_one_stream": gbps["load hybridpar"] / gbps["dd read"],
        "load_vs_rank0": gbps["load hybridpar"] / gbps["load rank0"],
        "load_vs_rank0_warm": gbps["load hybridpar warm"] / gbps["load rank0 warm"],
    }
    medians = {
        "save_vs_disk": per_round("save hybridpar", "dd write"),
        "save_vs_rank0": per_round("save hybridpar", "save rank0"),
        "load_vs_disk": per_round("load hybridpar", "dd read", "dd read parallel"),
        "load_vs_dd_one_stream": per_round("load hybridpar", "dd read"),
        "load_vs_rank0": per_round("load hybridpar", "load rank0"),
        "load_vs_rank0_warm": per_round("load hybridpar warm", "load rank0 warm"),
    }
    print(f"\n{nbytes / 1e9:.2f} GB of state over {world} ranks, {rounds} interleaved rounds, cold reads "
          f"{'from disk (page cache dropped)' if cold else 'POSSIBLY FROM THE PAGE CACHE (no root)'}; "
          f"load average {load_average[0]:.1f} before, {load_average[1]:.1f} after on {os.cpu_count()} cores")
    print(f"{'what':<20}{'best s':>8}{'median s':>10}{'GB/s':>7}")
    for k, v in times.items():
        print(f"{k:<20}{min(v):>8.2f}{statistics.median(v):>10.2f}{gbps[k]:>7.2f}")
    print(f"{'ratio':<22}{'best-of':>8}{'per-round median':>18}")
    for k, v in ratios.items():
        print(f"{k:<22}{v:>7.2f}x{medians[k]:>17.2f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bytes": nbytes, "world": world, "rounds": rounds, "cold_reads": cold,
                               "load_average_before_after": load_average, "cpu_count": os.cpu_count(),
                               "seconds": times, "gb_per_s": gbps, "ratios": ratios,
                               "ratios_per_round_median": medians}, indent=2) + "\n")
    print(f"wrote {out}")


class _ParallelStub:
    """The fields Checkpointer reads from ParallelDims (this bench has no model mesh)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size, self.device = rank, world, torch.device("cpu")


if __name__ == "__main__":
    main()
