"""Training metrics: throughput, MFU, memory, and where they are written (rank 0 only).

MFU counts the FLOPs of the model's math, not of the hardware's work (ModelArgs.flops_per_token).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import resource
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from models.llama import ModelArgs

from ..files import DiskFullError, full_disk_said, out_of_space, write_text_atomic

flops_per_token = ModelArgs.flops_per_token  # flops_per_token(args, seq_len), as the trainer and bench call it
# What to change when the run folder's file system is full (files.full_disk_said says the rest).
RUN_DIR_ADVICE = "free space there or point output.run_dir elsewhere"
EVENTS = "events.jsonl"  # beside metrics.jsonl: {"step", "event": "resumed" | "skipped", ...}


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
                numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}  # bools too (flags)
                if self._tb is not None:
                    for key, value in numbers.items():
                        self._tb.add_scalar(key, value, step)
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


def read_metrics(jsonl_path: Path) -> list[dict]:
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def smoothed(values: list[float], half_width: int) -> list[float]:
    """A centred moving average over 2 x half_width + 1 points (fewer at the ends): no lag, so a
    falling curve is not drawn above its own points."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half_width): i + half_width + 1]
        out.append(sum(window) / len(window))
    return out


def plot_dashboard(jsonl_path: Path, png_path: Path, title: Optional[str] = None, grad_clip: float = 0.0) -> Path:
    """The run at a glance from metrics.jsonl, as a PNG (written atomically): training loss raw and
    smoothed with the validation loss, the learning rate, tokens/s and MFU, the gradient norm with
    skipped steps; resumes as dashed lines on every panel."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    events_path = Path(jsonl_path).with_name(EVENTS)
    events = read_metrics(events_path) if events_path.exists() else []
    skipped = sorted({e["step"] for e in events if e.get("event") == "skipped"})
    resumes = [e["step"] for e in events if e.get("event") == "resumed"]

    plt.rcParams.update({"font.size": 10})
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (loss_ax, lr_ax), (speed_ax, norm_ax) = axes

    def series(key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that have a finite `key`: a skipped step's NaN breaks no line."""
        points = [(r["step"], scale * r[key]) for r in train if isinstance(r.get(key), (int, float))
                  and math.isfinite(r[key])]
        return [p[0] for p in points], [p[1] for p in points]

    loss_steps, losses = series("loss")
    if losses:
        loss_ax.plot(loss_steps, losses, color="tab:blue", alpha=0.35, lw=1, label="training (raw)")
        loss_ax.plot(loss_steps, smoothed(losses, max(1, len(losses) // 20)), color="tab:blue", lw=2,
                     label="training (smoothed)")
    if val:
        loss_ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], color="tab:orange", marker="o", lw=2,
                     label="validation")
    for name in sorted({k.split("/", 1)[1] for r in val for k in r if k.startswith("val_loss/")}):
        points = [(r["step"], r[f"val_loss/{name}"]) for r in val if f"val_loss/{name}" in r]
        loss_ax.plot(*zip(*points), marker=".", lw=1, ls="--", label=f"validation: {name}")
    loss_ax.set_title("loss")
    loss_ax.legend(loc="upper right", fontsize=9)

    lr_ax.plot(*series("lr"), color="tab:green", lw=2)
    lr_ax.set_title("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    sources = sorted({k.split("/", 1)[1] for r in train for k in r if k.startswith("tokens/")})
    if sources:  # a blend: the tokens trained on from each source, on the right
        share_ax = lr_ax.twinx()
        for name in sources:
            share_ax.plot(*series(f"tokens/{name}", 1e-6), lw=1.5, ls="--", label=name)
        share_ax.set_ylabel("tokens per source (M)")
        share_ax.legend(loc="lower right", fontsize=9)
        lr_ax.set_title("learning rate; tokens per source (right)")

    speed_steps, speed = series("tokens_per_s")
    speed_ax.plot(speed_steps, speed, color="tab:purple", lw=2)
    speed_ax.set_title("throughput: tokens/s (left), MFU (right)")
    speed_ax.set_ylabel("tokens/s")
    # MFU is tokens/s times a constant (the model's FLOPs per token over the peak): one line, two scales.
    ratios = sorted(100 * r["mfu"] / r["tokens_per_s"] for r in train if r.get("tokens_per_s") and "mfu" in r)
    if ratios:
        mfu_ax = speed_ax.twinx()
        low, high = speed_ax.get_ylim()
        ratio = ratios[len(ratios) // 2]
        mfu_ax.set_ylim(low * ratio, high * ratio)
        mfu_ax.set_ylabel("MFU %")

    norm_ax.plot(*series("grad_norm"), color="tab:brown", lw=2, label="gradient norm")
    if grad_clip > 0:
        norm_ax.axhline(grad_clip, color="gray", lw=1, ls=":", label=f"clipped above {grad_clip:g}")
    if skipped:
        norm_ax.plot(skipped, [0] * len(skipped), "x", color="red", ms=10, mew=2,
                     label=f"skipped steps ({len(skipped)})")
    norm_ax.set_title("gradient norm")
    norm_ax.legend(loc="upper right", fontsize=9)

    for ax in axes.flat:
        ax.grid(alpha=0.3)
        for i, step in enumerate(resumes):
            ax.axvline(step, color="black", lw=1, ls="--", alpha=0.6, label="resumed" if i == 0 else None)
    if resumes:
        loss_ax.legend(loc="upper right", fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("step")
    last = train[-1] if train else {}
    headline = [title or Path(jsonl_path).parent.name]
    if last:
        headline.append(f"step {last['step']}: loss {last['loss']:.3f}")
    if val:
        headline.append(f"validation {val[-1]['val_loss']:.3f}")
    fig.suptitle("  |  ".join(headline), fontsize=12)
    fig.tight_layout()
    tmp = Path(png_path).with_suffix(".tmp.png")
    try:
        with full_disk_said(tmp.parent, f"the dashboard ({Path(png_path).name}) could not be written", RUN_DIR_ADVICE):
            fig.savefig(tmp, dpi=100)
        os.replace(tmp, png_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return Path(png_path)


def progress_line(step: int, steps: int, m: dict) -> str:
    line = (
        f"step {step:>5}/{steps}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
        f"{m['tokens_per_s']:,.0f} tok/s  mfu {100 * m['mfu']:.1f}%  mem {m['memory_gb']:.2f} GB"
    )
    by_source = {k[len("tokens/"):]: v for k, v in m.items() if k.startswith("tokens/")}
    if by_source:  # a blend: each source's share of the tokens so far
        total = sum(by_source.values()) or 1
        line += "  " + " ".join(f"{name} {100 * n / total:.0f}%" for name, n in by_source.items())
    return line + validation_text(m)


def validation_text(m: dict) -> str:
    """"  val 3.2100 (ppl 24.8)" when `m` has a validation loss, else ""."""
    return f"  val {m['val_loss']:.4f} (ppl {m['val_ppl']:.1f})" if "val_loss" in m else ""
