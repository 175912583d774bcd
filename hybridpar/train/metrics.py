"""Training metrics: throughput, MFU, memory, and where they are written (rank 0 only).

MFU counts the FLOPs of the model's math, not of the hardware's work (ModelArgs.flops_per_token).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from models.llama import ModelArgs

from ..files import DiskFullError, full_disk_said, out_of_space, write_text_atomic

flops_per_token = ModelArgs.flops_per_token  # flops_per_token(args, seq_len), as the trainer and bench call it
# What to change when the run folder's file system is full (files.full_disk_said says the rest).
RUN_DIR_ADVICE = "free space there or point output.run_dir elsewhere"


def measure_matmul_peak(seconds: float = 1.0, size: int = 1024, dtype: torch.dtype = torch.float32,
                        start_together: Callable[[], None] = lambda: None) -> float:
    """FLOP/s this process reaches on a square matmul with its current thread count: the CPU 'peak'.
    `start_together` runs after the warm-up, just before the clock starts (a barrier, so that ranks
    sharing cores measure the same window)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up: first call pays allocation and dispatch set-up
    start_together()
    runs, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return runs * 2.0 * size**3 / elapsed


def memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated, or the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsWriter:
    """metrics.jsonl + TensorBoard events in the run folder; a no-op on every rank but the first."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, start_step: int = 0) -> None:
        """start_step: the step training starts from (a resumed checkpoint's). Rows logged after it
        by an earlier attempt (one killed between that checkpoint and its end) are dropped, so
        the files hold each step once."""
        self.enabled = enabled
        self.start_step = start_step
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.tensorboard = tensorboard
        self._file = None
        self._tb = None

    def _full_disk_said(self):
        """An ENOSPC in metrics.jsonl or TensorBoard's files (its writer thread's error surfaces at the
        next write or close): one error naming the run folder, not a traceback."""
        return full_disk_said(self.run_dir, "the run's metrics (metrics.jsonl, tensorboard/) could not be written",
                              RUN_DIR_ADVICE)

    def _open(self) -> None:
        # Opened at the first write, so a run that fails during set-up leaves no files behind.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.jsonl_path.exists():
            kept = [row for row in read_metrics(self.jsonl_path) if row.get("step", 0) <= self.start_step]
            write_text_atomic(self.jsonl_path, "".join(json.dumps(row) + "\n" for row in kept))
        self._file = open(self.jsonl_path, "a", buffering=1)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_full_disk()

            # purge_step: TensorBoard hides the earlier attempt's events from that step on.
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=self.start_step + 1)

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        try:
            with self._full_disk_said():
                if self._file is None:
                    self._open()
                self._file.write(json.dumps({"step": step, **values}) + "\n")
                if self._tb is not None:
                    for key, value in values.items():
                        if isinstance(value, (int, float)):
                            self._tb.add_scalar(key, value, step)
        except DiskFullError:
            # Dropped now: flushing a full file's buffer again at exit would add a second report.
            with contextlib.suppress(Exception):
                self.close()
            raise

    def close(self) -> None:
        file, tb, self._file, self._tb = self._file, self._tb, None, None  # closed once, even if closing fails
        with self._full_disk_said():
            try:
                if file is not None:
                    file.close()
            finally:
                if tb is not None:
                    tb.close()


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


def read_metrics(jsonl_path: Path) -> list[dict]:
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(jsonl_path: Path, png_path: Path, title: Optional[str] = None) -> Path:
    """Loss against step from metrics.jsonl, saved as a PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(jsonl_path) if "loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    tmp = Path(png_path).with_suffix(".tmp.png")
    try:
        with full_disk_said(tmp.parent, f"the loss plot ({Path(png_path).name}) could not be written", RUN_DIR_ADVICE):
            fig.savefig(tmp, dpi=100, bbox_inches="tight")
        os.replace(tmp, png_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return Path(png_path)


def progress_line(step: int, steps: int, m: dict) -> str:
    return (
        f"step {step:>5}/{steps}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
        f"{m['tokens_per_s']:,.0f} tok/s  mfu {100 * m['mfu']:.1f}%  mem {m['memory_gb']:.2f} GB"
    )
