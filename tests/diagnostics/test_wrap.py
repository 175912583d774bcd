"""The one layer over torch.distributed: torch.distributed exactly as it was once the last listener
is out (an exception included), listeners nested and side by side, and the counter and the
straggler timer seeing the same collectives."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hybridpar.diagnostics import wrap
from hybridpar.diagnostics.collectives import CollectiveCounter
from hybridpar.diagnostics.stragglers import CollectiveTimer


def _torch_distributed() -> dict:
    """Every attribute the layer may replace, as the objects they are (and whether Work owns wait)."""
    found = {(module.__name__, name): getattr(module, name, None)
             for module in (dist, c10d) for name in wrap.WRAPPED}
    found[("Work", "wait")] = dist.Work.wait
    found[("Work", "own wait")] = "wait" in vars(dist.Work)
    return found


class _Seen(wrap.Listener):
    """Notes the name of every call it sees, with its depth."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def around(self, call):
        self.calls.append((call.name, call.outer is None))


def test_the_functions_are_the_same_objects_after_exit_also_after_an_exception():
    before = _torch_distributed()
    with pytest.raises(RuntimeError, match="boom"):
        with CollectiveCounter(), CollectiveTimer():
            assert dist.all_reduce is not before[("torch.distributed", "all_reduce")]
            assert dist.Work.wait is not before[("Work", "wait")]
            # One wrapper per function, wherever torch makes it reachable (its aliases call c10d's).
            assert c10d.all_reduce is dist.all_reduce
            raise RuntimeError("boom")
    after = _torch_distributed()
    assert all(after[key] is value for key, value in before.items()), \
        [key for key, value in before.items() if after[key] is not value]
    assert wrap.listeners() == ()


def test_nested_listeners_share_the_wrappers_and_the_last_one_out_restores(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: calls.append("barrier"))
    original = dist.barrier
    outer, inner = _Seen(), _Seen()
    with outer:
        wrapped = dist.barrier
        with inner:
            assert dist.barrier is wrapped  # installed once
            dist.barrier()
        assert wrap.listeners() == (outer,) and dist.barrier is wrapped
        dist.barrier()
    assert dist.barrier is original and calls == ["barrier"] * 2
    assert outer.calls == [("barrier", True)] * 2 and inner.calls == [("barrier", True)]
    # Left in another order than entered: the same.
    first, second = _Seen(), _Seen()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    dist.barrier()
    assert second.calls == [("barrier", True)] and first.calls == []
    second.__exit__(None, None, None)
    assert dist.barrier is original and wrap.listeners() == ()


def test_a_listener_entered_twice_is_refused():
    counter = CollectiveCounter()
    with counter:
        with pytest.raises(RuntimeError, match="already listening"):
            counter.__enter__()
    assert wrap.listeners() == ()


def _every_collective_case():
    """Every collective of wrap.COLLECTIVES this torch has, at world 2 on gloo, with the counter and
    the straggler timer listening: per name, the counter's new records and the timer's new seconds."""
    import warnings

    import torch

    t = lambda: torch.ones(4)  # noqa: E731
    calls = {
        "all_reduce": lambda: dist.all_reduce(t()),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([t()]),
        "broadcast": lambda: dist.broadcast(t(), src=0),
        "reduce": lambda: dist.reduce(t(), dst=0),
        "all_gather": lambda: dist.all_gather([t(), t()], t()),
        "all_gather_single": lambda: dist.all_gather_single(torch.zeros(8), t()),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros(8), t()),
        "_all_gather_base": lambda: dist._all_gather_base(torch.zeros(8), t()),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced([[t()], [t()]], [t()]),
        "reduce_scatter": lambda: dist.reduce_scatter(t(), [t(), t()]),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(t(), torch.ones(8)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t(), torch.ones(8)),
        "_reduce_scatter_base": lambda: dist._reduce_scatter_base(t(), torch.ones(8)),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(8), torch.ones(8)),
        "all_to_all": lambda: dist.all_to_all([t(), t()], [t(), t()]),
        "barrier": lambda: dist.barrier(),
        "all_gather_object": lambda: dist.all_gather_object([None, None], {"a": 1}),
        "broadcast_object_list": lambda: dist.broadcast_object_list([1], src=0),
    }
    assert set(calls) == set(wrap.COLLECTIVES)  # a name added there gets a call here
    seen = {}
    with CollectiveCounter() as counter, CollectiveTimer() as timer, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's old names
        timer.measuring = True
        for name, call in calls.items():
            if not hasattr(dist, name):  # torch 2.11: no all_gather_single / reduce_scatter_single
                continue
            records, waited = len(counter.records), timer.wait
            call()
            seen[name] = ([(r.kind, r.payload) for r in counter.records[records:]], timer.wait - waited)
    return seen


def test_the_counter_and_the_timer_see_the_same_collectives(workers):
    for seen in workers(2).run(_every_collective_case):
        assert set(seen) == {name for name in wrap.COLLECTIVES if hasattr(dist, name)}
        untimed = [name for name, (_, seconds) in seen.items() if seconds <= 0]
        assert not untimed, untimed
        for name, (records, _) in seen.items():
            kind = wrap.COLLECTIVES[name][0]
            if kind == "object":  # counted as its tensor collectives: sizes, then the pickled bytes
                assert [k for k, _ in records] == [{"all_gather_object": "all_gather"}.get(name, "broadcast")] * 2
            else:  # once, an alias included
                assert [k for k, _ in records] == [kind], (name, records)
        assert seen["all_reduce"][0] == [("all_reduce", 16)] and seen["barrier"][0] == [("barrier", 0)]
        assert seen["reduce_scatter_tensor"][0] == [("reduce_scatter", 32)]
