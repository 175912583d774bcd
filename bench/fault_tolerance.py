"""Replica groups that fail alone (launch/slurm.sh --ft) against the requeue path, and the cost of
torchft's managed all-reduce when nothing fails.

    OMP_NUM_THREADS=1 python3 bench/fault_tolerance.py [--rounds 1] [--ab-rounds 3] [--ab-steps 30]

1. Recovery, on the local 3-node Slurm cluster (tests/launch/cluster.py; needs root): 40 steps of the
   tiny Llama (mp 2 on each node's 2 ranks, checkpoints every 10, tests/launch/test_slurm_ft.py's
   MODEL); once step 10 and its checkpoint are done, every rank of one node is SIGKILLed. Arms:
   --ft with 3 groups (one per node; the test's round), --ft with 2 groups on 2 nodes (the requeue
   job's world), and without --ft: a 2-node job (mp 2 x dp 2, MAX_RESTARTS=0) whose verdict names
   the node, which slurm.sh excludes before requeueing the job onto the spare node, where it resumes
   from the step-10 checkpoint (its best case: a kill later in a checkpoint interval also redoes the
   steps since). Seconds from the kill to the node named, to the failed group (the job) training
   again and to step 40; the job's wall time.
2. The managed all-reduce with no failure, on this machine: the local config's model at 4 ranks,
   mp 2 x 2 replicas, as plain dp_replicate 2 (torchrun --standalone) and as 2 groups of launch/ft_local.sh,
   the runs interleaved A B A B; each run's median step time (its first 4 steps left out), and in the
   groups' runs the median seconds per step of their own calls (timed around ReplicaGroups' methods by
   a sitecustomize on the ranks' path): the quorum (begin_step), the managed all-reduce of the
   gradients (average) and the commit.
Prints tables and writes bench/results/fault_tolerance.json (a part not run keeps its figures there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.death_repeat import corpus  # noqa: E402
from tests.launch.cluster import JOB_TIMEOUT, job_id, local_cluster, submit  # noqa: E402
from tests.launch.common import free_port, script_env, stop_session  # noqa: E402
from tests.launch.test_slurm_ft import KILL_AT, MODEL, STEPS, ft_round  # noqa: E402

HURRY = "ExcNodeList=n"  # as tests/launch/test_heal.py: the requeued job starts once Slurm's hold allows
# On each rank of the groups' runs: ReplicaGroups' calls timed, one line per call in TIMING_DIR.
TIMING = """
import os
if os.environ.get("LOCAL_RANK") and os.environ.get("TIMING_DIR"):
    import json, time
    from hybridpar.replicas import groups

    def timed(name, call):
        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return call(self, *args, **kwargs)
            finally:
                with open(os.path.join(os.environ["TIMING_DIR"], f"{self.ft.group}-{os.environ['RANK']}.jsonl"), "a") as f:
                    f.write(json.dumps({"call": name, "step": self.step, "s": time.perf_counter() - start}) + "\\n")
        return wrapper

    for name in ("begin_step", "average", "commit"):
        setattr(groups.ReplicaGroups, name, timed(name, getattr(groups.ReplicaGroups, name)))
"""


def _rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except (OSError, json.JSONDecodeError):
        return []


def requeue_round(cluster, data: dict, folder: Path) -> dict:
    """The path without --ft: the node without rank 0 (the store's host) killed after step KILL_AT's
    checkpoint; timed from the kill through the verdict, the requeue and the resume to step STEPS."""
    run_dir = folder / "run"
    started = time.monotonic()
    job = job_id(submit(cluster, run_dir, folder / "slurm.out", STEPS, data, every=10, overrides=MODEL, PREFLIGHT=0,
                        MAX_RESTARTS=0))
    job_dir, checkpoint = run_dir / f"job-{job}", run_dir / "checkpoints" / f"step-{KILL_AT:08d}"
    deadline = time.monotonic() + 2 * JOB_TIMEOUT
    while not (checkpoint.is_dir() and any(r.get("step", 0) >= KILL_AT for r in _rows(job_dir / "metrics.jsonl"))):
        assert time.monotonic() < deadline, (job_dir / "job.log").read_text()[-4000:]
        time.sleep(0.2)
    ranks = {int(env["RANK"]): (env.get("SLURMD_NODENAME"), pid) for pid, env in cluster.rank_processes(job)}
    node = next(n for n, _ in ranks.values() if n != ranks[0][0])
    killed, wall = time.monotonic(), time.time()
    for n, pid in ranks.values():
        if n == node:
            os.kill(pid, signal.SIGKILL)
    last: dict = {}

    def watch_last_step() -> None:  # the metrics of the requeued start: step STEPS's row
        while "s" not in last and time.monotonic() < deadline:
            if any(r.get("step") == STEPS for r in _rows(job_dir / "metrics.jsonl")):
                last["s"] = time.monotonic() - killed
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_last_step, daemon=True)
    watcher.start()
    try:
        shown = cluster.wait_completed(job, deadline, job_dir / "job.log", hurry=HURRY)
    finally:
        cluster.cancel_all()
    watcher.join(timeout=5)
    events = {e["event"]: e for e in _rows(run_dir / "incidents.jsonl")}
    fault, again = events["fault"], events["training_again"]
    assert fault["nodes"] == [node] and "requeue" in events, (events, shown)
    # Slurm's starts after the first: 1, or 2 when slurmd refused the requeued start's credential (made in
    # the second the last one was revoked) and Slurm requeued it again itself, held for 120 s
    restarts = int(re.search(r"Restarts=(\d+)", shown).group(1))
    return {"job": job, "node": node, "killed_at": KILL_AT, "slurm_restarts": restarts,
            "named_s": fault["verdict_time"] - wall,
            "requeued_s": events["requeue"]["time"] - wall, "back_s": again["time"] - wall,
            "last_step_s": last.get("s"), "total_s": time.monotonic() - started,
            "redone_steps": KILL_AT - int(again["resumed_from"])}


def _ft(cluster, data: dict, folder: Path, groups: int) -> dict:
    r = ft_round(cluster, data, folder, groups=groups)
    assert "Restarts=0" in r["shown"] and r["back_s"] is not None, r["log"][-4000:]
    changes = [e for e in _rows(r["job_dir"] / "group-0" / "events.jsonl") if e["event"] == "groups"]
    # each step after the kill committed by the groups of the last change at or before it
    fewer = sum(len([e for e in changes if e["step"] <= step][-1]["groups"]) < groups
                for step in range(r["killed_at"] + 1, STEPS + 1))
    return {"job": r["job"], "node": r["node"], "killed_at": r["killed_at"], "named_s": r["named_s"],
            "back_s": r["back_s"], "last_step_s": r["last_step_s"], "total_s": r["total_s"],
            "redone_steps": 0, "steps_with_fewer_groups": fewer}


# --- the managed all-reduce, no failure -------------------------------------------------------------


def _overrides(data: dict, steps: int, run_dir: Path) -> list[str]:
    """The local config's model (the tiny Llama) at mp 2, each replica unsharded, on the test corpus."""
    return ["--parallel.mp", "2", "--parallel.dp_shard", "1", "--train.steps", str(steps), "--train.log_every", "1",
            "--train.eval_every", "0", "--checkpoint.every", "0", "--output.run_dir", str(run_dir), "--data.source",
            data["source"], "--data.tokenizer_vocab_size", "512", "--data.cache_dir", data["cache_dir"],
            "--output.tensorboard", "false", "--output.plot", "false"]


def step_time(arm: str, data: dict, folder: Path, steps: int) -> tuple[float, dict]:
    """One run of `arm` ("plain": dp_replicate 2 in one torchrun; "ft": 2 groups of launch/ft_local.sh):
    its median step time, the first 4 steps (and any a group trained alone) left out; for "ft" the
    median seconds per step of each ReplicaGroups call on group 0's rank 0."""
    run_dir, overrides = folder / "run", _overrides(data, steps, folder / "run")
    if arm == "plain":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                "-m", "hybridpar", "train", "--config", "local", *overrides, "--parallel.dp_replicate", "2"]
        env, metrics = script_env(), run_dir / "metrics.jsonl"
    else:
        argv = ["bash", str(ROOT / "launch" / "ft_local.sh"), *overrides]
        (folder / "inject").mkdir(parents=True)
        (folder / "inject" / "sitecustomize.py").write_text(TIMING)
        (folder / "timing").mkdir()
        env = script_env(RUN_DIR=str(run_dir), LIGHTHOUSE_PORT=str(free_port()), FT_GROUPS="2", PROCS="2",
                         TIMING_DIR=folder / "timing", PYTHONPATH=f"{folder / 'inject'}{os.pathsep}{ROOT}")
        metrics = run_dir / "group-0" / "metrics.jsonl"
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        stop_session(proc)
    rows = [r for r in _rows(metrics) if "step_time" in r and r["step"] > 4 and r.get("groups", 2) == 2]
    assert proc.returncode == 0 and len(rows) >= steps // 2, out[-3000:]
    calls = {}
    if arm == "ft":  # each call names the step before the one it is part of (ReplicaGroups.step)
        timed = _rows(folder / "timing" / "0-0.jsonl")
        kept = {r["step"] for r in rows}
        for name in ("begin_step", "average", "commit"):
            values = [t["s"] for t in timed if t["call"] == name and t["step"] + 1 in kept]
            calls[name] = statistics.median(values) if values else None
    return statistics.median(r["step_time"] for r in rows), calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the three recovery arms (0: none)")
    parser.add_argument("--ab-rounds", type=int, default=3, help="A B pairs of the step-time runs (0: none)")
    parser.add_argument("--ab-steps", type=int, default=30)
    args = parser.parse_args()
    result: dict = {"recovery": {}, "step_time": {"plain": [], "ft": []}, "ft_calls": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp))
        if args.rounds:
            arms = {"--ft, 3 groups (one per node)": lambda c, f: _ft(c, data, f, 3),
                    "--ft, 2 groups on 2 nodes": lambda c, f: _ft(c, data, f, 2),
                    "requeue (no --ft, 2 nodes + spare)": lambda c, f: requeue_round(c, data, f)}
            with local_cluster(Path(tmp) / "slurm") as cluster:
                for n in range(args.rounds):
                    for name, arm in (arms.items() if n % 2 == 0 else reversed(list(arms.items()))):
                        folder = Path(tmp) / f"round{n}-arm{list(arms).index(name)}"
                        folder.mkdir()  # sbatch's --output goes there
                        try:
                            row = arm(cluster, folder)
                        except AssertionError as error:  # a round that did not end as the arm should: counted
                            row = {"failed": str(error).splitlines()[0][:300]}
                            cluster.cancel_all()
                        result["recovery"].setdefault(name, []).append(row)
                        print(f"round {n + 1} {name}: {row}", flush=True)
        for n in range(args.ab_rounds):
            for arm in (("plain", "ft") if n % 2 == 0 else ("ft", "plain")):
                seconds, calls = step_time(arm, data, Path(tmp) / f"ab-{n}-{arm}", args.ab_steps)
                result["step_time"][arm].append(seconds)
                if calls:
                    result["ft_calls"].append(calls)
                print(f"pair {n + 1} {arm}: {seconds:.3f} s per step {calls or ''}", flush=True)
    out = ROOT / "bench" / "results" / "fault_tolerance.json"
    if out.exists():  # the part not run this time: the last run's
        last = json.loads(out.read_text())
        if not args.rounds:
            result["recovery"] = last.get("recovery", {})
        if not args.ab_rounds:
            result["step_time"], result["ft_calls"] = last.get("step_time", {}), last.get("ft_calls", [])
    _report(result)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def _report(result: dict) -> None:
    def med(rows: list[dict], key: str) -> str:
        values = [r[key] for r in rows if r.get(key) is not None]
        return f"{statistics.median(values):.1f}" if values else "-"

    if result["recovery"]:
        print("\n| path | rounds | node named | failed group (job) training again | step 40 | steps redone | job wall time |")
        print("|---|---|---|---|---|---|---|")
        for name, every in result["recovery"].items():
            rows = [r for r in every if "failed" not in r]
            print(f"| {name} | {len(rows)} of {len(every)} | {med(rows, 'named_s')} | {med(rows, 'back_s')} | "
                  f"{med(rows, 'last_step_s')} | {med(rows, 'redone_steps')} | {med(rows, 'total_s')} |")
    plain, ft = result["step_time"].get("plain", []), result["step_time"].get("ft", [])
    if plain and ft:
        extra = [b - a for a, b in zip(plain, ft)]
        print("\n| arm | s per step, each run | median |")
        print("|---|---|---|")
        for arm, values in (("plain dp_replicate 2", plain), ("2 replica groups (torchft)", ft)):
            print(f"| {arm} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.median(values):.3f} |")
        print(f"\nthe groups' step minus the plain one's, pair by pair: {', '.join(f'{e * 1000:+.0f} ms' for e in extra)}"
              f" (median {statistics.median(extra) * 1000:+.0f} ms, {statistics.median(ft) / statistics.median(plain):.2f}x)")
        result["step_time"]["extra_ms"] = [round(e * 1000, 1) for e in extra]
    if result["ft_calls"]:
        print("\nthe groups' own calls, ms per step (group 0's rank 0; median of each run's medians): " + ", ".join(
            f"{name} {statistics.median(c[name] for c in result['ft_calls'] if c[name] is not None) * 1000:.0f}"
            for name in ("begin_step", "average", "commit")))


if __name__ == "__main__":
    main()
