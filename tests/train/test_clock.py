"""The step line's elapsed time and ETA: h:mm:ss, warm-up steps and pauses left out of the mean
step time, pauses counted back per step, a resumed run counting only the steps left."""

import pytest

from hybridpar.progress import hms
from hybridpar.train.clock import RECENT_STEPS, WARMUP_STEPS, StepClock
from hybridpar.train.metrics import progress_line


class FakeTime:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _train(clock, time, first, last, seconds):
    for step in range(first, last + 1):
        time.t += seconds(step)
        clock.step_done(step)


def test_hms():
    assert [hms(s) for s in (0, 4.4, 59.6, 61, 3599.5, 3600, 36_000 + 62, 100 * 3600)] == \
        ["0:00:00", "0:00:04", "0:01:00", "0:01:01", "1:00:00", "1:00:00", "10:01:02", "100:00:00"]
    assert [hms(s) for s in (float("nan"), float("inf"), -1)] == ["?"] * 3


def test_warmup_steps_are_left_out_and_the_estimate_is_the_recent_mean():
    time = FakeTime()
    clock = StepClock(started=time.t - 30, first_step=0, now=time)  # 30 s of set-up before the loop
    _train(clock, time, 1, WARMUP_STEPS, lambda step: 60.0)  # compiling
    assert clock.eta(WARMUP_STEPS, 100) is None  # nothing but warm-up timed yet
    _train(clock, time, WARMUP_STEPS + 1, 10, lambda step: 2.0)
    assert clock.eta(10, 100) == pytest.approx(90 * 2.0)
    assert clock.elapsed() == pytest.approx(30 + WARMUP_STEPS * 60 + (10 - WARMUP_STEPS) * 2)
    # The mean follows the recent steps: after RECENT_STEPS steps at 1 s, the 2 s steps are gone.
    _train(clock, time, 11, 10 + RECENT_STEPS, lambda step: 1.0)
    assert clock.eta(10 + RECENT_STEPS, 100) == pytest.approx(100 - 10 - RECENT_STEPS)
    assert clock.eta(100, 100) == 0.0


def test_pauses_are_not_step_time_but_their_share_per_step_is_counted():
    time = FakeTime()
    clock = StepClock(started=time.t, first_step=0, now=time)
    _train(clock, time, 1, 5, lambda step: 1.0)
    with clock.pause():  # an evaluation after step 5
        time.t += 50.0
    _train(clock, time, 6, 10, lambda step: 1.0)
    assert list(clock.recent) == [1.0] * (10 - WARMUP_STEPS)  # step 6 did not absorb the 50 s
    assert clock.eta(10, 20) == pytest.approx(10 * (1.0 + 50.0 / 10))


def test_a_resumed_run_counts_the_steps_left_and_warms_up_again():
    time = FakeTime()
    clock = StepClock(started=time.t, first_step=40, now=time)
    _train(clock, time, 41, 40 + WARMUP_STEPS, lambda step: 30.0)
    assert clock.eta(40 + WARMUP_STEPS, 100) is None
    _train(clock, time, 43, 50, lambda step: 3.0)
    assert clock.eta(50, 100) == pytest.approx(50 * 3.0)


def test_the_step_line_shows_elapsed_and_eta():
    m = {"loss": 3.25, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 12345.6, "mfu": 0.123, "memory_gb": 1.5}
    line = progress_line(40, 100, m, elapsed=65.2, eta=3600.0)
    assert line.startswith("step    40/100  elapsed 0:01:05  eta 1:00:00  loss 3.2500  lr 3.00e-04"), line
    assert "eta ?  loss" in progress_line(1, 100, m, elapsed=3.0, eta=None)
