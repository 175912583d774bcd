"""The planner against measurement: `hybridpar plan --gpu cpu`'s step time for bench/run.py's
layouts against what bench/run.py measures on this machine, in one run; and the planner against
published GPU runs (hybridpar/plan/published.py).

    python3 bench/planner.py                                  # bench/run.py's tiny layouts, then the plan
    python3 bench/planner.py --measured bench/results/train.json   # a run made earlier on this machine

bench/run.py runs hybridpar alone (no recipe engine) on the tiny shape over its four layouts and
weak scaling at 1 and 2 ranks; then, per world size, the planner measures this machine
(hybridpar.plan.cpu.measure_cpu) and estimates each layout. The error is planned / measured - 1 of
the median step time. Writes bench/results/planner.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def measured_cases(path: Path) -> list[dict]:
    """(layout, tokens, median step seconds) of every hybridpar case and weak-scaling point."""
    data = json.loads(path.read_text())
    cases = []
    for c in data["cases"]:
        if c["engine"] == "hybridpar":
            cases.append({"shape": c["shape"], "mp": c["mp"], "dp_shard": c["dp_shard"],
                          "dp_replicate": c["dp_replicate"], "micro_batch": c["micro_batch"],
                          "seq_len": c["seq_len"], "step_time": c["median"]["step_time"]})
    shape = data["options"]["weak_shape"]
    micro_batch, seq_len = next(((c["micro_batch"], c["seq_len"]) for c in cases if c["shape"] == shape), (4, 128))
    for w in data.get("weak_scaling", []):
        tokens = micro_batch * seq_len * w["world"]
        cases.append({"shape": shape, "mp": 1, "dp_shard": w["world"], "dp_replicate": 1, "micro_batch": micro_batch,
                      "seq_len": seq_len, "step_time": tokens / w["tokens_per_s"]})
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default="", help="bench/run.py's JSON from this machine (default: run it now)")
    parser.add_argument("--repeats", type=int, default=2, help="bench/run.py rounds per layout")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner.json"))
    opts = parser.parse_args(argv)

    from hybridpar.plan import Layout, Workload, estimate
    from hybridpar.plan.cpu import measure_cpu
    from hybridpar.plan.published import compare, format_table
    from hybridpar.models.args import ModelArgs

    measured = Path(opts.measured) if opts.measured else Path(tempfile.mkdtemp(prefix="planner-bench-")) / "train.json"
    if not opts.measured:
        print("bench/run.py: tiny, 4 layouts and weak scaling at 1 and 2 ranks, hybridpar alone", flush=True)
        subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--shapes", "tiny", "--engines", "hybridpar",
                        "--weak", "1,2", "--repeats", str(opts.repeats), "--out", str(measured)], check=True, cwd=ROOT)
    rows, hardware = [], {}
    for case in measured_cases(measured):
        world = case["mp"] * case["dp_shard"] * case["dp_replicate"]
        if world not in hardware:
            print(f"measuring this machine for {world} rank(s)", flush=True)
            hardware[world] = measure_cpu(world)
        layout = Layout(case["mp"], case["dp_shard"], case["dp_replicate"], "none")
        workload = Workload(seq_len=case["seq_len"], micro_batch=case["micro_batch"], param_dtype="float32",
                            reduce_dtype="float32")
        e = estimate(ModelArgs.from_preset(case["shape"]), layout, workload, hardware[world])
        rows.append({**case, "world": world, "planned": e.time.step, "error": e.time.step / case["step_time"] - 1,
                     "compute": e.time.compute, "tp": e.time.tp_comm, "fsdp": e.time.dp_exposed})

    print("\nthe planner on this CPU (fp32, one thread per rank), against bench/run.py")
    print(f"{'layout':<28} {'ranks':>5} {'measured s':>10} {'planned s':>9} {'error':>6}   planned: compute + tp + fsdp")
    for r in rows:
        name = f"{r['shape']} mp{r['mp']} x {r['dp_shard']}x{r['dp_replicate']}"
        print(f"{name:<28} {r['world']:>5} {r['step_time']:>10.3f} {r['planned']:>9.3f} {100 * r['error']:>+5.0f}%"
              f"   {r['compute']:.3f} + {r['tp']:.3f} + {r['fsdp']:.3f}")
    for world, hw in hardware.items():
        print(f"  {world} rank(s): {hw.name}")
    published = compare()
    print("\nthe planner against published GPU runs\n" + format_table(published))

    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "the planner against bench/run.py on this CPU and against published GPU runs",
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "cpu": rows, "hardware": {str(w): hw.name for w, hw in hardware.items()},
        "published": [{"name": r.case.name, "gpu": r.case.gpu, "gpus": r.case.gpus, "published": r.published,
                       "planned": r.planned, "error": r.error, "source": r.case.source,
                       "missing": r.case.missing} for r in published],
    }, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
