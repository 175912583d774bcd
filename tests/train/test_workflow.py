"""The everyday workflow of a run: validation loss, profiler traces, the dashboard, the end-of-run
summary and Weights & Biases, each checked on real runs."""

import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import torch

from hybridpar.train.metrics import board_tag
from tests.distributed import rel_err
from tests.runs import make_config

def _t(x):
    return torch.tensor(x, dtype=torch.float64)


VAL = {"data.val_fraction": 0.1, "train.eval_every": 2}


def _plain_validation_loss(trainer) -> float:
    """Single-process math at world 1: the mean token cross-entropy of every validation window,
    one window at a time, by torch's own cross_entropy."""
    (dataset,), total, count = trainer.val_dataset.values(), 0.0, 0  # one source: its validation windows
    with torch.no_grad():
        for i in range(len(dataset)):
            window = dataset[i]
            logits = trainer.model(window[None, :-1])
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), window[1:],
                                                       reduction="sum").item()
            count += window.numel() - 1
    return total / count


def _case_validation(config):
    import torch.distributed as dist

    from hybridpar.train import Trainer

    trainer = Trainer(config)
    before = trainer.validate()
    reference = _plain_validation_loss(trainer) if dist.get_world_size() == 1 else None
    trainer.run()
    return {"before": before, "reference": reference, "windows": sum(map(len, trainer.val_dataset.values()))}


def _val_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def world1_validation(workers, corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("val_world1")
    result = workers(1).run(_case_validation, make_config(corpus, run_dir, steps=4, **VAL))[0]
    return result, _val_rows(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mp2-dp2", "mp1-dp4"])
def test_the_validation_loss_does_not_depend_on_the_layout(workers, check_close, corpus, tmp_path,
                                                          world1_validation, layout):
    reference, reference_rows = world1_validation
    # The validation split is uneven over the ranks: its last pass is padded with ignored windows.
    assert reference["windows"] % 8, "pick a split whose windows do not fill the last pass"
    print(f"\nworld 1: the whole split ({reference['windows']} windows): {reference['before']['val_loss']:.6f} "
          f"before training, torch's cross_entropy one window at a time: {reference['reference']:.6f}")
    check_close("world 1 against plain cross_entropy",
                {"val_loss": rel_err(_t(reference["before"]["val_loss"]),
                                     _t(reference["reference"]))}, 1e-6)
    mp, dp = {"mp2-dp2": (2, 2), "mp1-dp4": (1, 4)}[layout]
    config = make_config(corpus, tmp_path, mp=mp, dp_shard=dp, dp=dp, steps=4, **VAL)
    result = workers(mp * dp).run(_case_validation, config)[0]
    rows = _val_rows(tmp_path)
    print(f"{layout}: before training {result['before']['val_loss']:.6f}; during training {rows}; "
          f"world 1: {reference_rows}")
    assert [s for s, _ in rows] == [s for s, _ in reference_rows] == [2, 4]
    assert result["before"]["val_tokens"] == reference["before"]["val_tokens"]
    errors = {"before": rel_err(_t(result["before"]["val_loss"]), _t(reference["before"]["val_loss"]))}
    errors.update({f"step {s}": rel_err(_t(v), _t(rv))
                   for (s, v), (_, rv) in zip(rows, reference_rows)})
    check_close(layout, errors, 1e-5)
    assert rows[-1][1] < result["before"]["val_loss"]  # training lowers it


def test_eval_steps_reads_the_first_global_batches(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2, steps=2,
                         **{**VAL, "train.eval_steps": 2})
    result = workers(4).run(_case_validation, config)[0]
    assert result["before"]["val_tokens"] == 2 * 8 * 32  # 2 global batches of 8 windows of seq_len 32


def test_the_last_step_validates_when_the_steps_are_no_multiple_of_eval_every(workers, corpus, tmp_path):
    """train.steps 7, eval_every 3: validations at 3 and 6, and at 7, the end of the run (log_every 2:
    a validation on a logged step and on one between)."""
    from tests.train.test_trainer import _case_train

    config = make_config(corpus, tmp_path, steps=7, **{**VAL, "train.eval_every": 3, "train.eval_steps": 1,
                                                       "train.log_every": 2})
    workers(1).run(_case_train, config, False)
    assert [s for s, _ in _val_rows(tmp_path)] == [3, 6, 7]


# --- the profiler ----------------------------------------------------------------------------


def _case_profile(config):
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    trainer.run()
    return {"trace": str(trainer.profiler.trace), "rows": trainer.profiler.rows}


def test_a_profile_run_writes_a_trace_with_the_collectives_of_each_mesh_dimension(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2, steps=4, **{"train.profile_steps": "2-3"})
    results = workers(4).run(_case_profile, config)
    traces = sorted((tmp_path / "profile").glob("rank*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1", "rank2", "rank3"]
    events = json.loads(traces[0].read_text())["traceEvents"]  # Chrome's trace format
    names = {e.get("name", "") for e in events}
    collectives = sorted(n for n in names if n.startswith("collective "))
    print(f"\nrank 0 trace: {len(events)} events; collectives: {collectives}")
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    # FSDP's traffic goes over the data-parallel ranks: the flattened dp group with full_shard.
    assert any(n.endswith("[mp]") for n in collectives) and any(n.endswith("[dp]") for n in collectives)
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names)  # compute is there too
    for result in results:
        rows = result["rows"]
        assert [r["step"] for r in rows] == [2, 3]
        for r in rows:
            assert r["by_dim"]["mp"]["calls"] > 0 and r["by_dim"]["dp"]["bytes"] > 0
            assert math.isclose(r["compute_s"] + r["communication_s"], r["seconds"], rel_tol=1e-9)
    saved = json.loads((tmp_path / "profile" / "rank0.steps.json").read_text())
    assert [r["step"] for r in saved] == [2, 3]


# --- dashboard, summary, resume marks, wandb ---------------------------------------------------


def _case_run_poisoned(config, bad_step):
    """A run whose training step `bad_step` has NaN logits; what it printed."""
    import contextlib
    import io

    from hybridpar.train import Trainer

    trainer = Trainer(config)
    forward = trainer.model.forward

    def poisoned(tokens, *args, **kwargs):
        out = forward(tokens, *args, **kwargs)
        return out * float("nan") if trainer.step + 1 == bad_step and trainer.model.training else out

    trainer.model.forward = poisoned
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.run()
    return printed.getvalue()


@pytest.mark.slow
def test_the_run_ends_with_a_summary_whose_commands_work_and_a_dashboard(workers, corpus, tmp_path):
    run_dir = tmp_path / "run"
    # One validation batch is a val_loss for the summary (the whole split's is the tests above); the
    # dashboard is drawn by the second run, from both runs' rows.
    flags = {**VAL, "train.eval_steps": 1, "train.on_nonfinite": "skip", "checkpoint.at_end": True,
             "checkpoint.resume": True}
    workers(4).run(_case_run_poisoned, make_config(corpus, run_dir, mp=2, dp_shard=2, dp=2, steps=4, **flags), 2)
    out = workers(4).run(_case_run_poisoned, make_config(corpus, run_dir, mp=2, dp_shard=2, dp=2, steps=6,
                                                         **flags, **{"output.plot": True}), 0)[0]
    block = out[out.rindex("=== run summary"):]
    print("\n" + block)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # The dashboard's marks, and each save's cost (the first run's at the end, step 4; the second's, step 6).
    assert [(e["step"], e["event"]) for e in events] == [
        (2, "skipped"), (4, "checkpoint"), (4, "checkpoint_written"), (4, "resumed"), (6, "checkpoint"),
        (6, "checkpoint_written")], events
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("loss" in r or "val_loss" in r for r in rows)  # step rows only: events have their own file
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["first_step"], summary["last_step"]) == (5, 6) and summary["tokens"] == 2 * 8 * 32
    assert summary["checkpoint"].endswith("step-00000006") and summary["val_loss"] > 0
    for label in ("wall time", "tokens seen", "throughput", "peak memory", "final loss", "checkpoint", "resume",
                  "generate", "export to HF"):
        assert f"  {label}" in block, label
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The printed commands work as printed: export to HF, then generate from the checkpoint.
    commands = dict(line.strip().split("  ", 1) for line in block.splitlines()[1:])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = {}
    for label, extra in (("export to HF", []), ("generate", ["--max-new-tokens", "4"])):
        argv = shlex.split(commands[label].strip())
        assert argv[0] == "hybridpar"
        # Side by side: each reads the checkpoint, only the export writes (run_dir/hf).
        started[label] = subprocess.Popen([sys.executable, "-m", "hybridpar", *argv[1:], *extra], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for label, proc in started.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{label}: {stderr[-2000:]}"
            print(f"{label}: ok ({stdout.strip()[-200:]!r})")
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()
    assert (run_dir / "hf" / "config.json").exists()


def _wandb_records(path) -> list[dict]:
    """The history rows of an offline W&B run file: LevelDB's log format (32 KiB blocks, each record
    a 7-byte header: crc, length, type) after a 7-byte file header, each record a protobuf."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pending, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _case_wandb(config):
    from hybridpar.train import Trainer

    Trainer(config).run()


@pytest.mark.slow
def test_wandb_logs_the_same_metrics_offline(workers, corpus, tmp_path):
    pytest.importorskip("wandb")
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2, steps=2, **{**VAL, "output.wandb": True})
    workers(4).run(_case_wandb, config)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((tmp_path / "wandb").glob("*"))
    logged = [r for r in _wandb_records(runs[0]) if "_step" in r]
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print(f"\nW&B history: {[(h.get('_step'), round(h.get(board_tag('loss'), float('nan')), 4)) for h in logged]}")
    assert [h["_step"] for h in logged] == [r["step"] for r in jsonl]
    for h, r in zip(logged, jsonl):
        for key in ("loss", "val_loss", "tokens_per_s"):
            if key in r:  # W&B has TensorBoard's grouped names (train/loss, ...), the same numbers
                assert h[board_tag(key)] == pytest.approx(r[key], rel=1e-12), key


def _case_wandb_missing(config):
    import importlib.util

    from hybridpar.train import Trainer

    real_find = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "wandb" else real_find(name, *a)  # not installed
    try:
        Trainer(config)
    except ValueError as err:
        return str(err)
    finally:
        importlib.util.find_spec = real_find
    return "no error"


@pytest.mark.slow
def test_wandb_without_the_package_is_one_clear_error(workers, corpus, tmp_path):
    message = workers(1).run(_case_wandb_missing, make_config(corpus, tmp_path, **{"output.wandb": True}))[0]
    assert message == "output.wandb = true needs the wandb package: pip install wandb, or set output.wandb = false"
