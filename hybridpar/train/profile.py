"""train.profile_steps: a torch.profiler trace of chosen steps on every rank, with each collective
named by its mesh dimension, and the split of each step into compute, communication and, under
pipeline parallelism, the pipeline's sends and receives.

Written to <run_dir>/profile/:
  rank<r>.<time>.pt.trace.json  the trace (Chrome trace format: chrome://tracing or ui.perfetto.dev;
                                the TensorBoard profiler plugin reads the folder as it is)
  rank<r>.steps.json            per step: seconds, communication seconds per mesh dimension, the
                                pipeline's seconds, compute
  rank<r>.memory.pickle         on GPUs, a CUDA memory snapshot (pytorch.org/memory_viz)

Communication is the time this rank spends inside collectives and in waits for async ones; the
pipeline's is the time in its sends and receives and in the waits for them, where a stage idles
until its neighbour's activations or gradients arrive (the bubble); compute is the rest of the
step. In the trace, each step is a range "ProfilerStep#<n>", each collective "collective <op>
[<dim>]" (its wait: "wait <op> [<dim>]"), each send or receive "p2p <op> [pp]".
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Optional

import torch

from ..diagnostics.collectives import CollectiveCounter, mesh_dims
from ..files import write_text_atomic
from ..mesh.device import ParallelDims


class StepProfiler:
    """`with profiler.step(n):` around each training step; traces the steps of `steps` (a range or None)."""

    def __init__(self, steps: Optional[range], run_dir: Path, parallel: ParallelDims) -> None:
        self.steps, self.parallel = steps, parallel
        self.folder = Path(run_dir) / "profile"
        self.rank = parallel.rank
        self.rows: list[dict] = []
        self._profiler: Optional[torch.profiler.profile] = None
        self._counter: Optional[CollectiveCounter] = None
        self._held = contextlib.ExitStack()  # the profiler and the counter, from the first profiled step to the last
        self.trace: Optional[Path] = None

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.parallel.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profiler = self._held.enter_context(torch.profiler.profile(activities=activities, record_shapes=True))
        self._counter = self._held.enter_context(CollectiveCounter(label=mesh_dims(self.parallel), profile=True,
                                                                   waits=True, p2p=True))

    def _stop(self) -> None:
        profiler, self._counter, self._profiler = self._profiler, None, None
        self._held.close()  # the counter, then the profiler
        if profiler is None:
            return
        handler = torch.profiler.tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")
        before = set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json"))
        handler(profiler)
        made = sorted(set(self.folder.glob(f"rank{self.rank}.*.pt.trace.json")) - before)
        self.trace = made[-1] if made else None
        write_text_atomic(self.folder / f"rank{self.rank}.steps.json", json.dumps(self.rows, indent=1) + "\n")
        if self.parallel.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    @contextlib.contextmanager
    def step(self, step: int):
        if self.steps is None or step not in self.steps:
            yield
            return
        if self._profiler is None:
            self._start()
        self._counter.reset()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                yield
        finally:
            if self.parallel.device.type == "cuda":
                torch.cuda.synchronize(self.parallel.device)
            seconds = time.perf_counter() - start
            dims, p2p = self._counter.by_dim(), self._counter.p2p_totals()
            communication = sum(d["seconds"] for d in dims.values())
            self.rows.append({"step": step, "seconds": seconds, "communication_s": communication,
                              "pipeline_s": p2p["seconds"], "compute_s": max(0.0, seconds - communication - p2p["seconds"]),
                              "by_dim": {dim: {"calls": d["calls"], "bytes": d["payload"], "seconds": d["seconds"]}
                                         for dim, d in dims.items()},
                              "pipeline": {"calls": p2p["calls"], "bytes": p2p["payload"], "seconds": p2p["seconds"]}})
            if step == self.steps[-1]:
                self._stop()

    def close(self) -> None:
        """A run that ends (or stops) inside the profiled steps still writes what it traced."""
        self._stop()

    def describe(self) -> str:
        """One line per profiled step: its compute, each mesh dimension's collectives and (under
        pipeline parallelism) the pipeline's sends and receives with their waits."""
        lines = [f"profile of steps {self.steps[0]}-{self.steps[-1]} (rank {self.rank}): {self.folder}"]
        for row in self.rows:
            dims = ", ".join(f"{dim} {1e3 * d['seconds']:.1f} ms in {d['calls']}" for dim, d in row["by_dim"].items())
            pipe = row["pipeline"]
            pipeline = (f" + pipeline {1e3 * pipe['seconds']:.1f} ms ({pipe['calls']} sends and receives, their "
                        "waits for the other stages included)" if pipe["calls"] else "")
            lines.append(f"  step {row['step']}: {1e3 * row['seconds']:.1f} ms = compute {1e3 * row['compute_s']:.1f} ms"
                         f" + communication {1e3 * row['communication_s']:.1f} ms ({dims or 'none'}){pipeline}")
        return "\n".join(lines)
