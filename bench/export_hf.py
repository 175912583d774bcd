"""The sharded Hugging Face export (export_hf): per-rank peak memory against what a rank must hold,
and GB/s against the disk's write speed.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/export_hf.py [--dim 1024 --layers 8 --rounds 4]

A seeded Llama (fp32 master weights, FSDP2 over dp, tensor parallel over mp 2) is exported in
bfloat16; rounds interleave A B C A B C, so the disk's drift hits each alike:
  dd write     `dd if=/dev/zero bs=16M conv=fsync` of the export's size into the same folder
               (rank 0: the disk's speed for one stream)
  full_tensor  every parameter cast to bf16 and gathered to every rank (DTensor.full_tensor, what
               the export did before sending each to its writer alone), nothing written
  export       export_hf with --shard-mb shards (each rank writes its shards, fsynced)
Memory, per rank, in every export round: VmHWM (the resident high-water mark, reset through
/proc/self/clear_refs just before) minus VmRSS at that moment, i.e. what the export added at its
peak; memory freed earlier that malloc still keeps is handed back first (malloc_trim), or its
reuse would hide. Against: the rank's assignment (the bytes of its shards) plus the largest
tensor, the bound the export promises, and one shard plus the largest tensor, what writing each
shard as soon as it is complete comes to. A last row exports the same model as one file (a 1 TB
limit), which rank 0 then holds whole, as the export did before shards. glibc keeps freed blocks
under its mmap threshold (dynamic, up to 32 MB) for reuse, which raises the resident peak above
the live bytes: MALLOC_MMAP_THRESHOLD_=131072 shows the live bytes (the JSON records the
setting). Prints a table and writes bench/results/export_hf.json (--out).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.checkpoint.foreign import model_shapes
from hybridpar.checkpoint.hf import export_hf, hf_name, hf_order
from hybridpar.checkpoint.hf_shards import plan_shards


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_extra_bytes(fn) -> int:
    """Bytes by which this process's resident set rose at its peak while fn() ran (VmHWM, reset first)."""
    gc.collect()
    # Memory freed earlier but kept by malloc would be reused unseen: hand it back first.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def expected_holdings(args, dtype: torch.dtype, max_bytes: int, world: int) -> list[dict]:
    """Per rank: its assignment (bytes of its shards), its largest shard, and the largest tensor."""
    shapes = model_shapes(args)
    plan = plan_shards([(hf_name(n), shapes[n]) for n in hf_order(args)], dtype, max_bytes)
    sizes = [sum(plan.nbytes[n] for n in names) for names in plan.files]
    largest = max(plan.nbytes.values())
    return [{"assignment": sum(sizes[rank::world]), "largest_shard": max(sizes[rank::world], default=0),
             "largest_tensor": largest, "n_files": len(sizes)} for rank in range(world)]


def build(dim: int, layers: int, vocab: int):
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.mesh.device import init_parallel
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer

    args = ModelArgs(dim=dim, n_layers=layers, n_heads=dim // 64, n_kv_heads=dim // 128, vocab_size=vocab,
                     max_seq_len=256)
    parallel = init_parallel(mp=2)
    torch.manual_seed(0)
    model = Transformer(args, parallel)
    apply_fsdp(model, parallel, FSDPConfig(sharding_strategy="full_shard", param_dtype="float32"))
    return args, parallel, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=float, default=20.0, help="max_shard_size in MB (10^6 bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default="", help="where to write (default: a temporary folder)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "export_hf.json"))
    opts = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args, parallel, model = build(opts.dim, opts.layers, opts.vocab)
    dtype, max_bytes = torch.bfloat16, int(opts.shard_mb * 1e6)
    nbytes = sum(math.prod(s) for s in model_shapes(args).values()) * dtype.itemsize
    root = Path(opts.folder or tempfile.gettempdir()) / "hybridpar-export-bench"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    load_before = os.getloadavg()[0]
    dist.barrier()

    def dd_write() -> None:
        if rank == 0:
            count = max(1, round(nbytes / (16 << 20)))
            done = subprocess.run(["dd", "if=/dev/zero", f"of={root / 'dd.bin'}", "bs=16M", f"count={count}",
                                   "conv=fsync"], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(done.stderr)
            os.unlink(root / "dd.bin")

    def gather_only() -> None:
        state = model.state_dict()
        for name in hf_order(args):
            state[name].to(dtype).full_tensor()

    def export(limit) -> None:
        export_hf(model, root / "hf", parallel, dtype=dtype, max_shard_size=limit)

    def clear() -> None:  # outside the timed region: deleting the last export is not this one's work
        if rank == 0:
            shutil.rmtree(root / "hf", ignore_errors=True)
        dist.barrier()

    export(max_bytes)  # warm-up, unmeasured: first-use imports and allocations are not the export's
    clear()
    times: dict[str, list[float]] = {"dd write": [], "full_tensor": [], "export": []}
    peaks: dict[str, list[int]] = {"export": [], "one file": []}
    for _ in range(opts.rounds):
        for name in times:  # A B A B: the disk's drift hits both alike
            dist.barrier()
            start = time.perf_counter()
            if name == "export":
                peaks["export"].append(peak_extra_bytes(lambda: export(max_bytes)))
            else:
                (dd_write if name == "dd write" else gather_only)()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
            clear()
    peaks["one file"].append(peak_extra_bytes(lambda: export(10**12)))
    dd_bytes = max(1, round(nbytes / (16 << 20))) * (16 << 20)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {k: max(v) for k, v in peaks.items()})
    if rank == 0:
        report(opts, args, times, per_rank, expected_holdings(args, dtype, max_bytes, world),
               expected_holdings(args, dtype, 10**12, world), nbytes, dd_bytes, world,
               (load_before, os.getloadavg()[0]), Path(opts.out))
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def report(opts, args, times, per_rank, held, held_one, nbytes, dd_bytes, world, load, out: Path) -> None:
    sizes = {"export": nbytes, "full_tensor": nbytes, "dd write": dd_bytes}
    gbps = {k: [sizes[k] / t / 1e9 for t in v] for k, v in times.items()}
    ratio = [e / d for e, d in zip(gbps["export"], gbps["dd write"])]
    mb = 1e6
    n_params = sum(math.prod(s) for s in model_shapes(args).values())
    print(f"\nexport_hf of {nbytes / 1e9:.3f} GB (bf16; {n_params / 1e6:.1f}M parameters, dim {args.dim}, "
          f"{args.n_layers} layers, vocab {args.vocab_size}) at world {world} "
          f"(mp 2 x dp {world // 2}, FSDP2), {held[0]['n_files']} shards of <= {opts.shard_mb:g} MB; "
          f"load average {load[0]:.1f} before, {load[1]:.1f} after on {os.cpu_count()} cores")
    print(f"{'rank':>4}{'peak extra MB':>15}{'assignment+tensor':>19}{'shard+tensor':>14}"
          f"{'one file: peak':>16}{'its file+tensor':>17}")
    rows = []
    for rank, (seen, h, h1) in enumerate(zip(per_rank, held, held_one)):
        bound = h["assignment"] + h["largest_tensor"]
        streaming = h["largest_shard"] + h["largest_tensor"]
        one_bound = h1["assignment"] + h1["largest_tensor"]
        rows.append({"rank": rank, "peak_extra_bytes": seen["export"], "assignment_bytes": h["assignment"],
                     "largest_shard_bytes": h["largest_shard"], "largest_tensor_bytes": h["largest_tensor"],
                     "bound_assignment_plus_tensor": bound, "shard_plus_tensor": streaming,
                     "one_file_peak_extra_bytes": seen["one file"], "one_file_assignment_bytes": h1["assignment"]})
        print(f"{rank:>4}{seen['export'] / mb:>15.1f}{bound / mb:>19.1f}{streaming / mb:>14.1f}"
              f"{seen['one file'] / mb:>16.1f}{one_bound / mb:>17.1f}")
    print(f"{'what':<12}{'best GB/s':>10}{'median GB/s':>13}")
    for k, v in gbps.items():
        print(f"{k:<12}{max(v):>10.3f}{statistics.median(v):>13.3f}")
    print(f"export / disk: best-of {max(gbps['export']) / max(gbps['dd write']):.2f}x, "
          f"per-round median {statistics.median(ratio):.2f}x; export / full_tensor alone: per-round median "
          f"{statistics.median(e / g for e, g in zip(gbps['export'], gbps['full_tensor'])):.2f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bytes": nbytes, "world": world, "mp": 2, "dim": args.dim, "layers": args.n_layers, "vocab": args.vocab_size,
        "shard_mb": opts.shard_mb, "n_shards": held[0]["n_files"], "rounds": opts.rounds, "cpu_count": os.cpu_count(),
        "load_average_before_after": load, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "seconds": times, "gb_per_s": gbps, "export_vs_disk_per_round": ratio,
        "memory": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
