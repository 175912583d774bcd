"""`python -m hybridpar.cli.incidents_command decide|note|summary|watch`: launch/slurm.sh's record of a
run's faults, its arguments and its printed answer (the policy and the file: hybridpar.incidents).

Torch-free and quick to start: the script calls it at every verdict and at the end of the job.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from ..incidents import GroupWatch, append, decide, fault_event, read, summary_lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridpar.cli.incidents_command",
                                     description="launch/slurm.sh's record of a run's faults (incidents.jsonl)")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decide", help="record a verdict and print: ACTION NODES (comma-separated) WHY")
    d.add_argument("incidents", type=Path)
    d.add_argument("report", type=Path, help="the verdict: a hang_report.json")
    d.add_argument("--job", required=True)
    d.add_argument("--exclude-on-fault", type=int, default=1)
    d.add_argument("--max-requeues", type=int, default=3)
    d.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun's in-job restarts (the verdict's attempt says how many are spent); 0 once it ended")
    d.add_argument("--needed", type=int, required=True)
    d.add_argument("--usable", default="", help="comma-separated nodes of the partition that can run jobs")
    d.add_argument("--excluded", default="", help="comma-separated nodes the job already excludes")
    r = sub.add_parser("note", help="append one event given as NAME=VALUE words")
    r.add_argument("incidents", type=Path)
    r.add_argument("fields", nargs="+")
    s = sub.add_parser("summary", help="the incidents, one line each")
    s.add_argument("incidents", type=Path)
    w = sub.add_parser("watch", help="launch/slurm.sh --ft: say each replica group's verdicts, drop-outs and "
                                     "returns until SIGTERM")
    w.add_argument("incidents", type=Path)
    w.add_argument("job_dir", type=Path, help="the job's folder (the groups' group-<g>/ in it)")
    w.add_argument("--job", required=True)
    w.add_argument("--nodes", required=True, help="each group's nodes, comma-separated, the groups separated by ';'")
    w.add_argument("--max-restarts", type=int, default=0, help="torchrun's restarts of each group")
    w.add_argument("--interval", type=float, default=0.5, help="seconds between looks")
    return parser


def _watch(args: argparse.Namespace) -> None:
    """Until SIGTERM (then one last look): each new line at once."""
    watch = GroupWatch(args.job_dir, args.nodes.split(";"), args.incidents, job=args.job,
                       max_restarts=args.max_restarts)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    while True:
        last = stopped.wait(args.interval)
        for line in watch.poll():
            print(line, flush=True)
        if last:
            return


def _words(text: str) -> list[str]:
    return [w for w in text.split(",") if w]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "decide":
        report = json.loads(args.report.read_text())
        events = read(args.incidents)
        decision = decide(report, events, job=args.job, exclude_on_fault=bool(args.exclude_on_fault),
                          max_requeues=args.max_requeues, needed=args.needed,
                          restarts_left=max(0, args.max_restarts - int(report.get("attempt", 0))),
                          usable=_words(args.usable), excluded=_words(args.excluded))
        append(args.incidents, fault_event(report, decision, args.job))
        print(decision["action"], ",".join(decision["nodes"]) or "-", decision["why"])
    elif args.command == "note":
        event = {}
        for field in args.fields:
            name, _, value = field.partition("=")
            event[name] = value
        append(args.incidents, event)
    elif args.command == "watch":
        _watch(args)
    else:
        for line in summary_lines(read(args.incidents)):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
