"""What the planner takes from a card beyond its kernels' rates: the clock of a power-capped H100."""

from __future__ import annotations

import pytest

from hybridpar.plan.hardware import spec


def test_the_500w_card_runs_at_the_clock_of_its_cap_on_the_datasheets_line():
    """NVL 835 TFLOP/s at 400 W, SXM 989 at 700 W: at 500 W a third of the way, 886/989 of the SXM's
    clock (not the 912 of their midpoint), every kernel fraction of the 700 W card scaled by it."""
    clock = (835 + (989 - 835) * (500 - 400) / (700 - 400)) / 989
    capped, full = spec("h100-500w", 8), spec("h100", 8)
    assert capped.gemm_efficiency == pytest.approx(full.gemm_efficiency * clock, rel=1e-12)
    assert capped.attention_efficiency == pytest.approx(full.attention_efficiency * clock, rel=1e-12)
    assert capped.peak_flops == full.peak_flops == 989e12  # MFU stays against the datasheet's peak
    assert "886/989" in capped.name
