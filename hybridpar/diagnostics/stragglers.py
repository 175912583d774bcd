"""Straggler detection: the rank the others wait for, told apart from a slow link.

On measured steps every rank times its step and the time it spends blocked inside the collectives
of torch.distributed (a listener of diagnostics.wrap while training runs): wait = time inside them,
compute = step time - wait. A slow rank shows as compute on itself and as wait on its peers; a slow
link shows as wait on every member of its group, so it blames nobody. Every `every` steps one all-gather of (compute,
wait) per rank; rank 0 names the rank with the most compute and compares it with the median of
the others (under pipeline parallelism, the others of its stage: analyse_stages). A rank over the threshold in two reports in a row is a straggler: one report can be
a hiccup (a GC pause, the OS scheduler), a straggler worth naming is slow step after step.

Only the end of each window is measured: on a GPU the device is synchronised around every
collective of a measured step, which undoes the overlap of communication with compute, so the
last step alone; on the CPU that costs nothing and each rank sends its median of the last three.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..compat.torch import all_gather_single
from ..mesh.layout import MeshCoords
from ..mesh.device import ParallelDims
from ..mesh.ranks import gather_objects
from .node_fault import place
from .wrap import WAIT, Call, Listener

log = logging.getLogger(__name__)

CPU_SAMPLES = 3  # steps measured at the end of each window on the CPU (a GPU: one)


class CollectiveTimer(Listener):
    """Within `with` (a listener of diagnostics.wrap: the collectives of wrap.COLLECTIVES, the
    point-to-point ops of wrap.P2P and Work.wait), while `measuring`, the seconds spent inside them add up in `wait`; a call inside
    another (an alias, a collective's own Work.wait) counts once, in the outer one. A wrapper
    installed on torch.distributed before the layer is inside the call: its time counts as wait.
    `sync` (a GPU's synchronize) runs before a collective, so work queued earlier counts as compute,
    and after it, until it is done."""

    def __init__(self, sync: Optional[Callable[[], None]] = None) -> None:
        self.sync = sync
        self.measuring = False
        self.wait = 0.0

    def around(self, call: Call):
        return self._timing(call) if self.measuring and call.outer is None else None

    @contextmanager
    def _timing(self, call: Call) -> Iterator[None]:
        if self.sync is not None and call.kind != WAIT:
            self.sync()
        start = time.perf_counter()
        yield
        if self.sync is not None and not call.async_op:
            self.sync()  # an async collective is waited for in its Work.wait
        self.wait += time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One report: the rank with the most compute against the median of the others (seconds)."""

    rank: int
    compute: float
    median_compute: float  # of the other ranks
    ratio: float
    median_wait: float  # of all ranks
    spread: float  # max - min compute
    wait_share: float  # median wait / (median compute + median wait): a slow link shows here
    over: bool  # ratio > threshold in this report
    straggler: bool  # and in the report before


def analyse(compute: Sequence[float], wait: Sequence[float], threshold: float,
            previous: Optional[int] = None) -> Verdict:
    """The verdict on per-rank compute and wait seconds (at least two ranks); `previous`: the rank
    over the threshold in the report before, if any. The median is the others': between two ranks
    the median of all would be the mean of the straggler and its peer."""
    if len(compute) < 2 or len(compute) != len(wait):
        raise ValueError(f"need compute and wait of two or more ranks, got {len(compute)} and {len(wait)}")
    compute = [max(0.0, c) for c in compute]
    slowest = max(range(len(compute)), key=compute.__getitem__)
    median = statistics.median(c for r, c in enumerate(compute) if r != slowest)
    ratio = compute[slowest] / median if median > 0 else (1.0 if compute[slowest] == 0 else float("inf"))
    median_wait = statistics.median(wait)
    step = statistics.median(compute) + median_wait
    over = ratio > threshold
    return Verdict(rank=slowest, compute=compute[slowest], median_compute=median, ratio=ratio,
                   median_wait=median_wait, spread=compute[slowest] - min(compute),
                   wait_share=median_wait / step if step > 0 else 0.0, over=over,
                   straggler=over and previous == slowest)


def analyse_stages(compute: Sequence[float], wait: Sequence[float], pp: int, threshold: float,
                   previous: Optional[int] = None) -> Verdict:
    """`analyse` within each pipeline stage's ranks (pp outermost: stage s holds the s-th block of
    world / pp ranks), the verdict with the largest ratio, its rank the global one. The stages do
    different work by design (the embedding, the head, pp_layers): a rank is compared with its own
    stage's peers. Stages of one rank each have no peers: then all ranks are compared, as at pp 1."""
    per_stage = len(compute) // pp
    if pp == 1 or per_stage < 2:
        return analyse(compute, wait, threshold, previous)
    verdicts = []
    for start in range(0, len(compute), per_stage):
        v = analyse(compute[start:start + per_stage], wait[start:start + per_stage], threshold)
        rank = start + v.rank
        verdicts.append(dataclasses.replace(v, rank=rank, straggler=v.over and previous == rank))
    return max(verdicts, key=lambda v: v.ratio)


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.1f} ms"


def describe(verdict: Verdict, step: int, coords: MeshCoords, host: str, group: Optional[int] = None,
             hot: Optional[str] = None) -> str:
    """The warning line for a straggler (`group`: its replica group in a fault-tolerant job; `hot`: why
    it computes more, when its experts are hot)."""
    return (f"straggler at step {step}: rank {verdict.rank} ({coords.describe(group)}, host {host}) computes "
            f"{_seconds(verdict.compute)} per step against a median of {_seconds(verdict.median_compute)} "
            f"({verdict.ratio:.2f}x); the others wait for it" + (f"; {hot}" if hot else ""))


def metrics_row(verdict: Verdict, coords: MeshCoords, host: str, group: Optional[int] = None) -> dict:
    """The report as metrics.jsonl fields (the numbers also go to TensorBoard, under straggler/)."""
    v = verdict
    return {"straggler/slowest_rank": v.rank, "straggler/compute_s": v.compute,
            "straggler/median_compute_s": v.median_compute, "straggler/ratio": v.ratio,
            "straggler/median_wait_s": v.median_wait, "straggler/spread_s": v.spread,
            "straggler/wait_share": v.wait_share, "straggler/over": v.over, "straggler/flagged": v.straggler,
            "straggler/host": host, "straggler/coords": coords.describe(group)}


class StragglerMonitor:
    """The trainer's side: `with monitor:` around the training loop (the collectives wrapped),
    `with monitor.timing(step):` around each step, then `monitor.report(step)` on every rank."""

    def __init__(self, parallel: ParallelDims, every: int, threshold: float, start_step: int = 0, *,
                 exclude: float = 0.0, exclude_reports: int = 3, places: Optional[list] = None,
                 group: Optional[int] = None, hot: Optional[Callable[[int], Optional[str]]] = None) -> None:
        """start_step: the step this run starts from; its first step (lazy set-up, compilation) is not timed.
        exclude: a rank over this (higher) threshold in `exclude_reports` reports in a row is its
        node's fault: `excluding` says so on every rank (0: never). places: every rank's (host, node),
        if the caller has gathered them (else gathered here, a collective)."""
        self.parallel, self.threshold, self.start_step = parallel, threshold, start_step
        self.group = group  # the replica group of a fault-tolerant job: named with the straggler
        self.hot = hot  # rank -> why it computes more when its experts are hot (hybridpar.train.experts), or None
        self.exclude, self.exclude_reports = exclude, exclude_reports
        self._streak: tuple[Optional[int], int] = (None, 0)  # (rank, reports in a row) over `exclude`
        self.excluding: Optional[dict] = None
        self.every = every if parallel.world_size > 1 else 0  # alone, there is nobody to compare with
        device = parallel.device
        gpu = device.type == "cuda"
        self.timer = CollectiveTimer(functools.partial(torch.cuda.synchronize, device) if gpu else None)
        self.samples = 1 if gpu else CPU_SAMPLES
        self.places = places if places is not None else gather_objects(place()) if self.every else []
        self.measured: list[tuple[float, float]] = []  # (compute, wait) of this window's measured steps
        self.over: Optional[int] = None  # rank 0: the rank over the threshold in the last report

    def due(self, step: int) -> bool:
        """Is a report due after `step`?"""
        return self.every > 0 and step % self.every == 0

    def measures(self, step: int) -> bool:
        """Is `step` one of the last `samples` of its window (and not this run's first)?"""
        if not self.every or step <= self.start_step + 1:
            return False
        position = step % self.every
        return position == 0 or position > self.every - self.samples

    def __enter__(self) -> "StragglerMonitor":
        if self.every:
            self.timer.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.__exit__(*exc)

    @contextmanager
    def timing(self, step: int) -> Iterator[None]:
        """Around training step `step`, which must end with the device synchronised (train_step does)."""
        if not self.measures(step):
            yield
            return
        timer = self.timer
        if timer.sync is not None:
            timer.sync()
        timer.wait, timer.measuring = 0.0, True
        start = time.perf_counter()
        try:
            yield
        finally:
            timer.measuring = False
        self.measured.append((time.perf_counter() - start - timer.wait, timer.wait))

    def report(self, step: int) -> Optional[dict]:
        """Every rank, after step `step`: when due, one all-gather of each rank's median (compute, wait)
        over the world. Rank 0 prints a warning if a rank straggles and returns the metrics row."""
        if not self.due(step) or not self.measured:
            return None
        p = self.parallel
        mine = torch.tensor([statistics.median(column) for column in zip(*self.measured)],
                            dtype=torch.float64, device=p.device)
        table = torch.empty(2 * p.world_size, dtype=torch.float64, device=p.device)
        all_gather_single(table, mine)
        self.measured = []
        compute, wait = table.view(-1, 2).t().tolist()
        verdict = analyse_stages(compute, wait, p.pp, self.threshold, previous=self.over)  # every rank alike
        self._judge(verdict, step)
        if p.rank != 0:
            return None
        self.over = verdict.rank if verdict.over else None
        coords = MeshCoords.of(verdict.rank, *p.sizes)
        host = self.places[verdict.rank][0]
        hot = self.hot(verdict.rank) if self.hot is not None and verdict.over else None
        if verdict.straggler:
            log.info(describe(verdict, step, coords, host, self.group, hot))
        return {**metrics_row(verdict, coords, host, self.group), **({"straggler/hot_experts": hot} if hot else {})}

    def _judge(self, verdict: Verdict, step: int) -> None:
        """A rank over `exclude` in `exclude_reports` reports in a row: `excluding` names it and its node;
        not a rank whose experts are hot (`hot`, the same on every rank): its node is not at fault."""
        if not self.exclude or verdict.ratio <= self.exclude or (self.hot is not None and self.hot(verdict.rank)):
            self._streak = (None, 0)
            return
        rank, count = self._streak
        self._streak = (verdict.rank, count + 1 if rank == verdict.rank else 1)
        if self._streak[1] >= self.exclude_reports:
            host, node = self.places[verdict.rank]
            self.excluding = {"rank": verdict.rank, "host": host, "node": node, "ratio": round(verdict.ratio, 2),
                              **({"group": self.group} if self.group is not None else {}),
                              "reports": self._streak[1], "step": step}
