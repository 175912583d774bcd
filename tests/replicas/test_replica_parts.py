"""The pieces of fault-tolerant replica groups that need no second group: the refusals before anything
starts, the transport a returning group is healed through (weights only), the data position a group
returns to, and a checkpoint's record of every group's position."""

from __future__ import annotations

import pickle
import re
import sys
from datetime import timedelta
from types import SimpleNamespace

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


def test_the_loader_records_the_windows_it_hands_out():
    """What windows.jsonl is made of (fault_tolerance.record_windows): each micro-batch's (source, window)
    pairs of every reader, this rank's share being the windows of the batch it was handed."""
    from types import SimpleNamespace

    import numpy as np

    from hybridpar.data.loader import PackedDataset, Source

    datasets = [PackedDataset(SimpleNamespace(tokens=np.arange(n, dtype=np.int64) + 1000 * i, n_tokens=n), 8)
                for i, n in enumerate((300, 170))]
    loader = _loader(1, 4, [Source(f"s{i}", 0.5, d) for i, d in enumerate(datasets)])
    next(loader)  # not recorded
    loader.record = []
    batches = [next(loader) for _ in range(3)]
    assert len(loader.record) == 3 and all(len(pairs) == 2 * 4 for pairs in loader.record)
    for (inputs, _), pairs in zip(batches, loader.record):
        mine = pairs[1::4]  # dp rank 1 of 4 readers
        assert all(torch.equal(row, datasets[s][w][:-1]) for row, (s, w) in zip(inputs, mine))
    assert len({p for pairs in loader.record for p in pairs}) == 3 * 8  # a group's windows, each once


class FakeManager:
    """torchft's Manager as one group sees it, the other group's contributions given: `others(tensor, op)`
    returns what the rest of the quorum adds to an all-reduce."""

    def __init__(self, participants, others) -> None:
        self.participants, self.others = list(participants), others
        self.quorums, self._quorum_id, self.now = 0, -1, 0

    def start_quorum(self) -> None:
        self.now = self.participants[min(self.quorums, len(self.participants) - 1)]
        self.quorums += 1
        self._quorum_id = self.now  # a new quorum when its groups change

    def num_participants(self) -> int:
        return self.now

    def participating_rank(self) -> int:
        return 0

    def errored(self):
        return None

    def allreduce(self, tensor, reduce_op=None):
        from torch.distributed import ReduceOp

        total = tensor + self.others(tensor, reduce_op)
        tensor.copy_(total if reduce_op == ReduceOp.SUM else total / self.now)
        return SimpleWork()


class SimpleWork:
    def wait(self) -> None:
        pass


class Events:
    def __init__(self) -> None:
        self.seen = []

    def event(self, step, event, **fields) -> None:
        self.seen.append({"step": step, "event": event, **fields})

    def continue_from(self, step) -> None:
        pass


def _groups(monkeypatch, group: int, manager, model) -> "ReplicaGroups":  # noqa: F821
    from types import SimpleNamespace

    from hybridpar.config.fault_tolerance import FaultToleranceConfig
    from hybridpar.replicas import groups as module

    monkeypatch.setattr(module.dist, "get_rank", lambda: 0)  # this group's rank 0, without a process group
    monkeypatch.setattr(module.time, "sleep", lambda seconds: None)
    replicas = module.ReplicaGroups(FaultToleranceConfig(enabled=True, groups=2, group=group), grad_accum=1)
    replicas.manager, replicas.modules, replicas.metrics = manager, [model], Events()
    replicas.loader = SimpleNamespace(state_dict=lambda: {}, dp_size=2, record=None)
    replicas.at = lambda *args, **kwargs: None
    return replicas


def _other_row(model, group: int, healed: bool):
    """The other group's contribution to the replica check's sum: its row of checksums."""
    from hybridpar.replicas.check import table_row

    return lambda tensor, op: table_row([model], group, 2, healed)[1]


def test_the_first_step_waits_for_every_group_then_the_groups_are_compared(monkeypatch):
    """Group 0 first alone in the quorum (group 1 still setting up): it asks again until both are there,
    instead of training step 1 alone (group 1 would then be healed to step 1). The first quorum is checked
    across the groups; a later step of the same quorum is not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    manager = FakeManager([1, 1, 2], _other_row(model, 1, healed=False))
    replicas = _groups(monkeypatch, 0, manager, model)
    assert replicas.begin_step(0) == 0 and manager.quorums == 3
    assert replicas.metrics.seen == [{"step": 1, "event": "replica_check", "groups": [0, 1], "healed": [], "differ": {}}]
    replicas.begin_step(0)  # the step done again (or the next one): no wait, the same quorum: no check
    assert manager.quorums == 4 and len(replicas.metrics.seen) == 1


def test_a_new_quorum_seen_by_another_rank_of_the_group_checks_on_every_rank(monkeypatch):
    """The check's collectives run on every rank of the group or none: a rank whose own quorum id did not
    change checks too when another rank's did (the full suite once hung with rank 1 in the check's gather and
    rank 0 in the next forward, after a restarted lighthouse numbered its quorums afresh)."""
    import hybridpar.replicas.groups as groups

    model = torch.nn.Linear(4, 3)
    manager = FakeManager([1, 1, 2], _other_row(model, 1, healed=False))
    replicas = _groups(monkeypatch, 0, manager, model)
    replicas.begin_step(0)
    assert len(replicas.metrics.seen) == 1
    monkeypatch.setattr(groups, "gather_objects", lambda mine: [mine, True])  # rank 1 saw a new quorum
    replicas.begin_step(0)  # this rank's quorum id is the same
    assert len(replicas.metrics.seen) == 2 and replicas.metrics.seen[-1]["event"] == "replica_check"


@pytest.mark.parametrize("group", [0, 1])
def test_a_group_healed_to_other_parameters_is_named_and_leaves(monkeypatch, capsys, group):
    """Group 1 healed in this step holds another weight than group 0: group 1 raises (its launcher restarts
    it, to be healed again), group 0 says which group and parameter differ and trains on."""
    from hybridpar.diagnostics.replicas import ReplicaMismatchError

    torch.manual_seed(0)
    good = torch.nn.Linear(4, 3)
    bad = torch.nn.Linear(4, 3)
    bad.load_state_dict(good.state_dict())
    with torch.no_grad():
        bad.weight[1, 2] += 1e-3
    mine, theirs = (good, bad) if group == 0 else (bad, good)
    replicas = _groups(monkeypatch, group, FakeManager([2], _other_row(theirs, 1 - group, healed=group == 0)), mine)
    replicas.healed = {"from_step": 0, "to_step": 5, "seconds": 0.1} if group == 1 else None
    replicas.step = 5
    text = "replica check across groups, step 6: replica group 1 (healed from a live group in this step) holds other "
    if group == 1:
        with pytest.raises(ReplicaMismatchError, match=re.escape(text + "parameters than group 0: weight; replica "
                                                                 "group 1 leaves the job")):
            replicas._check_groups()
    else:
        replicas._check_groups()
        assert replicas.metrics.seen[-1]["differ"] == {1: ["weight"]}
        assert text + "parameters than group 0: weight; the group(s) [1] leave the job" in capsys.readouterr().err


def test_the_groups_average_their_gradients_and_add_their_stop_ballots(monkeypatch):
    """One all-reduce: the mean gradient, which groups took part, and every group's stop ballot, so that
    all groups of the quorum stop after the same step (a SIGTERM seen by group 1 only stops group 0 too)."""
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[1.0, 3.0]])
    # group 1's gradient, its one-hot, SIGTERM noted, its seconds of the step and its last wait (laggards.py)
    theirs = torch.tensor([3.0, 5.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    replicas = _groups(monkeypatch, 0, FakeManager([2], lambda tensor, op: theirs), model)
    replicas.manager.start_quorum()
    assert replicas.average(list(model.parameters()), [0.0, 0.0, 0.0]) == [1.0, 0.0, 0.0]
    assert replicas._members == [0, 1] and model.weight.grad.tolist() == [[2.0, 4.0]]


def test_the_steps_with_fewer_groups_are_counted_with_the_seconds_until_all_were_back(monkeypatch):
    from hybridpar.replicas import record

    clock = iter([100.0, 112.5, 130.0])
    monkeypatch.setattr(record.time, "monotonic", lambda: next(clock))
    membership = record.Membership(2)
    events = {step: membership.committed(step, members) for step, members in
              [(1, [0, 1]), (2, [0, 1]), (3, [0]), (4, [0]), (5, [0]), (6, [0, 1]), (7, [0, 1])]}
    assert {s: e for s, e in events.items() if e} == {3: {"groups": [0], "was": [0, 1]},
                                                      6: {"groups": [0, 1], "was": [0], "seconds_fewer": 12.5}}
    report = membership.report(0, [7, 4])
    assert report["fewer_groups"] == [{"first": 3, "last": 5, "groups": [0], "all_back_s": 12.5}]
    assert report["steps_with_fewer_groups"] == 3
    assert record.summary_lines(report) == [
        "group 0 of 2", "steps committed with fewer groups: 3: 3-5 by group 0 (all back 12.5 s after the groups "
        "became fewer)"]
    membership.committed(8, [0])  # gone again at the end
    assert record.summary_lines(membership.report(0, [8, 4]))[1].endswith("8 by group 0; not all back by the end")


@pytest.mark.slow
def test_the_lighthouse_serves_on_after_a_stop_signal_for_the_groups_last_steps():
    """A preemption signals every process of the job at once: the lighthouse serves on (STOP_GRACE) so
    that the groups can reach the step they all stop after; a Ctrl-C after the first signal stops it at once."""
    import os
    import signal
    import subprocess
    import time

    from tests.launch.common import script_env

    proc = subprocess.Popen([sys.executable, "-m", "hybridpar", "lighthouse", "--port", "0"], cwd=ROOT,
                            env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "hybridpar lighthouse: http://" in proc.stdout.readline()
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(2.0)
        assert proc.poll() is None  # serving still
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
