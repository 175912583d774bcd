"""loss.png reads well at 3 logged steps and at 100,000: whole-step ticks, raw points below the
smoothing threshold, legends over no data, the step-time and memory panels (synthetic rows: no
training). The PNGs are kept in the test's folder to look at."""

import json
import math
import random

import numpy as np
import pytest

from hybridpar.train.dashboard import SMOOTH_MIN_POINTS, draw_dashboard, plot_dashboard, smoothed


def _rows(n, val_every=0, sources=()):
    rng = random.Random(n)
    rows = []
    for step in range(1, n + 1):
        row = {"step": step, "loss": 8 * math.exp(-5 * step / n) + 2 + rng.gauss(0, 0.1), "lr": 3e-4,
               "grad_norm": 1 + rng.random(), "skipped_steps": 0, "step_time": 0.5 + (5 if step == 1 else 0),
               "tokens_per_s": 8000 + 300 * rng.random(), "mfu": 0.3, "memory_gb": 12 - 2 * math.exp(-step)}
        row.update({f"tokens/{name}": step * 1000 * (i + 1) for i, name in enumerate(sources)})
        if val_every and step % val_every == 0:
            row.update(val_loss=row["loss"] + 0.1, val_ppl=math.exp(row["loss"] + 0.1))
        rows.append(row)
    return rows


def _titles(fig):
    return [ax.get_title() for ax in fig.axes if ax.get_visible()]


def _check_readable(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        low, high = sorted(ax.get_xlim())
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
        assert all("." not in ax.xaxis.get_major_formatter()(t) for t in ticks)
        legend = ax.get_legend()
        if legend is not None:  # it covers none of the points of the panel's lines
            box = legend.get_window_extent(renderer)
            for line in ax.get_lines():
                xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
                inside = (xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)
                assert not inside.any(), (ax.get_title(), line.get_label())


def _loss_labels(fig):
    return [line.get_label() for line in fig.axes[0].get_lines()]


def test_three_steps(tmp_path):
    rows = _rows(3, val_every=3)
    fig = draw_dashboard(rows, [], "three steps", grad_clip=0.5)
    _check_readable(fig)
    assert [t for t in fig.axes[0].get_xticks() if 0.5 <= t <= 3.5] == [1, 2, 3]
    assert _loss_labels(fig) == ["training", "validation"]  # raw points, no smoothed line
    assert fig.axes[0].get_lines()[0].get_marker() == "o"
    titles = _titles(fig)
    assert {"loss", "learning rate", "gradient norm", "step time (s)", "peak memory so far (GB, rank 0)"} <= set(titles)
    fig.savefig(tmp_path / "three.png")
    metrics = tmp_path / "metrics.jsonl"  # and the same through the file the trainer writes
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_dashboard(metrics, tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_smoothing_starts_at_the_threshold():
    few = draw_dashboard(_rows(SMOOTH_MIN_POINTS - 1), [], "few")
    enough = draw_dashboard(_rows(SMOOTH_MIN_POINTS), [], "enough")
    assert _loss_labels(few) == ["training"]
    assert _loss_labels(enough) == ["training (raw)", "training (smoothed)"]


def test_a_hundred_thousand_steps(tmp_path):
    events = [{"step": 40_000, "event": "resumed"}, {"step": 70_001, "event": "skipped"}]
    fig = draw_dashboard(_rows(100_000, val_every=5000), events, "long", grad_clip=1.0)
    _check_readable(fig)
    assert _loss_labels(fig)[:3] == ["training (raw)", "training (smoothed)", "validation"]
    # The first step's compile time stays off the step-time scale (it would flatten the rest).
    step_time = next(ax for ax in fig.axes if ax.get_title().startswith("step time"))
    assert step_time.get_ylim()[1] < 1 and "above the scale" in step_time.get_title()
    fig.savefig(tmp_path / "long.png")


def test_a_blend_has_its_tokens_per_source_panel():
    fig = draw_dashboard(_rows(30, sources=("code", "web")), [], "blend")
    _check_readable(fig)
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("tokens per source"))
    assert [line.get_label() for line in panel.get_lines()] == ["code", "web"]


def test_smoothed_is_the_centred_mean():
    values = [float(v) for v in (3, 1, 4, 1, 5, 9, 2)]
    naive = [sum(values[max(0, i - 2): i + 3]) / len(values[max(0, i - 2): i + 3]) for i in range(len(values))]
    assert smoothed(values, 2) == pytest.approx(naive)


def test_a_mixture_of_experts_has_its_load_panel(tmp_path):
    """Each ep rank's share of the routed tokens (at ep 1 each expert's, its layers summed), and the even share."""
    rows = _rows(30, sources=("code", "web"))
    for r in rows:
        r.update({"experts/tokens/layer1": [10, 30, 50, 10], "experts/tokens/layer3": [30, 10, 10, 50],
                  "experts/ep_tokens": [80, 120]})
    fig = draw_dashboard(rows, [], "moe")
    _check_readable(fig)
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("routed tokens per ep rank"))
    lines = {line.get_label(): list(line.get_ydata()) for line in panel.get_lines()}
    assert lines["ep rank 0"] == [40.0] * 30 and lines["ep rank 1"] == [60.0] * 30 and lines["even share"] == [50, 50]
    fig.savefig(tmp_path / "moe.png")
    for r in rows:
        r["experts/ep_tokens"] = [200]
    panel = next(ax for ax in draw_dashboard(rows, [], "ep 1").axes if ax.get_title().startswith("routed tokens per"))
    assert panel.get_title() == "routed tokens per expert (%, all MoE layers)"
    assert [line.get_ydata()[0] for line in panel.get_lines()] == [20.0, 20.0, 30.0, 30.0, 25]
