"""The metrics files of a run that was killed and resumed hold every step once; the CPU matmul peak
behind MFU is timed only once every rank is ready."""

import time

from hybridpar.train.metrics import MetricsWriter, measure_matmul_peak, read_metrics


def _log(run_dir, steps, start_step=0, loss=1.0):
    writer = MetricsWriter(run_dir, enabled=True, tensorboard=False, start_step=start_step)
    for step in steps:
        writer.write(step, {"loss": loss})
    writer.close()


def test_a_resumed_run_replaces_the_rows_logged_after_its_checkpoint(tmp_path):
    _log(tmp_path, range(1, 7), loss=1.0)  # killed after step 6; the newest checkpoint was step 4
    _log(tmp_path, range(5, 9), start_step=4, loss=2.0)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == [1.0] * 4 + [2.0] * 4


def test_a_fresh_run_in_an_old_folder_starts_a_fresh_file(tmp_path):
    _log(tmp_path, range(1, 4))
    _log(tmp_path, range(1, 3), start_step=0, loss=3.0)
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 3.0), (2, 3.0)]


def test_the_matmul_peak_is_timed_from_start_together_on():
    # A barrier that takes long must not count as matmul time: a clock started before it would
    # report at most one 64 x 64 matmul per half second.
    waited = []
    peak = measure_matmul_peak(seconds=0.05, size=64, start_together=lambda: (time.sleep(0.5), waited.append(1)))
    one_matmul_per_wait = 2 * 64**3 / 0.5
    print(f"peak {peak / 1e9:.2f} GFLOP/s, a clock started before the wait would give <= {one_matmul_per_wait / 1e9:.5f}")
    assert waited == [1]
    assert peak > 100 * one_matmul_per_wait
