"""Training metrics: throughput, MFU, memory, and where they are written (rank 0 only).

MFU counts the FLOPs of the model's math, not of the hardware's work (ModelArgs.flops_per_token).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import resource
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from hybridpar.models.args import ModelArgs

from ..files import DiskFullError, full_disk_said, out_of_space, write_text_atomic
from ..progress import hms

flops_per_token = ModelArgs.flops_per_token  # flops_per_token(args, seq_len), as the trainer and bench call it
# What to change when the run folder's file system is full (files.full_disk_said says the rest).
RUN_DIR_ADVICE = "free space there or point output.run_dir elsewhere"
EVENTS = "events.jsonl"  # beside metrics.jsonl: {"step", "event": "resumed" | "skipped", ...}

# metrics.jsonl key -> TensorBoard / W&B tag: grouped, so each group is one section of the board.
# metrics.jsonl keeps its keys (the summary, the dashboard and scripts read them).
BOARD_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "skipped_steps": "train/skipped_steps", "aux_loss": "train/aux_loss",
    "val_loss": "val/loss", "val_ppl": "val/ppl", "val_tokens": "val/tokens",
    "step_time": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    "memory_gb": "memory/peak_gb", "memory_reserved_gb": "memory/reserved_gb", "eval_s": "perf/downstream_eval_s",
}
BOARD_PREFIXES = {"tokens/": "train/tokens/", "val_loss/": "val/loss/", "straggler/": "straggler/", "eval/": "eval/",
                  "experts/": "experts/"}


def board_tag(key: str) -> str:
    """The TensorBoard / W&B tag of a metrics.jsonl key (a key of no group goes under other/)."""
    if key in BOARD_TAGS:
        return BOARD_TAGS[key]
    for prefix, group in BOARD_PREFIXES.items():
        if key.startswith(prefix):
            return group + key[len(prefix):]
    return f"other/{key}"


def measure_matmul_peak(seconds: float = 1.0, size: int = 1024, dtype: torch.dtype = torch.float32,
                        start_together: Callable[[], None] = lambda: None, device: str | torch.device = "cpu") -> float:
    """FLOP/s this process reaches on a square matmul with its current thread count: the CPU 'peak'
    (on a GPU `device`, the card's rate for `dtype`). `start_together` runs after the warm-up, just
    before the clock starts (a barrier, so that ranks sharing cores measure the same window)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    # A GPU runs the matmuls asynchronously: each is waited for, so the clock times the work.
    wait = functools.partial(torch.cuda.synchronize, device) if torch.device(device).type == "cuda" else lambda: None
    torch.mm(a, b)  # warm-up: first call pays allocation and dispatch set-up
    wait()
    start_together()
    runs, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        wait()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return runs * 2.0 * size**3 / elapsed


def memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated, or the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_figures(device: torch.device) -> dict:
    """A step's memory in GB: memory_gb, the peak allocated (memory_bytes); on a GPU also
    memory_reserved_gb, the peak the caching allocator reserved: what the card must hold, and what
    the planner prices (hybridpar.plan: Hardware.allocator_overhead)."""
    figures = {"memory_gb": memory_bytes(device) / 1e9}
    if device.type == "cuda":
        figures["memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
    return figures


class WandbSettings(NamedTuple):
    project: str
    mode: str  # "offline" or "online"
    config: dict  # the run's configuration, shown with the run


def require_wandb() -> None:
    """output.wandb = true without the package: one clear error before any work (on every rank alike)."""
    if importlib.util.find_spec("wandb") is None:
        from ..config import ConfigError

        raise ConfigError("output.wandb = true needs the wandb package: pip install wandb, "
                          "or set output.wandb = false")


class MetricsWriter:
    """metrics.jsonl + TensorBoard events (+ Weights & Biases) in the run folder, and events.jsonl
    for what happened at a step besides its numbers (a resume, a skipped step); a no-op on every
    rank but the first."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, start_step: int = 0,
                 wandb: Optional[WandbSettings] = None) -> None:
        """start_step: the step training starts from (a resumed checkpoint's). Rows logged after it
        by an earlier attempt (one killed between that checkpoint and its end) are dropped, so
        the files hold each step once."""
        self.enabled = enabled
        self.start_step = start_step
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.events_path = self.run_dir / EVENTS
        self.tensorboard = tensorboard
        self.wandb = wandb
        self._file = None
        self._events = None
        self._tb = None
        self._wandb_run = None

    def _full_disk_said(self):
        """An ENOSPC in metrics.jsonl or TensorBoard's files (its writer thread's error surfaces at the
        next write or close): one error naming the run folder, not a traceback."""
        return full_disk_said(self.run_dir, "the run's metrics (metrics.jsonl, tensorboard/) could not be written",
                              RUN_DIR_ADVICE)

    def _open(self) -> None:
        # Opened at the first write, so a run that fails during set-up leaves no files behind.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.jsonl_path, self.events_path):
            if path.exists():
                kept = [row for row in read_metrics(path) if row.get("step", 0) <= self.start_step]
                write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in kept))
        self._file = open(self.jsonl_path, "a", buffering=1)
        self._events = open(self.events_path, "a", buffering=1)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_full_disk()

            # purge_step: TensorBoard hides the earlier attempt's events from that step on.
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=self.start_step + 1)
        if self.wandb is not None:
            self._wandb_run = self._start_wandb(self.wandb)

    def _start_wandb(self, settings: WandbSettings):
        """Imported only now (it is optional and slow to import). A resumed run continues the same
        W&B run: its id is kept in the run folder."""
        import wandb

        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        write_text_atomic(id_file, run_id + "\n")
        return wandb.init(project=settings.project, mode=settings.mode, dir=str(self.run_dir), id=run_id,
                          resume="allow", name=self.run_dir.name, config=settings.config)

    def continue_from(self, step: int) -> None:
        """Training continues from `step` after all (a replica group healed to its peers' step): an
        earlier attempt's rows up to it are kept when the files are opened, the later ones dropped."""
        if self._file is None:
            self.start_step = max(self.start_step, step)

    def event(self, step: int, event: str, **fields) -> None:
        """Something that happened at `step` (events.jsonl; the dashboard marks it)."""
        if not self.enabled:
            return
        with self._full_disk_said():
            if self._file is None:
                self._open()
            self._events.write(json.dumps({"step": step, "event": event, **fields}) + "\n")

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        try:
            with self._full_disk_said():
                if self._file is None:
                    self._open()
                self._file.write(json.dumps({"step": step, **values}) + "\n")
                numbers = board_numbers(values)
                if self._tb is not None:
                    for tag, value in numbers.items():
                        self._tb.add_scalar(tag, value, step)
                if self._wandb_run is not None and numbers:
                    self._wandb_run.log(numbers, step=step)
        except DiskFullError:
            # Dropped now: flushing a full file's buffer again at exit would add a second report.
            with contextlib.suppress(Exception):
                self.close()
            raise

    def close(self) -> None:
        file, tb, self._file, self._tb = self._file, self._tb, None, None  # closed once, even if closing fails
        run, self._wandb_run = self._wandb_run, None
        events, self._events = self._events, None
        with self._full_disk_said():
            try:
                if file is not None:
                    file.close()
                if events is not None:
                    events.close()
            finally:
                try:
                    if tb is not None:
                        tb.close()
                finally:
                    if run is not None:
                        run.finish()


def _quiet_tensorboard_full_disk() -> None:
    """TensorBoard's writer thread re-raises a failed write, which Python prints as a traceback; the
    same error reaches the main thread at its next write, which says it once (DiskFullError). So a
    full disk in that thread is not printed (any other error still is)."""
    previous = threading.excepthook
    if getattr(previous, "hybridpar_quiet_full_disk", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and out_of_space(args.exc_value) is not None:
            return
        previous(args)

    hook.hybridpar_quiet_full_disk = True
    threading.excepthook = hook


def board_numbers(values: dict) -> dict:
    """The numbers of a metrics row by TensorBoard / W&B tag (bools too: flags); a list of numbers
    (the tokens per expert) as one tag per element, "<tag>/<index>"."""
    numbers = {}
    for key, value in values.items():
        if isinstance(value, (int, float)):
            numbers[board_tag(key)] = value
        elif isinstance(value, list) and all(isinstance(x, (int, float)) for x in value):
            numbers.update({f"{board_tag(key)}/{i}": x for i, x in enumerate(value)})
    return numbers


def read_metrics(jsonl_path: Path) -> list[dict]:
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def log_row(window: list[dict]) -> dict:
    """One log row for the steps since the last: mean loss, throughput over the whole interval."""
    good = [m for m in window if not m["skipped"]] or window
    last = window[-1]
    tokens, seconds = sum(m["tokens"] for m in window), sum(m["step_time"] for m in window)
    return {
        "loss": sum(m["loss"] for m in good) / len(good), "lr": last["lr"], "grad_norm": last["grad_norm"],
        "skipped_steps": sum(m["skipped"] for m in window), "step_time": seconds / len(window),
        "tokens_per_s": tokens / seconds, "mfu": sum(m["mfu"] * m["step_time"] for m in window) / seconds,
        "memory_gb": last["memory_gb"], **{k: last[k] for k in ("memory_reserved_gb",) if k in last},
        # replica groups (fault_tolerance): the fewest that committed a step of the interval
        **({"groups": min(m["groups"] for m in window)} if "groups" in last else {}),
        # and a heal of this group from a live one in the interval (at the start of one of its steps)
        **next(({"healed_from": m["healed_from"], "heal_s": m["heal_s"]} for m in window if "healed_from" in m), {}),
    }


def progress_line(step: int, steps: int, m: dict, elapsed: float, eta: Optional[float]) -> str:
    """The step line: where training is, how long it has run and has left (h:mm:ss; "?" before
    the estimate exists: clock.StepClock), and the step's numbers."""
    line = (
        f"step {step:>5}/{steps}  elapsed {hms(elapsed)}  eta {hms(float('nan') if eta is None else eta)}  "
        f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
        f"{m['tokens_per_s']:,.0f} tok/s  mfu {100 * m['mfu']:.1f}%  mem {m['memory_gb']:.2f} GB"
    )
    if "groups" in m:
        line += f"  groups {m['groups']}"
    if "healed_from" in m:
        line += f" (healed from step {m['healed_from']} in {m['heal_s']:.1f} s)"
    if "aux_loss" in m:  # a mixture of experts' load-balancing loss (hybridpar.train.experts)
        line += f"  aux_loss {m['aux_loss']:.4f}"
    if "experts/hot" in m:
        line += f"  hot: {m['experts/hot']}"
    by_source = {k[len("tokens/"):]: v for k, v in m.items() if k.startswith("tokens/")}
    if by_source:  # a blend: each source's share of the tokens so far
        total = sum(by_source.values()) or 1
        line += "  " + " ".join(f"{name} {100 * n / total:.0f}%" for name, n in by_source.items())
    return line + validation_text(m)


def validation_text(m: dict) -> str:
    """"  val 3.2100 (ppl 24.8)" when `m` has a validation loss, and "  eval 12.3s arc_easy/acc 0.412 ..."
    when it has downstream scores (hybridpar.train.downstream; stderrs left out), else ""."""
    text = f"  val {m['val_loss']:.4f} (ppl {m['val_ppl']:.1f})" if "val_loss" in m else ""
    if "eval_s" in m:
        text += f"  eval {m['eval_s']:.1f}s " + scores_text(m, " ")
    return text


def scores_text(m: dict, sep: str) -> str:
    """The downstream scores in `m` ("eval/<task>/<metric>") as "<task>/<metric> 0.412", stderrs left out."""
    return sep.join(f"{k[len('eval/'):]} {v:.4g}" for k, v in m.items()
                    if k.startswith("eval/") and not k.endswith("_stderr"))
