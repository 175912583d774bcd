"""The death tests, many times over: does anything of a rank's follow the watchdog's verdict?

    OMP_NUM_THREADS=1 python bench/death_repeat.py --rounds 20 [--cases kill_setup,kill_save]

Each round runs every case of tests/diagnostics/test_watchdog.py's DEATHS (a rank killed or exiting
in set-up, a forward, the optimizer step or a checkpoint's writes; world 4 and 8) as that test runs
it, under torchrun, and counts per case: verdicts naming the dead rank, and jobs whose output after
the verdict holds a "Traceback" or a rank's line ("[rankN]:", what the test refuses). A flaky race
shows as a few bad rounds in many. Writes bench/results/death_repeat.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.diagnostics.test_watchdog import DEATHS, FAULT_STEP, _run_fault  # noqa: E402

VERDICT_END = "the ranks exit with code"


def corpus(root: Path) -> dict:
    """The tests' corpus (tests/conftest.py), made once; its cache is shared by every round."""
    from hybridpar.data import default_corpus_documents

    path = root / "docs.jsonl"
    with open(path, "w") as f:
        for doc in default_corpus_documents(400):
            f.write(json.dumps({"text": doc}) + "\n")
    return {"source": str(path), "cache_dir": str(root / "cache")}


def one(data: dict, case: str, folder: Path) -> dict:
    """One job of `case`: was the dead rank named, and what followed the verdict."""
    fault, world, rank = DEATHS[case]
    save = {"checkpoint.every": 1} if fault == "kill_save" else {}
    began = time.perf_counter()
    try:
        result, _ = _run_fault(data, folder, fault, rank, world, **save)
    except AssertionError as err:  # the fault never fired: no verdict to look at
        return {"case": case, "named": False, "exit": None, "seconds": round(time.perf_counter() - began, 1),
                "traceback_after": False, "rank_line_after": False, "tail": str(err)[-1500:]}
    err = result.stderr
    headline = f"rank(s) [{rank}] died (the process is gone"
    named = headline in err and (folder / "run" / "hang_report.json").exists()
    after = err[err.index(VERDICT_END):] if VERDICT_END in err else ""
    # The launcher's own summary ends in its traceback (ChildFailedError): the test allows it, and
    # so is it left out here; any other traceback is a rank's.
    blocks = after.split("Traceback (most recent call last):")[1:]
    ranks = [b for b in blocks if "ChildFailedError" not in b.split("Traceback")[0]]
    return {"case": case, "named": named, "exit": result.returncode, "seconds": round(time.perf_counter() - began, 1),
            "traceback_after": bool(ranks), "rank_line_after": bool(re.search(r"^\[rank\d+\]:", after, re.M)),
            "tail": after[-3000:] if (ranks or not named) else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cases", default=",".join(DEATHS), help=f"some of {', '.join(DEATHS)}")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "death_repeat.json"))
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in DEATHS]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; the cases are {', '.join(DEATHS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hybridpar-deaths-") as tmp:
        data = corpus(Path(tmp))
        for r in range(1, args.rounds + 1):
            for case in cases:
                with tempfile.TemporaryDirectory(dir=tmp) as folder:
                    row = {"round": r, **one(data, case, Path(folder))}
                rows.append(row)
                bad = row["traceback_after"] or row["rank_line_after"] or not row["named"]
                print(f"round {r:>2} {case:<17} named {row['named']!s:<5} traceback after {row['traceback_after']!s:<5} "
                      f"rank line after {row['rank_line_after']!s:<5} {row['seconds']:5.1f} s"
                      + (f"\n{row['tail']}" if bad else ""), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"fault_step": FAULT_STEP, "rounds_done": r, "rows": rows}, indent=1))
    total = len(rows)
    print(f"{total} jobs in {args.rounds} rounds: {sum(x['named'] for x in rows)} verdicts naming the dead rank, "
          f"{sum(x['traceback_after'] for x in rows)} with a Traceback after the verdict, "
          f"{sum(x['rank_line_after'] for x in rows)} with a rank's line after it")


if __name__ == "__main__":
    main()
