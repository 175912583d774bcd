"""`hybridpar doctor`: check a job's mesh, environment, links and data pipeline before training on it.

Run under the launcher and environment of training (torchrun, srun; a world of one works):
  1. layout: each rank's host, local rank, device and pid with its mesh coordinates; a warning when
     a model-parallel group spans hosts;
  2. environment (diagnostics/env.py): deprecated or unparsable NCCL variables, socket interfaces,
     contradicting timeouts, variables that differ between ranks, CPU oversubscription;
  3. bus bandwidth of all_reduce, all_gather and reduce_scatter on every mesh dimension, by
     nccl-tests' definitions (algbw = whole buffer / time; busbw = algbw x 2(n-1)/n for all_reduce,
     x (n-1)/n for the other two), comparable with the link speed at any n;
  4. data guard (with --config): the trainer's own data pipeline, its step-1 batches checked.
Every finding is an error, a warning or ok; `run_doctor` returns 1 when there is an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import Config
from ..files import write_text_atomic
from ..mesh.layout import MeshCoords, group_ranks, launch_env, sizes_text
from ..mesh.device import ParallelDims
from ..parallel.cost import COLLECTIVES as OPS
from ..parallel.cost import bus_factor
from ..compat.torch import all_gather_single, reduce_scatter_single
from ..mesh.ranks import gather_objects
from .data_guard import DataGuardError, check_data, step_fingerprint
from .env import (ERROR, OK, WARNING, Finding, allowed_cpus, check_env, check_rank_envs, check_threads, merge_findings, relevant_env,
                  sort_findings)

log = logging.getLogger(__name__)

DEFAULT_SIZES = "4K:64M"


# --- 1. layout --------------------------------------------------------------------------------------


def rank_info(parallel: ParallelDims, environ: Mapping[str, str]) -> dict:
    """What one rank reports about itself (small: it is all-gathered as a Python object)."""
    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = None
    return {
        "rank": parallel.rank, "host": socket.gethostname(), "local_rank": launch_env(environ).local_rank,
        "device": str(parallel.device), "pid": os.getpid(), "threads": torch.get_num_threads(),
        "cpu_ids": allowed_cpus(), "interfaces": interfaces, "env": relevant_env(environ),
    }


def layout_rows(infos: Sequence[Mapping], pp: int, dp_replicate: int, dp_shard: int, cp: int, mp: int) -> list[dict]:
    rows = []
    for info in infos:
        c = MeshCoords.of(info["rank"], pp, dp_replicate, dp_shard, cp, mp)
        rows.append({"rank": c.rank, "host": info["host"], "local_rank": info["local_rank"], "device": info["device"],
                     "pid": info["pid"], "pp_rank": c.pp_rank, "mp_rank": c.mp_rank, "cp_rank": c.cp_rank, "dp_rank": c.dp_rank,
                     "replicate_idx": c.replicate_idx, "shard_idx": c.shard_idx})
    return rows


def format_table(header: Sequence[str], rows: Sequence[Sequence], right: Sequence[bool]) -> str:
    cells = [[str(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]

    def line(values):
        return "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)).rstrip()

    return "\n".join([line(header)] + [line(r) for r in cells])


def format_layout(rows: Sequence[Mapping]) -> str:
    keys = ["rank", "host", "local_rank", "device", "pid", "mp_rank", "dp_rank", "replicate_idx", "shard_idx"]
    header = ["rank", "host", "local", "device", "pid", "mp_rank", "dp_rank", "replicate", "shard"]
    right = [True, False, True, False, True, True, True, True, True]
    if any(row.get("cp_rank", 0) for row in rows):  # the column only where context parallelism exists
        keys.insert(6, "cp_rank"), header.insert(6, "cp_rank"), right.insert(6, True)
    if any(row.get("pp_rank", 0) for row in rows):  # and pipeline parallelism's
        keys.insert(5, "pp_rank"), header.insert(5, "pp_rank"), right.insert(5, True)
    return format_table(header, [[row[k] for k in keys] for row in rows], right)


def check_layout(infos: Sequence[Mapping], pp: int, dp_replicate: int, dp_shard: int, cp: int,
                 mp: int) -> list[Finding]:
    """Model-parallel groups inside one host; no two ranks of a host on one device or local rank."""
    host = {i["rank"]: i["host"] for i in infos}
    findings = []
    spanning = [g for g in group_ranks(pp, dp_replicate, dp_shard, cp, mp)["mp"] if len({host[r] for r in g}) > 1]
    if spanning:
        shown = "; ".join(f"{g} on {sorted({host[r] for r in g})}" for g in spanning[:4])
        findings.append(Finding(WARNING, "layout",
                                f"{len(spanning)} model-parallel group(s) span hosts ({shown}): tensor-parallel "
                                "all-reduces run every layer and then cross the slower inter-node network; make mp "
                                "at most the processes per host and give each host a whole number of mp groups"))
    for key, what in (("device", "device"), ("local_rank", "local rank")):
        seen: dict[tuple, list[int]] = {}
        for i in infos:
            if key == "device" and not i["device"].startswith("cuda"):
                continue  # CPU ranks share the CPU by design
            seen.setdefault((i["host"], i[key]), []).append(i["rank"])
        for (h, value), ranks in seen.items():
            if len(ranks) > 1:
                findings.append(Finding(ERROR, "layout",
                                        f"ranks {ranks} on host {h} have the same {what} {value}: each process of a "
                                        "host needs its own LOCAL_RANK (torchrun sets it; under srun SLURM_LOCALID) "
                                        "and its own GPU"))
    if not findings:
        hosts = len(set(host.values()))
        findings.append(Finding(OK, "layout", f"{len(infos)} ranks on {hosts} host(s); model-parallel groups stay "
                                              "inside a host"))
    return findings


# --- 3. bus bandwidth -------------------------------------------------------------------------------


def bandwidths(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s for one collective over `nbytes` (the whole buffer) taking `seconds`."""
    algbw = nbytes / seconds
    return algbw, algbw * bus_factor(op, n)


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", text.upper())
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"bad size {text!r}: write bytes with an optional K, M or G suffix, e.g. 4K or 64M")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_sizes(text: str) -> list[int]:
    """'4K:64M' (x4 steps, as nccl-tests -f 4), '4K:64M:2' (factor 2) or a list '4K,1M,64M' -> bytes."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"bad --sizes {text!r}: use MIN:MAX[:FACTOR] such as 4K:64M, or a list such as 4K,1M")
        lo, hi = _parse_size(parts[0]), _parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].strip().isdigit() else (4 if len(parts) == 2 else 0)
        if factor < 2 or lo > hi:
            raise ValueError(f"bad --sizes {text!r}: need MIN <= MAX and an integer FACTOR >= 2")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= factor
        return sizes
    return [_parse_size(part) for part in text.split(",") if part.strip()]


def format_bytes(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B" if n < 1 << 10 else f"{n / (1 << 20):.2f}M"


def dim_groups(pp: int, dp_replicate: int, dp_shard: int, cp: int,
               mp: int) -> list[tuple[str, list[str], list[list[int]]]]:
    """The mesh dimensions worth measuring: (name, other names of the same groups, groups), in order
    mp, cp, dp, dp_shard, dp_replicate, pp, world; dimensions of one rank and repeats of an earlier one skipped."""
    kinds = group_ranks(pp, dp_replicate, dp_shard, cp, mp)
    candidates = [("mp", kinds["mp"]), ("cp", kinds.get("cp", [[0]])), ("dp", kinds["dp"]),
                  ("dp_shard", kinds["dp_shard"]), ("dp_replicate", kinds["dp_replicate"]),
                  ("pp", kinds.get("pp", [[0]])), ("world", [list(range(pp * dp_replicate * dp_shard * cp * mp))])]
    dims: list[tuple[str, list[str], list[list[int]]]] = []
    for name, groups in candidates:
        if len(groups[0]) < 2:
            continue
        same = next((d for d in dims if sorted(map(sorted, d[2])) == sorted(map(sorted, groups))), None)
        if same is not None:
            same[1].append(name)
        else:
            dims.append((name, [], groups))
    return dims


def _process_group(parallel: ParallelDims, name: str):
    return {"mp": parallel.mp_group, "cp": parallel.cp_group, "dp": parallel.dp_group,
            "dp_shard": parallel.dp_shard_group, "dp_replicate": parallel.dp_replicate_group, "pp": parallel.pp_group, "world": dist.group.WORLD}[name]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def buffer_numel(nbytes: int, n: int) -> int:
    """float32 elements of the whole buffer for a requested size: a multiple of the group size n."""
    return max(n, nbytes // 4 // n * n)


def time_collective(op: str, group, n: int, nbytes: int, iters: int, warmup: int, device: torch.device) -> float:
    """Mean seconds of one `op` over a float32 buffer of about `nbytes` (see buffer_numel)."""
    numel = buffer_numel(nbytes, n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)

    def once():
        if op == "all_reduce":
            dist.all_reduce(full, group=group)
        elif op == "all_gather":
            all_gather_single(full, part, group=group)
        else:
            reduce_scatter_single(part, full, group=group)

    for _ in range(warmup):
        once()
    _sync(device)
    dist.barrier(group=group)  # start together, so the time is the collective's, not the skew's
    start = time.perf_counter()
    for _ in range(iters):
        once()
    _sync(device)
    return (time.perf_counter() - start) / iters


def measure_busbw(parallel: ParallelDims, sizes: Sequence[int], iters: int, warmup: int = 2,
                  ops: Sequence[str] = OPS) -> list[dict]:
    """Collective: every rank times every (dim, op, size) on its own group of that dim (all groups of
    a dim run at once, as in training). Returns this rank's timings."""
    records = []
    for name, _, groups in dim_groups(*parallel.sizes):
        group, n = _process_group(parallel, name), len(groups[0])
        for op in ops:
            for size in sizes:
                seconds = time_collective(op, group, n, size, iters, warmup, parallel.device)
                records.append({"dim": name, "op": op, "bytes": 4 * buffer_numel(size, n), "seconds": seconds})
    return records


def summarise_busbw(per_rank: Sequence[Sequence[Mapping]], pp: int, dp_replicate: int, dp_shard: int, cp: int,
                    mp: int) -> list[dict]:
    """Rows of the bandwidth table from every rank's timings: a group's time is its slowest rank's
    (the collective ends when the last rank is done), and each row reports the slowest group."""
    dims = {name: (aliases, groups) for name, aliases, groups in dim_groups(pp, dp_replicate, dp_shard, cp, mp)}
    rows = []
    for i, record in enumerate(per_rank[0]):
        aliases, groups = dims[record["dim"]]
        n = len(groups[0])
        group_times = [max(per_rank[r][i]["seconds"] for r in g) for g in groups]
        slowest = max(range(len(groups)), key=lambda j: group_times[j])
        seconds = group_times[slowest]
        algbw, busbw = bandwidths(record["op"], record["bytes"], seconds, n)
        rows.append({"dim": record["dim"], "same_as": aliases, "n": n, "op": record["op"], "bytes": record["bytes"],
                     "time_us": seconds * 1e6, "algbw_gbps": algbw / 1e9, "busbw_gbps": busbw / 1e9,
                     "slowest_group": groups[slowest],
                     "group_busbw_gbps": [bandwidths(record["op"], record["bytes"], t, n)[1] / 1e9
                                          for t in group_times]})
    return rows


def format_busbw(rows: Sequence[Mapping]) -> str:
    """One line per (dim, size), a time and busbw column pair per collective (algbw is in the JSON)."""
    ops = list(dict.fromkeys(r["op"] for r in rows))
    lines: dict[tuple, dict] = {}
    for r in rows:
        lines.setdefault(("=".join([r["dim"], *r["same_as"]]), r["n"], r["bytes"]), {})[r["op"]] = r
    header = ["dim", "n", "size"] + [h for op in ops for h in (f"{op}_us", "busbw")]
    table = [[dim, n, format_bytes(nbytes)]
             + [v for op in ops for v in (f"{by_op[op]['time_us']:.1f}", f"{by_op[op]['busbw_gbps']:.3f}")]
             for (dim, n, nbytes), by_op in lines.items()]
    return format_table(header, table, [False] + [True] * (len(header) - 1))


# --- 4. data guard ----------------------------------------------------------------------------------


def build_loader(job, parallel: ParallelDims):
    """The loader the trainer builds, by the trainer's code (hybridpar.data.build_training_data):
    keyed by the data-parallel coordinates. `job`: a hybridpar.preflight.Job (its sources as it
    resolved them, not walked again) or a Config."""
    from ..data import build_training_data

    if isinstance(job, Config):
        return build_training_data(job, parallel)[1]
    return build_training_data(job.config, parallel, walked_sources=job.sources)[1]


def first_step_batches(loader, grad_accum: int) -> list:
    """The micro-batches of step 1, which the trainer fingerprints together."""
    return [next(loader) for _ in range(grad_accum)]


def guard_batches(parallel: ParallelDims, batches: Optional[list], problem: str = "") -> Finding:
    """Collective: the data guard on this rank's step-1 batches (None with `problem` when this rank
    could not build them: then no rank runs the check, and every rank reports the failures)."""
    problems = gather_objects(problem)
    if any(problems):
        shown = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        return Finding(ERROR, "data-guard", f"the data pipeline could not be built: {shown}")
    try:
        check_data(step_fingerprint(batches), parallel, step=1)
    except DataGuardError as err:
        return Finding(ERROR, "data-guard", str(err))
    shape = "x".join(map(str, batches[0][0].shape))
    return Finding(OK, "data-guard",
                   f"step-1 batches ({len(batches)} micro-batch(es) of {shape} tokens per rank): the {parallel.mp} "
                   f"rank(s) of each model-parallel group{' and the ' + str(parallel.cp) + ' of each cp group' if parallel.cp > 1 else ''} share theirs, the {parallel.dp_size} data-parallel ranks "
                   "all differ")


def run_data_guard(job, parallel: ParallelDims) -> Finding:
    """The data guard on the loader build_loader(job, parallel) gives."""
    config = job if isinstance(job, Config) else job.config
    try:
        batches, problem = first_step_batches(build_loader(job, parallel), config.train.grad_accum), ""
    except Exception as err:  # noqa: BLE001 - reported as a finding on every rank, not a hang
        batches, problem = None, f"{type(err).__name__}: {err}"
    return guard_batches(parallel, batches, problem)


# --- the run ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class DoctorOptions:
    sizes: Sequence[int] = dataclasses.field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    iters: int = 5
    warmup: int = 2
    ops: Sequence[str] = OPS
    busbw: bool = True
    data_guard: bool = False  # needs a config whose data section describes the training data
    out: Optional[Path] = None


def _section(title: str) -> str:
    return f"\n== {title} " + "=" * max(0, 72 - len(title))


def run_doctor(job, parallel: ParallelDims, options: DoctorOptions,
               environ: Optional[Mapping[str, str]] = None, echo=log.info) -> int:
    """Collective: run every check, rank 0 prints the report (and writes --json); 1 on errors, else 0
    on every rank. `job`: hybridpar.preflight.resolve_job's (or a config). `environ` is the
    environment as launched (before hybridpar's defaults)."""
    config = job if isinstance(job, Config) else job.config
    environ = dict(os.environ if environ is None else environ)
    for op in options.ops:
        bus_factor(op, 2)  # unknown names fail here, before any collective
    if options.iters < 1 or options.warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {options.iters} and {options.warmup}")
    p = parallel
    sizes = p.sizes
    infos = gather_objects(rank_info(p, environ))
    findings = _environment_findings(config, p, infos)
    rows: list[dict] = []
    if options.busbw:
        timings = gather_objects(measure_busbw(p, options.sizes, options.iters, options.warmup, options.ops))
        rows = summarise_busbw(timings, *sizes)
    if options.data_guard:
        findings.append(run_data_guard(job, p))
    findings = sort_findings(findings)
    errors = sum(f.level == ERROR for f in findings)
    if p.rank == 0:
        _report(p, infos, rows, findings, options, echo)
    # Every rank exits with the same code; waiting here keeps a launcher from stopping rank 0 (when the
    # others exit 1 first) before its report is out.
    dist.barrier()
    return 1 if errors else 0


def _environment_findings(config: Config, p: ParallelDims, infos: Sequence[Mapping]) -> list[Finding]:
    n_hosts = len({i["host"] for i in infos})
    findings = check_layout(infos, *p.sizes)
    per_rank = [check_env(i["env"], n_hosts=n_hosts, backend=p.backend, interfaces=i["interfaces"],
                          init_timeout=config.parallel.init_timeout, train_timeout=config.diagnostics.train_timeout)
                for i in infos]
    return findings + merge_findings(per_rank) + check_rank_envs([i["env"] for i in infos]) + check_threads(infos)


def _report(p: ParallelDims, infos: Sequence[Mapping], rows: list[dict], findings: list[Finding],
            options: DoctorOptions, echo) -> None:
    """Rank 0's printout (and --json)."""
    sizes = p.sizes
    hosts = sorted({i["host"] for i in infos})
    errors = sum(f.level == ERROR for f in findings)
    warnings = sum(f.level == WARNING for f in findings)
    echo(f"hybridpar doctor: {p.world_size} ranks = {sizes_text(*sizes)}, {p.backend} on {p.device.type}, {len(hosts)} host(s), torch {torch.__version__}")
    echo(_section("mesh layout"))
    echo(format_layout(layout_rows(infos, *sizes)))
    echo(_section("bus bandwidth in GB/s (nccl-tests formulas; slowest group per dim)"))
    if not options.busbw:
        echo("skipped (--no-busbw)")
    else:
        echo(format_busbw(rows) if rows else "nothing to measure: every mesh dimension has one rank")
    echo(_section("checks"))
    for f in findings:
        echo(f.line())
    if not options.data_guard:
        echo("(data guard skipped: pass --config with the training config to check its data pipeline)")
    verdict = "FAILED" if errors else "passed"
    echo(f"\ndoctor {verdict}: {errors} error(s), {warnings} warning(s)")
    if options.out:
        report = {
            "world_size": p.world_size, "pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp, "mp": p.mp,
            "backend": p.backend, "torch": torch.__version__, "hosts": hosts,
            "layout": layout_rows(infos, *sizes), "busbw": rows, "iters": options.iters,
            "findings": [f.to_dict() for f in findings], "errors": errors, "warnings": warnings,
        }
        write_text_atomic(options.out, json.dumps(report, indent=1) + "\n")
        echo(f"wrote {options.out}")
