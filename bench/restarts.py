"""A killed rank under `torchrun --standalone --max-restarts`, many times over: does the restart resume?

    OMP_NUM_THREADS=1 python bench/restarts.py --rounds 5 [--against /path/to/other/checkout]

Each round is tests/launch/test_standalone_restart.py's: 2 ranks (mp 2), rank 1 SIGKILLed from
outside as the step-4 checkpoint of 12 is being written. Rounds alternate torch's default store (the agent's,
kept across restarts) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; with --against, the other checkout
runs the same rounds interleaved with this one's. Counts per arm: rounds that resumed and finished,
rounds that failed to connect or hung, and the seconds from the kill to the job's end. Writes
bench/results/restarts.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.death_repeat import corpus  # noqa: E402
from tests.launch.test_standalone_restart import restart_round  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout (e.g. ec7aedb's), run interleaved")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a round may take")
    args = parser.parse_args()
    arms = [("this", ROOT, True), ("this, variable set", ROOT, False)]
    if args.against:
        arms += [("against", args.against.resolve(), True)]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp))
        for n in range(args.rounds):
            for name, root, share in (arms if n % 2 == 0 else arms[::-1]):
                r = restart_round(data, Path(tmp) / f"{n}-{len(results[name])}-{name.replace(' ', '_')}", share,
                                  root=root, timeout=args.timeout)
                r.pop("log")
                results[name].append(r)
                print(f"round {n + 1} {name:20s} rc {r['returncode']}  resumed {r['resumed']}  finished {r['finished']}"
                      f"  connect failed {r['connect_failed']}  {r['seconds_after_kill']} s", flush=True)
    print(f"\n| arm | rounds | resumed and finished | failed to connect | hung or failed otherwise | s kill -> end (median) |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name, rows in results.items():
        ok = [r for r in rows if r["returncode"] == 0 and r["finished"] and r["resumed"]]
        conn = [r for r in rows if r not in ok and r["connect_failed"]]
        med = statistics.median(r["seconds_after_kill"] for r in ok) if ok else float("nan")
        summary[name] = {"rounds": len(rows), "finished": len(ok), "connect_failed": len(conn),
                         "other": len(rows) - len(ok) - len(conn), "median_seconds": med, "rows": rows}
        print(f"| {name} | {len(rows)} | {len(ok)} | {len(conn)} | {len(rows) - len(ok) - len(conn)} | {med:.1f} |")
    out = ROOT / "bench" / "results" / "restarts.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
