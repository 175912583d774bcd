"""hybridpar.mesh.ranks: rank 0 acts and every rank learns the outcome; any rank fails and all fail together."""

import pytest

WORLDS = [2, 4]


class Refused(ValueError):
    """The caller's error_type: a deliberate refusal."""


def _outcome(fn, *args, **kwargs) -> str:
    """What a rank got: 'ok <value>' or '<Type>: <message>'."""
    try:
        return f"ok {fn(*args, **kwargs)!r}"
    except Exception as err:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(err).__name__}: {err}"


def _case_on_rank0_value():
    import torch.distributed as dist

    from hybridpar.mesh.ranks import on_rank0

    calls = []

    def work():
        calls.append(dist.get_rank())
        return {"from": dist.get_rank()}

    return on_rank0(work, "say hello"), calls


@pytest.mark.parametrize("world", WORLDS)
def test_on_rank0_runs_once_and_every_rank_returns_its_value(workers, world):
    results = workers(world).run(_case_on_rank0_value)
    assert [value for value, _ in results] == [{"from": 0}] * world
    assert [calls for _, calls in results] == [[0]] + [[]] * (world - 1)


def _case_on_rank0_error(kind: str):
    from hybridpar.mesh.ranks import on_rank0

    def work():
        if kind == "refusal":
            raise Refused("/data/out already exists: choose a new folder")
        raise OSError(28, "No space left on device", "/data/out/params.json")

    return _outcome(on_rank0, work, "complete /data/out", error_type=Refused)


@pytest.mark.parametrize("world", WORLDS)
def test_a_refusal_on_rank0_reads_the_same_on_every_rank(workers, world):
    results = workers(world).run(_case_on_rank0_error, "refusal")
    assert results == ["Refused: /data/out already exists: choose a new folder"] * world


@pytest.mark.parametrize("world", WORLDS)
def test_another_error_on_rank0_is_reraised_there_and_named_on_the_others(workers, world):
    results = workers(world).run(_case_on_rank0_error, "crash")
    own = "OSError: [Errno 28] No space left on device: '/data/out/params.json'"
    assert results[0] == own
    assert results[1:] == [f"Refused: rank 0 could not complete /data/out: {own}"] * (world - 1)


def _case_any_failed(failing: list, refusal: bool):
    import torch.distributed as dist

    from hybridpar.mesh.ranks import raise_if_any_failed

    rank = dist.get_rank()
    error = None
    if rank in failing:
        error = Refused(f"refused by rank {rank}") if refusal else OSError(5, f"I/O error on rank {rank}")
    return _outcome(raise_if_any_failed, error, "write its files", error_type=Refused)


@pytest.mark.parametrize("world", WORLDS)
def test_raise_if_any_failed_passes_when_no_rank_failed(workers, world):
    assert workers(world).run(_case_any_failed, [], False) == ["ok None"] * world


@pytest.mark.parametrize("world", WORLDS)
def test_raise_if_any_failed_with_one_failing_rank(workers, world):
    last = world - 1
    results = workers(world).run(_case_any_failed, [last], False)
    own = f"OSError: [Errno 5] I/O error on rank {last}"
    assert results[last] == own
    assert results[:last] == [f"Refused: rank {last} could not write its files: {own}"] * last
    refused = workers(world).run(_case_any_failed, [last], True)
    assert refused == [f"Refused: refused by rank {last}"] * world


def test_raise_if_any_failed_names_the_first_failing_rank(workers):
    results = workers(4).run(_case_any_failed, [1, 3], False)
    assert results[1] == "OSError: [Errno 5] I/O error on rank 1"
    assert results[3] == "OSError: [Errno 5] I/O error on rank 3"
    assert results[0] == results[2] == "Refused: rank 1 could not write its files: OSError: [Errno 5] I/O error on rank 1"


def test_a_world_of_one_without_a_process_group_runs_locally(monkeypatch):
    import torch.distributed as dist

    from hybridpar.mesh import ranks

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert ranks.rank_and_world() == (0, 1)
    assert ranks.gather_objects("x") == ["x"] and ranks.broadcast_from_rank0("y") == "y"
    assert ranks.on_rank0(lambda: 42, "answer") == 42

    def full_disk():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # raised as it is: there is no other rank to tell
        ranks.on_rank0(full_disk, "write", error_type=Refused)
    ranks.raise_if_any_failed(None, "write")
    with pytest.raises(OSError, match="disk full"):
        ranks.raise_if_any_failed(OSError("disk full"), "write", error_type=Refused)


def _case_wait_with_restart_counts_that_differ():
    """torchrun's agents count restarts apart: the one whose rank failed counts one, its peer restarted
    for that failure does not. Each rank here says a count of its own, as such agents' ranks do."""
    import os
    import threading

    import torch.distributed as dist

    import hybridpar
    from hybridpar.mesh.ranks import attempt_id, wait_for_every_rank

    saved = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(dist.get_rank())
    try:
        hybridpar.init_parallel()
        name = attempt_id()
        done = threading.Event()
        threading.Thread(target=lambda: (wait_for_every_rank("restart-counts"), done.set()), daemon=True).start()
        return name, done.wait(20)
    finally:
        if saved is None:
            os.environ.pop("TORCHELASTIC_RESTART_COUNT")
        else:
            os.environ["TORCHELASTIC_RESTART_COUNT"] = saved


def test_ranks_whose_restart_counts_differ_name_the_attempt_alike_and_meet(workers):
    """Seen in test_restart: after a rank was killed the agents' ranks said restart counts 1 and 0,
    and all four waited for ever in wait_for_every_rank on keys the others never wrote."""
    results = workers(2).run(_case_wait_with_restart_counts_that_differ)
    print(f"\nattempt names and met: {results}")
    assert len({name for name, _ in results}) == 1, results
    assert all(met for _, met in results), results


def _case_wait_for_a_late_rank():
    import logging
    import time

    import torch.distributed as dist

    import hybridpar.mesh.rendezvous as rendezvous
    from hybridpar.mesh.ranks import wait_for_every_rank

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("hybridpar.mesh.ranks")
    logger.addHandler(handler)
    saved, rendezvous.REPORT_EVERY = rendezvous.REPORT_EVERY, 0.4
    try:
        if dist.get_rank() == 1:
            time.sleep(1.5)  # a node still preparing its data
        wait_for_every_rank("late-rank")
    finally:
        rendezvous.REPORT_EVERY = saved
        logger.removeHandler(handler)
    return said


def test_a_wait_for_every_rank_names_the_late_ones_on_rank_0(workers):
    said = workers(2).run(_case_wait_for_a_late_rank)
    print(f"\nrank 0 said: {said[0]}")
    assert said[0] and all("for rank(s) [1] to finish late-rank" in line for line in said[0]), said
    assert said[1] == []  # once, from rank 0


def test_a_new_process_group_starts_with_no_name_and_no_counts(monkeypatch):
    """The start's name and wait_for_every_rank's counts belong to the default group: one group kept
    across many cases keeps counting (its keys never repeat), a new one (a job restarted in the same
    process) starts fresh. Keys are read from a store that every rank has reached already."""
    import types

    import torch.distributed as dist

    import hybridpar.compat.torch as compat
    from hybridpar.mesh import ranks

    class Group:  # stands for a ProcessGroup: only its identity matters here
        pass

    class Store:
        def __init__(self):
            self.keys = []

        def append(self, key, value):
            pass

        def add(self, key, amount):
            if amount:
                self.keys.append(key)
            return 2  # both ranks are here

    store = Store()
    monkeypatch.setattr(compat, "default_store", lambda: store)
    monkeypatch.setattr(ranks, "rank_and_world", lambda: (0, 2))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")

    def use(group):
        monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=group))
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: group)

    first, second = Group(), Group()
    use(first)
    ranks.agree_attempt("first-start")
    ranks.wait_for_every_rank("data")
    ranks.agree_attempt("another")  # named already: this start keeps its name
    ranks.wait_for_every_rank("data")
    use(second)  # a new group, not named yet: torchrun's run id and restart count
    ranks.wait_for_every_rank("data")
    ranks.agree_attempt("second-start")
    ranks.wait_for_every_rank("data")
    use(first)
    ranks.wait_for_every_rank("data")
    assert store.keys == ["hybridpar/arrived/first-start/data/1", "hybridpar/arrived/first-start/data/2",
                          "hybridpar/arrived/job/0/data/1", "hybridpar/arrived/second-start/data/2",
                          "hybridpar/arrived/first-start/data/3"]
