"""The straggler across replica groups (issue 51): a whole group slower than the others makes every
other group wait in the groups' all-reduce, where no group's own straggler detector looks. Each
group's own seconds of the step and its wait travel in that all-reduce (laggards.py); a group over
diagnostics.straggler_threshold in two reports in a row is named."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from hybridpar.replicas.laggards import Laggards, line
from tests.launch.common import ROOT
from tests.replicas.jobs import rows, start, watch
from tests.replicas.test_replica_parts import FakeManager, _groups


def _step(laggards: Laggards, step: int, own: dict, waited: dict) -> dict | None:
    summed = [0.0] * (2 * laggards.groups)
    for g in own:
        summed[g], summed[laggards.groups + g] = own[g], waited[g]
    return laggards.add(step, sorted(own), summed)


def test_a_group_slower_in_two_reports_in_a_row_is_named_with_the_others_wait():
    laggards = Laggards(group=0, groups=3, every=3, threshold=1.5)
    slow = {0: 0.3, 1: 0.32, 2: 0.9}
    found = [_step(laggards, s, slow, {0: 0.6, 1: 0.58, 2: 0.01}) for s in range(1, 7)]
    assert found[:5] == [None] * 5  # over the threshold at step 3: once is a hiccup
    assert found[5] == {"group": 2, "step": 6, "waited_s": 0.59, "own_s": 0.9, "others_s": 0.31, "ratio": 2.9,
                        "first": 4}
    assert line(found[5]) == (
        "hybridpar: replica group 2 is the straggler across groups: the others waited 0.59 s for it at step 6 (their "
        "measured wait in the groups' all-reduce; its own work per step 0.90 s against the others' 0.31 s, 2.90x; "
        "medians of steps 4-6)")


def test_a_slow_step_now_and_then_a_group_alone_and_no_judging_name_nobody():
    laggards = Laggards(group=0, groups=2, every=2, threshold=1.5)
    even = {0: 0.3, 1: 0.31}
    # one slow step in each window (a heal, a GC pause): the median of three is not moved by it
    three = Laggards(group=0, groups=2, every=3, threshold=1.5)
    assert all(_step(three, s, {0: 0.3, 1: 2.0 if s % 3 == 1 else 0.31}, even) is None for s in range(1, 13))
    assert all(_step(laggards, s, {0: 0.3}, {0: 0.0}) is None for s in range(1, 9))  # nobody to compare with
    never = Laggards(group=0, groups=2, every=0, threshold=1.5)
    assert all(_step(never, s, {0: 0.3, 1: 3.0}, even) is None for s in range(1, 9)) and never.rows == []
    # the slow group changes between reports: nobody twice in a row
    assert [_step(laggards, s, {0: 0.3, 1: 0.9} if s <= 2 else {0: 0.9, 1: 0.3}, even) for s in range(1, 5)] == [None] * 4


def test_the_groups_step_times_travel_in_their_all_reduce_and_the_slow_group_is_named(monkeypatch, capsys):
    """Group 0's rank: its own seconds and its last wait go into its slots; group 1's come back in the sum,
    and after two reports in a row with group 1 three times slower, group 0 names it (and its events)."""
    model = torch.nn.Linear(2, 1, bias=False)
    sent = []

    def others(tensor, op):
        sent.append(tensor[-4:].tolist())  # this group's slots: [own 0, own 1, wait 0, wait 1]
        theirs = torch.zeros_like(tensor)
        # group 1's one-hot, its ballots, the groups' own seconds (its 0.9), their last waits (its 0.01)
        theirs[-9:] = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.01])
        return theirs

    manager = FakeManager([2], others)
    manager.should_commit = lambda: True
    replicas = _groups(monkeypatch, 0, manager, model)
    replicas.laggards = Laggards(group=0, groups=2, every=2, threshold=1.5)
    manager.start_quorum()
    clock = iter(x for s in range(4) for x in (10.0 * s, 10.0 * s + 0.3, 10.0 * s + 0.3, 10.0 * s + 0.9))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))  # the step began, the all-reduce, its end
    for step in range(4):
        replicas.step = step
        replicas._began = time.perf_counter()
        model.weight.grad = torch.ones(1, 2)
        replicas.average(list(model.parameters()), [0.0, 0.0, 0.0])
        assert replicas.commit()
    assert [round(own, 3) for own, _, _, _ in sent] == [0.3] * 4  # its own work: from the quorum to the all-reduce
    assert [round(wait, 3) for _, _, wait, _ in sent] == [0.0, 0.6, 0.6, 0.6]  # its last wait, a step late
    said = [x for x in capsys.readouterr().err.splitlines() if "straggler across groups" in x]
    assert said == ["hybridpar: replica group 1 is the straggler across groups: the others waited 0.60 s for it at "
                    "step 4 (their measured wait in the groups' all-reduce; its own work per step 0.90 s against the "
                    "others' 0.30 s, 3.00x; medians of steps 3-4)"], said
    assert [(e["step"], e["group"]) for e in replicas.metrics.seen if e["event"] == "straggler_group"] == [(4, 1)]


# Group 1's ranks each sleep in every forward: a whole group slow (its node, its network), as
# tests/launch/test_heal.py makes one rank slow.
SLOW_GROUP = """
import os
cmdline = open("/proc/self/cmdline", "rb").read().split(b"\\0")
if "LOCAL_RANK" in os.environ and b"--fault_tolerance.group" in cmdline and \\
        cmdline[cmdline.index(b"--fault_tolerance.group") + 1] == b"1":
    import time
    import hybridpar.models.llama as llama
    forward = llama.Transformer.forward

    def slow(self, *args, **kwargs):
        time.sleep(float(os.environ["SLOW_GROUP_S"]))
        return forward(self, *args, **kwargs)

    llama.Transformer.forward = slow
"""


@pytest.mark.slow
def test_a_slow_group_is_named_by_every_group(corpus, tmp_path):
    """Two groups of mp 2, group 1's ranks 1.5 s slower in every forward: reports every 3 steps, and by
    step 12 both groups name group 1, group 0 having waited about that long for it in the all-reduce."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SLOW_GROUP)
    run, steps_ = tmp_path / "run", 12
    proc = start(corpus, run, steps_, "--diagnostics.straggler_every", "3", "--fault_tolerance.timeout", "20",
                 PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{ROOT}", SLOW_GROUP_S="1.5")
    out, logs, _ = watch(proc, run)
    assert proc.returncode == 0, out + logs[0][-3000:] + logs[1][-3000:]
    pattern = (r"hybridpar: replica group 1 is the straggler across groups: the others waited ([\d.]+) s for it at "
               r"step (\d+) \(their measured wait")
    for g in (0, 1):
        found = [(float(w), int(s)) for w, s in re.findall(pattern, logs[g])]
        print(f"\ngroup {g}: {found}")
        assert found and found[0][1] in (6, 9, 12), logs[g][-3000:]  # two reports in a row: step 6 at the earliest
        assert all(0.7 < waited < 6.0 for waited, _ in found), found  # about the 1.5 s it is slower, on a loaded machine
        events = [e for e in rows(run / f"group-{g}" / "events.jsonl") if e["event"] == "straggler_group"]
        assert [(e["step"], e["group"]) for e in events] == [(s, 1) for _, s in found], events
    assert "straggler across groups" not in out
