"""The metrics files of a run that was killed and resumed hold every step once."""

from hybridpar.train.metrics import MetricsWriter, read_metrics


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
