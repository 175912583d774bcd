"""How long `hybridpar --help` and `hybridpar train --help` take, as the user waits for them.

    python3 bench/cli_help.py [--repeats 7] [--root DIR] [--out bench/results/cli_help.json]

Each run is a fresh `python -m hybridpar ... --help` process, timed from its start to its exit
(interpreter start-up included), with the checkout `--root` (default this one) first on PYTHONPATH,
so another commit's copy can be timed the same way. Also records whether the process imported
torch (its import is most of the time when it does). Prints the median and the range per command,
and writes bench/results/cli_help.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {"hybridpar --help": ["--help"], "hybridpar train --help": ["train", "--help"]}
# Run after the help text is printed: did this process import torch?
PROBE = ("import runpy, sys\nsys.argv = ['hybridpar', *sys.argv[1:]]\ntry:\n    runpy.run_module('hybridpar', "
         "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")


def time_once(root: Path, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hybridpar", *args], cwd=root, env=env, capture_output=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"hybridpar {' '.join(args)} failed:\n{done.stderr.decode()[-2000:]}")
    return seconds


def imports_torch(root: Path, args: list[str]) -> bool:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=root, env=env, capture_output=True, text=True)
    return done.stderr.strip().splitlines()[-1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose hybridpar is timed")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cli_help.json"))
    opts = parser.parse_args()
    root = Path(opts.root).resolve()
    baseline = time_once(root, ["--version"])  # warms the file cache; not counted
    results = {}
    for name, args in COMMANDS.items():
        runs = [time_once(root, args) for _ in range(opts.repeats)]
        results[name] = {"runs": runs, "median": statistics.median(runs), "imports_torch": imports_torch(root, args)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - start
    print(f"{'command':<24} {'median s':>9} {'min':>6} {'max':>6}  torch  ({opts.repeats} runs each; {root})")
    for name, r in results.items():
        print(f"{name:<24} {r['median']:>9.3f} {min(r['runs']):>6.3f} {max(r['runs']):>6.3f}  "
              f"{'yes' if r['imports_torch'] else 'no'}")
    print(f"{'(python -c pass)':<24} {bare:>9.3f}")
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpus": os.cpu_count(), "root": str(root), "repeats": opts.repeats,
                               "warm_up_seconds": baseline, "python_bare_seconds": bare, "results": results},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
