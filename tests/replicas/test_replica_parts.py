"""The pieces of fault-tolerant replica groups that need no second group: the refusals before anything
starts, the transport a returning group is healed through (weights only), the data position a group
returns to, and a checkpoint's record of every group's position."""

from __future__ import annotations

import pickle
import sys
from datetime import timedelta

import pytest
import torch

from tests.test_preflight import LOCAL, ROOT, _refused_alike
from tests.untrusted import RunsCode, never_ran

FT = LOCAL + ["--fault_tolerance.enabled", "true", "--fault_tolerance.groups", "2"]
HERE = ["--fault_tolerance.lighthouse", "http://localhost:29510"]


def _without_torchft(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft fails; find_spec finds nothing


# docs/training.md, Fault tolerance: the refusals before any process group, (flags, setup, line, world).
CASES = [
    (FT, None, "fault_tolerance.enabled needs the lighthouse's address: set fault_tolerance.lighthouse (e.g. "
               "http://node0:29510) or TORCHFT_LIGHTHOUSE; `hybridpar lighthouse` starts one", 1),
    (FT + HERE + ["--fault_tolerance.group", "2"], None,
     "fault_tolerance.group must be in 0 .. 1 (fault_tolerance.groups = 2), got 2", 1),
    (FT + HERE + ["--parallel.dp_replicate", "2"], None,
     "fault_tolerance.enabled replicates the model over the groups: parallel.dp_replicate must be 1 inside a group, "
     "got 2; make each replica a group (fault_tolerance.groups = 4) or set fault_tolerance.enabled = false", 2),
    (FT + HERE, _without_torchft,
     "fault_tolerance.enabled needs torchft, which is not installed: pip install 'hybridpar[ft]' (or pip install "
     "torchft)", 1),
    (FT + HERE + ["--fault_tolerance.timeout", "300"], None,
     "fault_tolerance.timeout (300 s) must be below diagnostics.train_timeout (300 s): a group waiting for a silent "
     "one would be called hung first", 1),
]


@pytest.mark.parametrize("flags,setup,line,world", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_fault_tolerance_is_refused_in_one_line_by_the_job_and_its_dry_run(monkeypatch, capsys, tmp_path, flags,
                                                                           setup, line, world):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    if setup is not None:
        setup(monkeypatch)
    _refused_alike(monkeypatch, capsys, tmp_path, flags, world, line)
    section = (ROOT / "docs" / "training.md").read_text().split("\n## Fault tolerance\n", 1)[1].split("\n## ", 1)[0]
    assert f"`{line}`" in section  # as the page quotes it


def test_a_group_gets_its_own_logs_and_the_jobs_checkpoints(tmp_path):
    from hybridpar.config import Config
    from hybridpar.preflight import group_config

    config = Config()
    config.output.run_dir = str(tmp_path / "run")
    config.fault_tolerance.enabled, config.fault_tolerance.groups, config.fault_tolerance.group = True, 3, 2
    mine = group_config(config)
    assert (mine.output.run_dir, mine.checkpoint.folder, mine.checkpoint.resume) == (
        str(tmp_path / "run" / "group-2"), str(tmp_path / "run" / "checkpoints"), True)
    assert config.output.run_dir == str(tmp_path / "run")  # the caller's config is left as it was


def _state() -> dict:
    """What a live group sends: tensors, and the optimizer's and schedule's plain values (a tuple among them)."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return {"user": {"default": {"model": [p.detach() for p in model.parameters()], "optimizer": optimizer.state_dict(),
                                 "scheduler": scheduler.state_dict(), "step": 7, "windows": [7, 5]}},
            "torchft": {"step": 7, "batches_committed": 12}}


def test_a_returning_group_receives_the_state_and_never_runs_code(tmp_path):
    from hybridpar.replicas.transport import WeightsOnlyTransport

    timeout = timedelta(seconds=10)
    live, returning = WeightsOnlyTransport(timeout, num_chunks=0), WeightsOnlyTransport(timeout, num_chunks=0)
    try:
        sent = _state()
        live.send_checkpoint([1], step=7, state_dict=sent, timeout=timeout)
        got = returning.recv_checkpoint(src_rank=0, metadata=live.metadata(), step=7, timeout=timeout)
        assert pickle.dumps(got["torchft"]) == pickle.dumps(sent["torchft"])
        mine, theirs = got["user"]["default"], sent["user"]["default"]
        assert all(torch.equal(a, b) for a, b in zip(mine["model"], theirs["model"], strict=True))
        assert mine["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]  # betas a tuple again
        assert (mine["step"], mine["windows"], mine["scheduler"]) == (7, [7, 5], theirs["scheduler"])
        live.disallow_checkpoint()
        # A peer whose state would run code when read (torchft's own reader unpickles anything).
        marker = tmp_path / "ran"
        live.send_checkpoint([1], step=8, state_dict={"user": RunsCode(marker, 1)}, timeout=timeout)
        never_ran(marker, lambda: returning.recv_checkpoint(src_rank=0, metadata=live.metadata(), step=8,
                                                            timeout=timeout), pickle.UnpicklingError)
    finally:
        live.shutdown()
        returning.shutdown()


def _loader(dp_rank: int, dp_size: int, sources):
    from hybridpar.data.loader import ResumableDataLoader

    return ResumableDataLoader(sources, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=2, seed=3)


@pytest.mark.parametrize("blend", [False, True], ids=["one source", "a blend"])
def test_a_group_returns_to_the_windows_after_its_own(tmp_path, blend):
    """seek(n) is where the loader is after n micro-batches read, from any position: a returning group's
    next windows are the ones after the last it trained, and no other group's."""
    from types import SimpleNamespace

    import numpy as np

    from hybridpar.data.loader import PackedDataset, Source

    tokens = [np.arange(n, dtype=np.int64) + 1000 * i for i, n in enumerate((300, 170) if blend else (300,))]
    datasets = [PackedDataset(SimpleNamespace(tokens=t, n_tokens=len(t)), 8) for t in tokens]  # every token its own
    sources = [Source(f"s{i}", 1 / len(datasets), d) for i, d in enumerate(datasets)]
    read = _loader(1, 4, sources)  # group 0 of 2 groups x dp 2, its dp rank 1
    batches = [next(read) for _ in range(12)]
    for n in (0, 5, 12):
        returning = _loader(1, 4, sources)
        next(returning)  # somewhere else first: seek starts from the data's start
        returning.seek(n)
        expected = batches[n] if n < 12 else next(read)
        assert all(torch.equal(a, b) for a, b in zip(next(returning), expected))
    # The four readers' windows of one micro-batch are four different ones.
    firsts = [next(_loader(r, 4, sources))[0] for r in range(4)]
    assert len({tuple(w.tolist()) for f in firsts for w in f}) == 4 * 2


def test_a_checkpoint_of_other_groups_is_refused_in_one_line():
    from hybridpar.config.fault_tolerance import FaultToleranceConfig
    from hybridpar.replicas.groups import ReplicaGroups

    groups = ReplicaGroups(FaultToleranceConfig(enabled=True, groups=2), grad_accum=1)
    groups.load_state_dict({"windows": [4, 3], "groups": 2})
    assert groups.windows == [4, 3]
    with pytest.raises(ValueError, match=r"written by 3 replica groups and this job has 2: resume with "
                                         r"fault_tolerance.groups = 3"):
        groups.load_state_dict({"windows": [4, 3, 4], "groups": 3})
