"""A full disk said plainly: a checkpoint's size known before it is written, one message that says
what to change, and a save that runs out of space anyway leaves no partial folder behind."""

import errno
import os
import subprocess
import sys
import types
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from hybridpar.checkpoint import space
from hybridpar.checkpoint.dcp import CheckpointDiskFullError, Checkpointer
from hybridpar.files import DiskFullError, full_disk_said, write_text_atomic
from tests.runs import make_config

Usage = namedtuple("Usage", "total used free")
MiB = 2**20


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr("shutil.disk_usage", lambda path: Usage(100 * MiB, 100 * MiB - free, free))


# --- the size estimate ---------------------------------------------------------------------------


def test_estimate_counts_tensor_bytes_and_what_dcp_adds():
    state = {"model": {"w": torch.zeros(100, 10), "b": torch.zeros(10)},
             "optimizer": {"state": {"w": {"exp_avg": torch.zeros(100, 10, dtype=torch.bfloat16),
                                           "step": torch.tensor(1.0)}},
                           "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}}
    tensor_bytes = 4000 + 40 + 2000 + 4
    expected = int(space.MARGIN * (tensor_bytes + 4 * space.BYTES_PER_TENSOR)) + space.BYTES_PER_RANK
    assert space.checkpoint_bytes(state, 1) == expected
    # A plain tensor is the same on every rank and stored once: each of 4 ranks counts a quarter.
    assert space.local_share(state, 4) == (tensor_bytes / 4, 1.0)


def _case_estimate(folder: str, layout: tuple) -> tuple:
    """Save an FSDP model and its AdamW state at `layout`: (the estimate the save used, the bytes on disk)."""
    import torch.distributed as dist

    from hybridpar.checkpoint import dcp as dcp_module
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from tests.distributed import parallel_dims

    mp, dp_shard, dp_replicate = layout
    parallel = parallel_dims(mp=mp, dp_shard=dp_shard, dp_replicate=dp_replicate)
    args = ModelArgs.from_preset("debug", vocab_size=512)
    strategy = "hybrid_shard" if dp_replicate > 1 else "full_shard"
    model = apply_fsdp(Transformer(args, parallel), parallel, FSDPConfig(sharding_strategy=strategy,
                                                                         param_dtype="float32"))
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's state exists
    estimates = []
    real = dcp_module.checkpoint_bytes
    dcp_module.checkpoint_bytes = lambda state, world: estimates.append(real(state, world)) or estimates[-1]
    try:
        path = Checkpointer(Path(folder), parallel).save(1, model, optimizer, {}, {})
    finally:
        dcp_module.checkpoint_bytes = real
    on_disk = sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())
    return (estimates[0], on_disk) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("layout", [(2, 2, 1), (2, 1, 2)], ids=["mp2-dp2", "mp2-replicate2"])
def test_estimate_matches_a_saved_checkpoint(workers, tmp_path, layout):
    # Replicated pieces (mp's norms, every replica's shards) are stored once: counting them per rank
    # would double the hybrid layout's estimate and refuse saves that fit.
    estimate, on_disk = workers(4).run(_case_estimate, str(tmp_path), layout)[0]
    print(f"\n{layout}: estimate {estimate:,} bytes, on disk {on_disk:,} ({estimate / on_disk:.3f}x)")
    assert on_disk <= estimate <= 1.1 * on_disk


# --- the message ---------------------------------------------------------------------------------


def _folder_of_checkpoints(folder: Path, steps) -> None:
    for step in steps:
        (folder / f"step-{step:08d}").mkdir(parents=True)
        (folder / f"step-{step:08d}" / "train_state.json").write_text("{}")


def test_refusal_names_needed_free_and_what_keep_deletes(tmp_path, monkeypatch):
    _folder_of_checkpoints(tmp_path, [1, 2, 3])
    checkpointer = Checkpointer(tmp_path, types.SimpleNamespace(rank=0, world_size=1), keep=2)
    _free(monkeypatch, 3 * MiB)
    refusal = checkpointer._no_room_for(tmp_path / "step-00000004", 5 * MiB + 1)
    assert refusal == (
        f"checkpoint step-00000004 not saved: nothing was written; step-00000003 is intact: {tmp_path} has no room "
        "(needs 5.0 MiB, 3.0 MiB free): checkpoint.keep = 2 deletes step-00000001, step-00000002 after this save "
        "(removing them by hand now frees their space); or free space there, lower checkpoint.keep, or point "
        "checkpoint.folder elsewhere")
    assert checkpointer._no_room_for(tmp_path / "step-00000004", 3 * MiB) is None  # exactly the room there is
    checkpointer.keep = 5
    assert "(needs 3.0 MiB, 3.0 MiB free): free space there, lower" in checkpointer._no_room_for(
        tmp_path / "step-00000004", 3 * MiB + 1)
    assert issubclass(CheckpointDiskFullError, DiskFullError) and CheckpointDiskFullError.every_rank


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_full_disk_is_one_error_naming_the_folder(tmp_path, monkeypatch, code):
    _free(monkeypatch, 1536)
    with pytest.raises(DiskFullError) as said:
        with full_disk_said(tmp_path, "metrics.jsonl could not be written", "point output.run_dir elsewhere"):
            raise OSError(code, os.strerror(code))
    assert str(said.value) == (f"metrics.jsonl could not be written ({os.strerror(code)}): {tmp_path} has no room "
                               "(1.5 KiB free): point output.run_dir elsewhere")
    assert said.value.errno == code and isinstance(said.value, OSError)
    with pytest.raises(PermissionError):  # any other error passes as it is
        with full_disk_said(tmp_path, "x"):
            raise PermissionError(errno.EACCES, "Permission denied")


def test_an_atomic_write_that_runs_out_of_space_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    _free(monkeypatch, 0)
    with pytest.raises(DiskFullError, match=rf"^config.toml could not be written \(No space left on device\): "
                                            rf"{tmp_path} has no room \(0 B free\)"):
        write_text_atomic(tmp_path / "config.toml", "x")
    assert list(tmp_path.iterdir()) == []


def test_metrics_on_a_full_disk_end_with_one_error_naming_the_run_folder(tmp_path, monkeypatch):
    import builtins

    from hybridpar.train import metrics

    # /dev/full: every write fails with ENOSPC, as on a full file system.
    monkeypatch.setattr(metrics, "open", lambda path, mode="r", **kw: builtins.open("/dev/full", mode, **kw),
                        raising=False)
    _free(monkeypatch, 0)
    writer = metrics.MetricsWriter(tmp_path, enabled=True, tensorboard=False)
    with pytest.raises(DiskFullError, match=rf"^the run's metrics \(metrics.jsonl, tensorboard/\) could not be "
                                            rf"written \(No space left on device\): {tmp_path} has no room "
                                            r"\(0 B free\): free space there or point output.run_dir elsewhere$"):
        writer.write(1, {"loss": 1.0})
    writer.close()  # already closed: nothing is flushed again


# --- a save that runs out of space while writing ---------------------------------------------------


def _case_write_runs_out(folder: str, async_save: bool) -> str:
    """Save step 1; step 2's writes fail on rank 1 with ENOSPC. Returns what step 2's save raised."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tests.distributed import parallel_dims

    class FullDiskWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            if dist.get_rank() == 1 and self.path.name.startswith("step-00000002"):
                (self.path / "__1_0.distcp").write_bytes(b"half a shard")
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write_data(plan, planner)

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer = Checkpointer(Path(folder), parallel_dims(mp=1), keep=3, async_save=async_save)
    checkpointer._writer = lambda path: FullDiskWriter(str(path))
    checkpointer.save(1, model, optimizer, {}, {})
    try:
        checkpointer.save(2, model, optimizer, {}, {})
        checkpointer.wait()  # an async save's failure surfaces here
        outcome = "no error"
    except CheckpointDiskFullError as err:
        outcome = str(err)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    checkpointer.load(Path(folder) / "step-00000001", model, optimizer, {})
    assert torch.equal(model.weight, before)  # the previous checkpoint loads
    checkpointer.close()
    return outcome


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_that_runs_out_of_space_removes_its_partial_folder(workers, tmp_path, async_save):
    outcomes = workers(2).run(_case_write_runs_out, str(tmp_path), async_save)
    print(f"\n{outcomes[0]}")
    assert outcomes[0] == outcomes[1], outcomes  # every rank raises the same error
    assert outcomes[0].startswith("checkpoint step-00000002 not saved: writing it ran out of space (No space left "
                                  "on device), the partial folder was removed; step-00000001 is intact: "), outcomes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


# --- world 4 through the command line, on a small file system --------------------------------------


@pytest.fixture
def small_mount(tmp_path):
    """mount(bytes) -> a folder on a tmpfs of that size, unmounted at the end (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def mount(size: int) -> Path:
        folder = tmp_path / "small"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


def _train_on_small_disk(corpus, run_dir: Path, folder: Path, mistake: str, **flags) -> str:
    """`hybridpar train` at world 4 (mp 2 x dp 2) under torchrun; its combined output."""
    from tests.test_cli import ROOT, _run

    args = {"--config": "local", "--train.steps": "2", "--output.run_dir": str(run_dir), "--model.preset": "debug",
            "--model.vocab_size": "512", "--data.tokenizer_vocab_size": "512", "--data.seq_len": "32",
            "--data.source": corpus["source"], "--data.cache_dir": corpus["cache_dir"], "--train.peak_flops": "1e12",
            "--checkpoint.folder": str(folder), "--checkpoint.every": "1", "--checkpoint.at_end": "false",
            # The same training data as tests.runs.make_config, whose runs resume these checkpoints.
            "--data.val_fraction": "0", "--train.eval_every": "0", "--train.eval_steps": "0",
            **flags}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "tests" / "diagnostics" / "cli_job.py"), mistake, "--", *[x for kv in args.items() for x in kv]]
    result = _run(cmd, 600)
    assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout + result.stderr


def _one_message(output: str, start: str) -> str:
    ours = [line for line in output.splitlines() if line.startswith("hybridpar: error")]
    print("\n" + "\n".join(ours))
    assert len(ours) == 1 and ours[0].startswith(start), output[-3000:]
    assert output.count("has no room") == 1, output[-3000:]  # once: not once per rank, not in a traceback
    return ours[0]


def _case_resume_step(config) -> int:
    from hybridpar.train import Trainer

    return Trainer(config).step


def _checkpoint_bytes_of_debug_model() -> int:
    from hybridpar.models.args import ModelArgs

    return 12 * ModelArgs.from_preset("debug", vocab_size=512).num_params()  # fp32 weights + AdamW's two moments


def _assert_step1_intact(workers, corpus, tmp_path, folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000001"]  # no .partial folder
    config = make_config(corpus, tmp_path / "resume", mp=2, dp_shard=2, dp=2,
                         **{"checkpoint.folder": str(folder), "checkpoint.resume": True})
    assert workers(4).run(_case_resume_step, config) == [1] * 4  # and it loads


@pytest.mark.slow
def test_cli_a_checkpoint_that_does_not_fit_is_refused_before_writing(workers, corpus, tmp_path, small_mount):
    # Room for one checkpoint and a half: step 1 is saved, step 2 is refused before anything is written.
    folder = small_mount(int(1.5 * _checkpoint_bytes_of_debug_model()))
    output = _train_on_small_disk(corpus, tmp_path / "run", folder, "none", **{"--checkpoint.keep": "1"})
    line = _one_message(output, "hybridpar: error: checkpoint step-00000002 not saved: nothing was written; "
                                "step-00000001 is intact: ")
    assert f"{folder} has no room (needs " in line and "checkpoint.keep = 1 deletes step-00000001 after this save" in line
    _assert_step1_intact(workers, corpus, tmp_path, folder)


@pytest.mark.slow
def test_cli_a_save_that_runs_out_of_space_is_removed(workers, corpus, tmp_path, small_mount):
    # The estimate taken for 1 byte: step 2 passes the check and its background writes fail.
    folder = small_mount(int(1.5 * _checkpoint_bytes_of_debug_model()))
    output = _train_on_small_disk(corpus, tmp_path / "run", folder, "low_estimate",
                                  **{"--checkpoint.keep": "2", "--checkpoint.async_save": "true"})
    _one_message(output, "hybridpar: error: checkpoint step-00000002 not saved: writing it ran out of space (No space "
                         "left on device), the partial folder was removed; step-00000001 is intact: ")
    _assert_step1_intact(workers, corpus, tmp_path, folder)


@pytest.mark.slow
def test_cli_a_full_run_folder_is_one_message(corpus, tmp_path, small_mount):
    # A run folder with room for config.toml alone (tmpfs counts whole pages): rank 0's first metrics
    # row fails. The other ranks are ended by the launcher (the watchdog's report names the cause).
    run_dir = small_mount(4096)
    output = _train_on_small_disk(corpus, run_dir, tmp_path / "ckpt", "none")
    ours = [line for line in output.splitlines() if line.startswith("hybridpar: error")]
    print("\n" + "\n".join(ours))
    assert len(ours) == 1, output[-3000:]
    assert ours[0].startswith("hybridpar: error (rank 0): the run's metrics (metrics.jsonl, tensorboard/) could not "
                              f"be written (No space left on device): {run_dir} has no room ("), output[-3000:]
    assert "point output.run_dir elsewhere" in ours[0]
    assert output.count("Traceback") <= 1, output[-3000:]  # torchrun's own, around its summary
