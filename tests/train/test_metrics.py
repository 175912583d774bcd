"""The metrics files of a run that was killed and resumed hold every step once; the CPU matmul peak
behind MFU is timed only once every rank is ready; TensorBoard's and W&B's tags are grouped."""

import time
import types

import pytest
import torch

from hybridpar.train.metrics import MetricsWriter, board_tag, log_row, measure_matmul_peak, read_metrics


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


def _every_key_the_trainer_logs():
    """A log row as the trainer writes it on a GPU (log_row's keys), with a blend's tokens, a
    validation and a straggler report."""
    step = {"loss": 3.0, "lr": 1e-3, "grad_norm": 0.5, "skipped": False, "tokens": 256, "step_time": 0.5,
            "tokens_per_s": 512.0, "mfu": 0.1, "memory_gb": 1.5, "memory_reserved_gb": 1.9}
    return {**log_row([step]), "tokens/code": 100, "tokens/web": 156, "val_loss": 3.1, "val_ppl": 22.2,
            "val_tokens": 64, "val_loss/code": 3.0, "val_loss/web": 3.2, "straggler/ratio": 1.1,
            "straggler/flagged": False, "straggler/host": "node1"}


def _written(tmp_path, step: int, row: dict):
    """`row` through a MetricsWriter with TensorBoard: metrics.jsonl's rows, TensorBoard's events read back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    writer.write(step, row)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    return read_metrics(tmp_path / "metrics.jsonl"), events


def test_tensorboard_tags_are_grouped_and_metrics_jsonl_keeps_its_keys(tmp_path):
    row = _every_key_the_trainer_logs()
    rows, events = _written(tmp_path, 7, row)
    assert rows == [{"step": 7, **row}]
    assert set(events.Tags()["scalars"]) == {
        "train/loss", "train/lr", "train/grad_norm", "train/skipped_steps", "train/tokens/code", "train/tokens/web",
        "perf/step_time_s", "perf/tokens_per_s", "perf/mfu", "memory/peak_gb", "memory/reserved_gb",
        "val/loss", "val/ppl", "val/tokens", "val/loss/code", "val/loss/web",
        "straggler/ratio", "straggler/flagged"}  # text (the host) is not a scalar
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(7, 3.0)]
    assert [(e.step, e.value) for e in events.Scalars("val/loss/web")] == [(7, pytest.approx(3.2))]


def test_wandb_gets_the_same_tags(tmp_path):
    logged = []
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    writer.write(1, {"loss": 1.0})  # opens the files
    writer._wandb_run = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)),
                                              finish=lambda: None)
    writer.write(2, {"loss": 2.0, "memory_gb": 1.0, "tokens/code": 5, "note": "text"})
    writer.close()
    assert logged == [(2, {"train/loss": 2.0, "memory/peak_gb": 1.0, "train/tokens/code": 5})]


def test_a_gpu_step_records_the_memory_the_allocator_reserved_beside_the_allocated(monkeypatch):
    from hybridpar.train.metrics import memory_figures

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 90e9 if device == gpu else 0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 114e9 if device == gpu else 0)
    assert memory_figures(gpu) == {"memory_gb": 90.0, "memory_reserved_gb": 114.0}
    # The log row over several steps keeps the last step's, as it keeps the allocated peak.
    step = {"loss": 3.0, "lr": 1e-3, "grad_norm": 0.5, "skipped": False, "tokens": 256, "step_time": 0.5,
            "tokens_per_s": 512.0, "mfu": 0.1}
    row = log_row([{**step, "memory_gb": 80.0, "memory_reserved_gb": 100.0}, {**step, **memory_figures(gpu)}])
    assert (row["memory_gb"], row["memory_reserved_gb"]) == (90.0, 114.0)
    # A CPU has no caching allocator: its figure is the process's peak resident set, and no other.
    assert set(memory_figures(torch.device("cpu"))) == {"memory_gb"}


def test_a_key_of_no_group_is_still_grouped():
    assert board_tag("data_guard_s") == "other/data_guard_s"


def test_a_mixture_of_experts_row_gives_a_scalar_per_expert_and_its_step_line_says_what_is_hot(tmp_path):
    from hybridpar.train.metrics import progress_line

    hot = "ep rank 1 (experts 2-3) got 80% of layer 1's routed tokens"
    row = {"aux_loss": 0.21, "experts/tokens/layer1": [10, 10, 40, 40], "experts/ep_tokens": [20, 80],
           "experts/imbalance": 1.6, "experts/hot": hot, "experts/hot_rank": 1}
    rows, events = _written(tmp_path, 3, row)
    assert rows == [{"step": 3, **row}]
    assert set(events.Tags()["scalars"]) == {
        "train/aux_loss", *(f"experts/tokens/layer1/{e}" for e in range(4)), "experts/ep_tokens/0",
        "experts/ep_tokens/1", "experts/imbalance", "experts/hot_rank"}
    assert [(e.step, e.value) for e in events.Scalars("experts/tokens/layer1/2")] == [(3, 40.0)]
    step = {"loss": 3.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 512.0, "mfu": 0.1, "memory_gb": 1.0}
    assert progress_line(3, 10, {**step, **row}, 1.0, None).endswith(f"  aux_loss 0.2100  hot: {hot}")
