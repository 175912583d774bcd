"""The run at a glance: loss.png, drawn from metrics.jsonl and events.jsonl (rank 0, at the end of
a run). It has to read well for 3 logged steps and for 100,000: whole-step ticks, raw points
(not a smoothed line) when there are few, legends in the corner the lines leave free.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import numpy as np

from ..files import full_disk_said
from .metrics import EVENTS, RUN_DIR_ADVICE, read_metrics

SMOOTH_MIN_POINTS = 20  # fewer training points are shown as they are: smoothing a few points draws a flat bar
MARKERS_BELOW = 50  # a line of fewer points marks each one (3 steps are three dots, not a short stroke)
LEGEND_CORNERS = ("upper right", "upper left", "lower left", "lower right")  # preferred first on a tie


def smoothed(values: list[float], half_width: int) -> list[float]:
    """A centred moving average over 2 x half_width + 1 points (fewer at the ends): no lag, so a
    falling curve is not drawn above its own points. Linear in the number of points."""
    n = len(values)
    sums = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
    low = np.maximum(0, np.arange(n) - half_width)
    high = np.minimum(n, np.arange(n) + half_width + 1)
    return list((sums[high] - sums[low]) / (high - low))


def plot_dashboard(jsonl_path: Path, png_path: Path, title: Optional[str] = None, grad_clip: float = 0.0) -> Path:
    """loss.png (written atomically) from the run's metrics.jsonl and events.jsonl beside it."""
    import matplotlib.pyplot as plt

    events_path = Path(jsonl_path).with_name(EVENTS)
    fig = draw_dashboard(read_metrics(jsonl_path), read_metrics(events_path) if events_path.exists() else [],
                         title or Path(jsonl_path).parent.name, grad_clip)
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


def draw_dashboard(rows: list[dict], events: list[dict], title: str, grad_clip: float = 0.0):
    """The figure: loss (training, validation, each source's validation), learning rate,
    throughput with MFU, gradient norm with skipped steps, step time, peak memory, a blend's
    tokens per source, the downstream scores and a mixture of experts' load (each ep rank's share
    of the routed tokens, at ep 1 each expert's); resumes as dashed lines on every panel."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    skipped = sorted({e["step"] for e in events if e.get("event") == "skipped"})
    resumes = [e["step"] for e in events if e.get("event") == "resumed"]
    sources = sorted({k.split("/", 1)[1] for r in train for k in r if k.startswith("tokens/")})
    # Downstream scores (train/downstream.py): "eval/<task>/<metric>", their stderrs left out.
    scores = sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith("_stderr")})
    loads = expert_loads(rows)

    def series(key: str, scale: float = 1.0, of: list = train) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that have a finite `key`: a skipped step's NaN breaks no line."""
        points = [(r["step"], scale * r[key]) for r in of if isinstance(r.get(key), (int, float))
                  and math.isfinite(r[key])]
        return [p[0] for p in points], [p[1] for p in points]

    def draw(ax, steps, values, **style):
        if len(steps) < MARKERS_BELOW:
            style.setdefault("marker", "o")
            style.setdefault("ms", 4)
        return ax.plot(steps, values, **style)

    def trend(ax, steps, values, color, label=None):
        """A noisy series: its points as they are when few, else faint under a smoothed line."""
        if len(values) < SMOOTH_MIN_POINTS:
            return draw(ax, steps, values, color=color, lw=1.5, label=label)
        ax.plot(steps, values, color=color, alpha=0.3, lw=0.8, label=label and f"{label} (raw)")
        ax.plot(steps, smoothed(values, max(1, len(values) // 40)), color=color, lw=2,
                label=label and f"{label} (smoothed)")

    def from_zero(ax, values, unit: str) -> str:
        """y from 0 with room above the line; with many points, a few far above the rest (the
        first, compiling steps) are left above the scale rather than flatten it. What the title adds."""
        if not values:
            return ""
        top = max(values)
        if len(values) >= SMOOTH_MIN_POINTS:
            typical = float(np.percentile(values, 99))
            top = min(top, 1.5 * typical)
        ax.set_ylim(0, 1.15 * top or 1)
        return f": up to {max(values):.3g} {unit} above the scale" if max(values) > 1.15 * top else ""

    plt.rcParams.update({"font.size": 10})
    n_rows = 3 + math.ceil(sum(map(bool, (sources, scores, loads))) / 2)
    fig, axes = plt.subplots(n_rows, 2, figsize=(12, 3.2 * n_rows), sharex=True)
    flat = list(axes.flat)
    loss_ax, lr_ax, speed_ax, norm_ax, time_ax, memory_ax = flat[:6]

    trend(loss_ax, *series("loss"), color="tab:blue", label="training")
    if val:
        draw(loss_ax, *series("val_loss", of=val), color="tab:orange", lw=2, label="validation")
    for name in sorted({k.split("/", 1)[1] for r in val for k in r if k.startswith("val_loss/")}):
        draw(loss_ax, *series(f"val_loss/{name}", of=val), lw=1, ls="--", ms=3, label=f"validation: {name}")
    loss_ax.set_title("loss")

    draw(lr_ax, *series("lr"), color="tab:green", lw=2)
    lr_ax.set_title("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    trend(speed_ax, *series("tokens_per_s"), color="tab:purple")
    speed_ax.set_title("throughput: tokens/s (left), MFU % (right)")
    # MFU is tokens/s times a constant (the model's FLOPs per token over the peak): one line, two scales.
    ratios = sorted(100 * r["mfu"] / r["tokens_per_s"] for r in train if r.get("tokens_per_s") and "mfu" in r)
    if ratios:
        mfu_ax = speed_ax.twinx()
        low, high = speed_ax.get_ylim()
        ratio = ratios[len(ratios) // 2]
        mfu_ax.set_ylim(low * ratio, high * ratio)

    trend(norm_ax, *series("grad_norm"), color="tab:brown", label="gradient norm")
    if grad_clip > 0:
        norm_ax.axhline(grad_clip, color="gray", lw=1, ls=":", label=f"clipped above {grad_clip:g}")
    if skipped:
        norm_ax.plot(skipped, [0] * len(skipped), "x", color="red", ms=10, mew=2,
                     label=f"skipped steps ({len(skipped)})")
    norm_ax.set_title("gradient norm")

    step_times = series("step_time")
    trend(time_ax, *step_times, color="tab:red")
    time_ax.set_title("step time (s)" + from_zero(time_ax, step_times[1], "s"))
    memory = series("memory_gb")
    draw(memory_ax, *memory, color="tab:gray", lw=1.5)
    memory_ax.set_title("peak memory so far (GB, rank 0)")
    from_zero(memory_ax, memory[1], "GB")

    extra = flat[6:]
    if sources:  # a blend: the tokens trained on from each source
        share_ax = extra.pop(0)
        for name in sources:
            draw(share_ax, *series(f"tokens/{name}", 1e-6), lw=1.5, label=name)
        share_ax.set_title("tokens per source (M, all runs)")
    if scores:  # downstream tasks: each score against the step
        score_ax = extra.pop(0)
        for key in scores:
            draw(score_ax, *series(key, of=rows), lw=1.5, label=key[len("eval/"):])
        score_ax.set_title("downstream scores ([eval])")
    if loads:  # a mixture of experts: who got how much of the routed tokens
        load_ax = extra.pop(0)
        name, steps, shares = loads
        for i, column in enumerate(zip(*shares)):
            draw(load_ax, steps, [100 * x for x in column], lw=1.5, label=f"{name} {i}")
        load_ax.axhline(100 / len(shares[0]), color="gray", lw=1, ls=":", label="even share")
        load_ax.set_title(f"routed tokens per {name} (%, all MoE layers)")
        load_ax.set_ylim(0, 100)
    if len(extra) == 1:
        extra[0].set_visible(False)
        flat[5].xaxis.set_tick_params(labelbottom=True)  # the hidden panel's column still needs its steps
        flat[5].set_xlabel("step")

    steps = [r["step"] for r in rows] + resumes + skipped
    for ax in flat:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))  # no step 1.25
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        for i, step in enumerate(resumes):
            ax.axvline(step, color="black", lw=1, ls="--", alpha=0.6,
                       label="resumed" if i == 0 and ax is loss_ax else None)
    if steps:  # a few steps keep a half step of room on each side, many 2%
        first, last = min(steps), max(steps)
        pad = max(0.5, 0.02 * (last - first))
        loss_ax.set_xlim(first - pad, last + pad)
    for ax in axes[-1]:
        ax.set_xlabel("step")

    headline = [title]
    if train:
        headline.append(f"step {train[-1]['step']:,}: loss {train[-1]['loss']:.3f}")
    if val:
        headline.append(f"validation {val[-1]['val_loss']:.3f}")
    fig.suptitle("  |  ".join(headline), fontsize=12)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for ax in flat:
        if ax.get_visible() and ax.get_legend_handles_labels()[1]:
            place_legend(ax, renderer)
    return fig


def expert_loads(rows: list[dict]) -> Optional[tuple[str, list[int], list[list[float]]]]:
    """A mixture of experts' rows (hybridpar.train.experts): ("ep rank", steps, each step's share of the
    routed tokens per ep rank), or per "expert" (its MoE layers summed) at ep 1; None without them."""
    found = [r for r in rows if "experts/ep_tokens" in r]
    if not found:
        return None
    if len(found[0]["experts/ep_tokens"]) > 1:
        name, counts = "ep rank", [r["experts/ep_tokens"] for r in found]
    else:
        name = "expert"
        counts = [[sum(c) for c in zip(*(v for k, v in r.items() if k.startswith("experts/tokens/")))] for r in found]
    return name, [r["step"] for r in found], [[x / (sum(c) or 1) for x in c] for c in counts]


def _line_points(line, dense: int = 20, most: int = 4000) -> np.ndarray:
    """A line's points in display coordinates, with points along its segments when it has few
    (a segment crossing a legend counts) and a subsample when it has many."""
    xy = np.asarray(line.get_xydata(), dtype=np.float64)
    xy = xy[np.isfinite(xy).all(axis=1)]
    if len(xy) > most:
        xy = xy[:: len(xy) // most]
    if 1 < len(xy) < most // dense and line.get_linestyle() not in ("None", "", " "):
        t = np.linspace(0.0, 1.0, dense, endpoint=False)
        xy = np.concatenate([a + t[:, None] * (b - a) for a, b in zip(xy[:-1], xy[1:])] + [xy[-1:]])
    return line.get_transform().transform(xy) if len(xy) else xy.reshape(0, 2)


def place_legend(ax, renderer) -> str:
    """The legend in the corner of `ax` that covers the fewest points of its lines (and of its twin
    axes'); when every corner covers some, the y range grows to leave room above the data. The
    corner's name."""
    def covered(corner: str) -> int:
        points = np.concatenate([_line_points(line) for other in [ax, *_twins(ax)] for line in other.get_lines()]
                                or [np.zeros((0, 2))])
        box = ax.legend(loc=corner, fontsize=8, framealpha=0.85).get_window_extent(renderer)
        return int(((points[:, 0] >= box.x0) & (points[:, 0] <= box.x1) &
                    (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1)).sum())

    counts = {corner: covered(corner) for corner in LEGEND_CORNERS}
    best = min(LEGEND_CORNERS, key=counts.get)  # min keeps the first of equals
    if counts[best]:
        legend_share = ax.legend(loc="upper right", fontsize=8).get_window_extent(renderer).height / ax.bbox.height
        low, high = ax.get_ylim()
        ax.set_ylim(low, low + (high - low) / max(0.3, 1 - legend_share - 0.05))
        counts = {corner: covered(corner) for corner in LEGEND_CORNERS}
        best = min(LEGEND_CORNERS, key=counts.get)
    ax.legend(loc=best, fontsize=8, framealpha=0.85)
    return best


def _twins(ax) -> list:
    """The axes drawn over `ax` (twinx): their lines lie under its legend too."""
    return [other for other in ax.figure.axes if other is not ax and other.bbox.bounds == ax.bbox.bounds]
