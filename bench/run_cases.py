"""bench/run.py's cases: one case's ranks started as fresh worker processes (bench/worker.py) and
watched to the end, and one engine's figures (throughput, MFU, per-rank state, collective bytes, peak
RSS) summarised from their per-rank results."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class RunError(RuntimeError):
    pass


def launch(case: dict, world: int, timeout: float) -> list[dict]:
    """Start `world` worker processes for one case; their per-rank results in rank order."""
    work = Path(tempfile.mkdtemp(prefix="hybridpar-train-bench-"))
    procs = []
    try:
        (work / "case.json").write_text(json.dumps(case))
        from hybridpar.mesh.layout import free_port

        port = free_port()
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
            log = open(work / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen([sys.executable, "-m", "bench.worker", str(work / "case.json"), str(work)],
                                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p, _ in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p, _ in procs):
                failed_at = now  # the others may hang in a collective the failed rank never joins
            if now > deadline or (failed_at is not None and now - failed_at > 20):
                break
            time.sleep(0.2)
        _stop(procs)
        results, errors = [], []
        for rank in range(world):
            path = work / f"rank{rank}.json"
            if path.exists():
                r = json.loads(path.read_text())
                (results if r["ok"] else errors).append(r)
            else:
                log = (work / f"rank{rank}.log").read_text()[-3000:]
                errors.append({"rank": rank, "error": f"no result (timed out or died); log tail:\n{log}"})
        if errors:
            detail = "\n".join(f"--- rank {e['rank']} ---\n{e['error']}" for e in errors[:2])
            raise RunError(f"{case['engine']} {case['label']} failed on ranks {[e['rank'] for e in errors]}\n{detail}")
        return sorted(results, key=lambda r: r["rank"])
    finally:
        _stop(procs)
        shutil.rmtree(work, ignore_errors=True)


def _stop(procs) -> None:
    """Kill whichever of these ranks (the processes launch() started, by handle) still run."""
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()


def summarise(case: dict, ranks: list[dict], name: str, args_obj) -> dict:
    """One engine's figures in one run, from the per-rank results."""
    import torch

    from hybridpar.train.metrics import flops_per_token

    from bench.comm import analytic_bytes

    world = len(ranks)
    mine = [r["engines"][name] for r in ranks]
    mp, shard, rep = case["mp"], case["dp_shard"], case["dp_replicate"]
    steps, warm = len(mine[0]["step_times"]), case["warmup"]
    slowest = [max(r["step_times"][i] for r in mine) for i in range(warm, steps)]
    step_time = statistics.median(slowest)
    # CPU seconds of all ranks per step: robust to other load on the machine (wall time is not).
    cpu_per_step = statistics.median(sum(r["cpu_times"][i] for r in mine) for i in range(warm, steps))
    tokens = case["micro_batch"] * case["seq_len"] * shard * rep
    tok_s = tokens / step_time
    peak = statistics.mean(r["peak_flops"] for r in ranks)
    peak_cpu = statistics.mean(r["peak_flops_cpu"] for r in ranks)
    fpt = flops_per_token(args_obj, case["seq_len"])
    numel = args_obj.num_params()
    ideal_one = numel * 4 / (mp * shard)
    ideal = {"parameters": ideal_one, "gradients": ideal_one, "optimizer": 2 * ideal_one}
    state = {k: max(r["state_bytes"][k] for r in mine) for k in ideal}
    compute_bytes = torch.finfo(getattr(torch, case.get("precision", "float32"))).bits // 8
    analytic = analytic_bytes(args_obj, mp=mp, dp_shard=shard, dp_replicate=rep,
                              micro_batch=case["micro_batch"], seq_len=case["seq_len"],
                              param_bytes=compute_bytes, act_bytes=compute_bytes)
    wire = max(r["comm_wire"] for r in mine)
    single = len(ranks[0]["engines"]) == 1  # peak RSS belongs to one engine only in a run of its own
    rss_train = [r["peak_rss_train"] for r in ranks if r["peak_rss_train"] is not None]
    return {
        "tokens_per_step": tokens, "step_time": step_time, "tokens_per_s": tok_s,
        "cpu_s_per_step": cpu_per_step, "tokens_per_cpu_s": tokens / cpu_per_step,
        "mfu": fpt * tok_s / (peak * world), "mfu_cpu": fpt * tokens / (cpu_per_step * peak_cpu),
        "peak_flops_per_rank": peak, "peak_flops_per_cpu_s": peak_cpu, "flops_per_token": fpt,
        "step_times_slowest_rank": slowest,
        "state_bytes": state, "state_ideal": ideal,
        "state_ratio": {k: state[k] / ideal[k] for k in ideal} | {"total": sum(state.values()) / sum(ideal.values())},
        "comm_wire_bytes": wire, "comm_analytic": analytic, "comm_ratio": wire / analytic["total"] if analytic["total"] else None,
        "comm_by_op_rank0": mine[0]["comm"], "comm_calls_rank0": mine[0]["comm_calls"],
        "comm_seconds_max": max(r["comm_seconds"] for r in mine),
        # CPU spent inside collectives, over the counted step's CPU, summed over ranks.
        "comm_cpu_share": sum(r["comm_cpu_seconds"] for r in mine) / sum(r["counted_step_cpu"] for r in mine),
        "counted_step_time_max": max(r["counted_step_time"] for r in mine),
        "peak_rss_train_max": (max(rss_train) if rss_train else None) if single else None,
        "peak_rss_lifetime_max": max(r["peak_rss_lifetime"] for r in ranks) if single else None,
        "setup_s": max(r["setup_s"] for r in mine), "engines_in_run": list(ranks[0]["engines"]),
        "losses": mine[0]["losses"], "hybridpar_file": ranks[0]["hybridpar_file"],
    }
