"""How long the dry run takes and how much memory it needs, at the sizes it is for.

    python3 bench/dryrun.py [--repeats 1]

Each case runs `hybridpar train --dry-run` in a fresh process (OMP_NUM_THREADS=1), timed from the
start of the process to its exit, its peak resident memory read from the kernel (the child's
ru_maxrss). The targets: under 2 minutes and under 4 GB on 2 cores. Prints a table and writes
bench/results/dryrun.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    # name: (world, flags)
    "llama2_70b world 128 (mp 8 x dp_shard 8 x dp_replicate 2)": (128, [
        "--config", "llama2_70b", "--parallel.dp_shard", "8", "--parallel.dp_replicate", "-1"]),
    "llama3.1_405b world 1024 (mp 8 x dp_shard 128)": (1024, [
        "--config", "llama2_70b", "--model.preset", "llama3.1_405b", "--data.seq_len", "8192",
        "--parallel.dp_shard", "-1", "--parallel.dp_replicate", "1", "--fsdp.sharding_strategy", "full_shard"]),
}
TARGET_SECONDS, TARGET_BYTES = 120.0, 4e9


def run_case(world: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "hybridpar", "train", "--dry-run", "--world", str(world),
               "--json", str(report), *flags]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        if done.returncode != 0:
            raise SystemExit(f"dry run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        data = json.loads(report.read_text())
    return {"seconds": seconds, "peak_rss": peak, "peak_rss_is_max_so_far": before * 1024 >= peak,
            "reported_seconds": data["seconds"], "state_bytes": data["state_bytes"],
            "collective_calls": sum(r["calls"] for r in data["collectives"]), "ok": data["ok"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    results = {}
    for name, (world, flags) in CASES.items():
        runs = [run_case(world, flags) for _ in range(args.repeats)]
        results[name] = {"world": world, "runs": runs}
    print(f"{'case':<58} {'seconds':>8} {'peak RSS':>9} {'calls':>6}  target: < {TARGET_SECONDS:.0f} s, "
          f"< {TARGET_BYTES / 1e9:.0f} GB")
    for name, r in results.items():
        worst = max(r["runs"], key=lambda x: x["seconds"])
        print(f"{name:<58} {worst['seconds']:>8.1f} {worst['peak_rss'] / 1e9:>8.2f}G {worst['collective_calls']:>6}  "
              f"{'ok' if worst['seconds'] < TARGET_SECONDS and worst['peak_rss'] < TARGET_BYTES else 'MISSED'}")
    out = ROOT / "bench" / "results" / "dryrun.json"
    out.write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
