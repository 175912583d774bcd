"""The cost of checkpoint checksums: save and load with them against without, in the same processes.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/checksums.py [--gb 0.5 --rounds 6]

Each round saves and loads the same sharded state (bench/checkpoint.py's: float32 tensors split by
rows) once with checksums (A: summed while writing, checked as the reader reads) and once without
(B: HYBRIDPAR_CHECKSUMS=0, for this measurement only), alternating A B and B A so machine noise
hits each alike. Each checkpoint is loaded twice: cold (page cache dropped first, as root; the
speed bench/README.md gives for loads) and warm (just read: the CPU cost of checking shows, not
the disk's). A crc32c line measures the checksum alone on one core. Prints a table with
the ratios B/A (1.00x: free) and writes bench/results/checksums.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.checkpoint import _ParallelStub, drop_page_cache, sharded_state, timed  # noqa: E402
from hybridpar.checkpoint import checksums  # noqa: E402
from hybridpar.checkpoint.dcp import Checkpointer  # noqa: E402


def crc_speed(nbytes: int = 256 << 20) -> float:
    """GB/s of CRC-32C over a buffer in memory, on this core."""
    import crc32c

    data = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    start = time.perf_counter()
    crc32c.crc32c(data)
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=0.5, help="total state size")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--folder", default="", help="where to write (default: a temporary folder)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checksums.json"))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_state(args.gb, world)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    root = Path(args.folder or tempfile.gettempdir()) / "hybridpar-checksums-bench"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    checkpointer = Checkpointer(root, _ParallelStub(rank, world), keep=2)
    kinds = ("save", "cold load", "load")
    times: dict[str, list[float]] = {f"{k} {m}": [] for k in kinds for m in ("with", "without")}
    step = [0]

    def measure(mode: str) -> None:
        os.environ[checksums.ENV] = "1" if mode == "with" else "0"
        step[0] += 1
        times[f"save {mode}"].append(timed(lambda: (checkpointer.save(step[0], model, None, {}, {}),
                                                    checkpointer.wait())))
        path = root / f"step-{step[0]:08d}"
        cold = [drop_page_cache() if rank == 0 else None]  # one rank drops the cache for all (root only)
        dist.broadcast_object_list(cold)
        if cold[0]:
            times[f"cold load {mode}"].append(timed(lambda: checkpointer.load(path, model, None, {})))
        times[f"load {mode}"].append(timed(lambda: checkpointer.load(path, model, None, {})))

    load_before = os.getloadavg()[0]
    for i in range(args.rounds):
        for mode in (("with", "without") if i % 2 == 0 else ("without", "with")):
            measure(mode)
    os.environ.pop(checksums.ENV)
    if rank == 0:
        report(times, nbytes, world, args.rounds, (load_before, os.getloadavg()[0]), Path(args.out))
        shutil.rmtree(root, ignore_errors=True)
    checkpointer.close()
    dist.destroy_process_group()


def report(times: dict[str, list[float]], nbytes: int, world: int, rounds: int,
           load_average: tuple[float, float], out: Path) -> None:
    """Best and median seconds, and the ratio without/with per round (median) and best-of."""
    ratios, medians = {}, {}
    times = {k: v for k, v in times.items() if v}  # no cold loads where the page cache cannot be dropped
    for what in ("save", "cold load", "load"):
        if f"{what} with" not in times:
            continue
        a, b = times[f"{what} with"], times[f"{what} without"]
        ratios[what] = min(b) / min(a)
        medians[what] = statistics.median(bb / aa for aa, bb in zip(a, b))
    crc = crc_speed()
    print(f"\n{nbytes / 1e9:.2f} GB of state over {world} ranks, {rounds} rounds (A B / B A); load average "
          f"{load_average[0]:.1f} before, {load_average[1]:.1f} after on {os.cpu_count()} cores; crc32c "
          f"{crc:.1f} GB/s on one core")
    print(f"{'what':<20}{'best s':>8}{'median s':>10}{'GB/s':>7}")
    for k, v in times.items():
        print(f"{k:<20}{min(v):>8.2f}{statistics.median(v):>10.2f}{nbytes / min(v) / 1e9:>7.2f}")
    print(f"{'without / with':<20}{'best-of':>8}{'per-round median':>18}")
    for k in ratios:
        print(f"{k:<20}{ratios[k]:>7.2f}x{medians[k]:>17.2f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bytes": nbytes, "world": world, "rounds": rounds, "crc32c_gb_per_s": crc,
                               "load_average_before_after": load_average, "cpu_count": os.cpu_count(),
                               "seconds": times, "ratio_without_over_with": ratios,
                               "ratio_per_round_median": medians}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
