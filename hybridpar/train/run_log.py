"""What a run says: its opening lines (begin: rank 0 also writes the run folder's config.toml), and
after each step a skipped step's event, the progress line every train.log_every steps (and
after the first and the last) with the means of the steps since the previous line, and the rows of
metrics.jsonl (between lines, the straggler report's and the evaluations' numbers alone)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from ..config import Config, dump_toml
from ..data.blend import describe_blend
from ..files import write_text_atomic
from ..mesh.layout import sizes_text
from . import data_stop, stop as stopping
from .clock import StepClock
from .dashboard import plot_dashboard
from .experts import AUX_LOSS, PREFIX as EXPERTS
from .metrics import MetricsWriter, log_row, progress_line, validation_text
from .summary import summarise, write_summary
from .validation import missing_validation

log = logging.getLogger(__name__)


class RunLog:
    def __init__(self, config: Config, metrics: MetricsWriter, loader, downstream, replicas=None, *,
                 is_main: bool) -> None:
        self.config, self.metrics, self.loader, self.downstream, self.is_main = config, metrics, loader, downstream, is_main
        self.replicas = replicas  # the replica groups (hybridpar.replicas), whose record the summary gives
        self.run_dir = Path(config.output.run_dir)
        self.history: list[dict] = []  # every step's numbers
        self.clock: Optional[StepClock] = None  # the loop's: the progress line's elapsed time and ETA
        self.window: list[dict] = []  # the steps since the last progress line
        self.hot: Optional[int] = None  # the ep rank whose experts were hot at the last step

    def begin(self, args, parallel, global_batch: int, *, has_validation: bool, resumed_from: Optional[Path],
              step: int) -> None:
        """Rank 0, before the first step: the run folder and its config.toml, the run's shape in a line."""
        c, run_dir = self.config, self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.toml", dump_toml(c))
        (run_dir / stopping.MARKER).unlink(missing_ok=True)  # it told of an earlier run's end
        log.info(f"hybridpar: {args.num_params() / 1e6:.1f}M parameters, {parallel.world_size} ranks = "
                 f"{sizes_text(*parallel.sizes, ep=parallel.ep)}, {c.fsdp.sharding_strategy}, global batch {global_batch} "
                 f"x {c.data.seq_len} tokens, {self.loader.windows} sequences in the data")
        if not has_validation and (c.train.eval_every or c.train.eval_steps):
            log.warning("hybridpar: warning: train.eval_every / train.eval_steps are set, but the run has no "
                        f"validation data: {missing_validation(c)}")
        if resumed_from is not None:
            log.info(f"resumed from {resumed_from} at step {step}")
            if step >= c.train.steps:
                log.info(f"already at step {step} of {c.train.steps}: nothing to train "
                         "(raise train.steps to continue)")

    def record(self, m: dict, row: dict) -> None:
        """Step m["step"] done: `m` the trainer's step numbers, `row` what came with it (a straggler
        report, evaluations)."""
        step, steps = m["step"], self.config.train.steps
        # A mixture of experts' numbers (hybridpar.train.experts), in metrics.jsonl every step.
        row = {**{k: v for k, v in m.items() if k.startswith(EXPERTS) or k == AUX_LOSS}, **row}
        self._hot(step, m)
        self.history.append(m)
        self.window.append(m)
        if m["skipped"]:
            self.metrics.event(step, "skipped", loss=m["loss"], grad_norm=m["grad_norm"])  # on the dashboard
            if self.is_main:
                log.info(f"step {step}: non-finite loss {m['loss']} or gradient norm: step skipped")
        if step % self.config.train.log_every == 0 or step in (1, steps):
            # A blend's tokens trained on so far, per source ({} for one source).
            summary = {**log_row(self.window), **{f"tokens/{s['name']}": s["tokens"] for s in describe_blend(self.loader)}}
            self.metrics.write(step, {**summary, **row})
            if self.is_main:
                log.info(progress_line(step, steps, {**summary, **row}, self.clock.elapsed(),
                                       self.clock.eta(step, steps)))
            self.window = []
        elif row:
            self.metrics.write(step, row)
            if self.is_main and validation_text(row):
                log.info(f"step {step:>5}/{steps}{validation_text(row)}")

    def _hot(self, step: int, m: dict) -> None:
        """An ep rank's experts hot from this step on (or another's than before): said once, and an event."""
        hot = m.get(EXPERTS + "hot_rank")
        if hot is not None and hot != self.hot:
            self.metrics.event(step, "hot_experts", rank=hot, line=m[EXPERTS + "hot"])  # on the dashboard
            if self.is_main:
                log.warning(f"step {step}: {m[EXPERTS + 'hot']}")
        self.hot = hot

    def end(self, profiler) -> None:
        """Rank 0, after the last step: the profiled steps' table, the dashboard (loss.png)."""
        if profiler.rows:
            log.info(profiler.describe())
        if self.config.output.plot and self.metrics.jsonl_path.exists():
            plot_dashboard(self.metrics.jsonl_path, self.run_dir / "loss.png", grad_clip=self.config.optim.grad_clip)

    def summary(self, *, steps: tuple[int, int], started: float, evaluations, peak_memory_gb: float,
                checkpoint: Optional[Path], tokenizer, stopped: str, data_stopped: Optional[Exception],
                has_validation: bool) -> None:
        """Rank 0: the end-of-run block (summary.py) and summary.json. `steps`: (the step after the one
        this start began at, the last); the steps trained are the history's (a replica group healed to
        its peers' step trained from there)."""
        h, c = self.history, self.config
        seconds = sum(m["step_time"] for m in h)
        ranges = step_ranges([m["step"] for m in h])
        text, done = summarise(
            run_dir=self.run_dir, steps=(ranges[0][0], steps[1]) if ranges else steps, ranges=ranges,
            replica_groups=self.replicas.report() if self.replicas is not None else None,
            skipped=sum(m["skipped"] for m in h),
            tokens=sum(m["tokens"] for m in h), wall_seconds=time.perf_counter() - started,
            train_seconds=seconds, eval_seconds=evaluations.seconds,
            mfu=sum(m["mfu"] * m["step_time"] for m in h) / seconds if seconds else 0.0,
            peak_memory_gb=peak_memory_gb, train_loss=log_row(h[-c.train.log_every:])["loss"] if h else None,
            validation=evaluations.validation, checkpoint=checkpoint, tokenizer=getattr(tokenizer, "path", None),
            config_path=self.run_dir / "config.toml", config=c, stopped=stopped,
            no_validation="" if has_validation else missing_validation(c), sources=describe_blend(self.loader),
            data_stop=data_stop.kind(data_stopped), downstream=self.downstream.scores)
        write_summary(self.run_dir, done)
        log.info(text)


def step_ranges(steps: list[int]) -> list[tuple[int, int]]:
    """[1, 2, 3, 27, 28] -> [(1, 3), (27, 28)]."""
    ranges: list[tuple[int, int]] = []
    for step in steps:
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], step)
        else:
            ranges.append((step, step))
    return ranges
