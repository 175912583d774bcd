"""Tracing defaults respect the user's settings; after step 1 a stuck collective fails within the train timeout;
Deadlines applies the init or the train timeout at the right moments."""

from types import SimpleNamespace

import pytest

from hybridpar.diagnostics import timeouts
from hybridpar.diagnostics.timeouts import BACKSTOP_GRACE, ENV_DEFAULTS, apply_env_defaults
from hybridpar.train import supervisor
from tests.distributed import WorkerPool


def test_env_defaults_fill_only_what_the_user_left_unset(tmp_path):
    environ = {"NCCL_DEBUG": "INFO"}
    applied = apply_env_defaults(tmp_path / "fr", environ)
    assert environ["NCCL_DEBUG"] == "INFO" and "NCCL_DEBUG" not in applied
    assert environ["TORCH_FR_BUFFER_SIZE"] == ENV_DEFAULTS["TORCH_FR_BUFFER_SIZE"]
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr" / "flight_recorder_rank_")
    assert (tmp_path / "fr").is_dir()


def _case_stuck_collective(timeout_s: float, sleep_s: float):
    import time

    import torch
    import torch.distributed as dist

    from hybridpar.diagnostics.timeouts import set_train_timeout
    from tests.distributed import parallel_dims

    parallel = parallel_dims(mp=2)
    set_train_timeout(parallel, timeout_s)
    if parallel.rank == 1:
        time.sleep(sleep_s)  # the straggler
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1), group=parallel.mp_group)
    except RuntimeError as err:
        return {"raised_after": time.perf_counter() - start, "error": str(err)[:200]}
    return {"raised_after": None}


@pytest.mark.slow
def test_collective_times_out_after_the_train_timeout():
    pool = WorkerPool(2)  # its groups are broken afterwards: a pool of its own
    try:
        rank0, _ = pool.run(_case_stuck_collective, 2.0, 8.0, timeout=60)
    finally:
        pool.close(force=True)
    print(f"\nrank 0 gave up after {rank0['raised_after']:.1f} s: {rank0.get('error')}")
    # Rank 0 gives up after ~2 s, not after the 120 s the group started with, nor the 8 s of sleep.
    assert rank0["raised_after"] is not None and rank0["raised_after"] < 6.0
    assert "Timed out" in rank0["error"]


# --- Deadlines, without a process group: the groups' timeouts are recorded, not set ---------------

INIT, TRAIN = 600.0, 300.0


class _Watchdog:
    """Records what the trainer tells a watchdog."""

    def __init__(self) -> None:
        self.step, self.phase, self.armed = 0, "start", []

    def arm(self, timeout: float) -> None:
        self.armed.append((self.phase, timeout))


@pytest.fixture
def group_timeouts(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(timeouts, "set_train_timeout", lambda parallel, seconds: calls.append(seconds))
    monkeypatch.setattr(supervisor, "apply_env_defaults", lambda trace_dir: {})  # this process's env stays
    return calls


class _Watched:
    """The trainer's side of the deadlines, through its supervisor: where it is, a step done, a checkpoint."""

    def __init__(self, s: supervisor.Supervisor) -> None:
        self.supervisor, self.watchdog, self.at, self.checkpointing = s, s.watchdog, s.phase, s.checkpointing
        self.no_progress_limit, self.collective_timeout = s.deadlines.no_progress_limit, s.deadlines.collective_timeout

    @property
    def train_timeout_in_force(self) -> bool:
        return self.supervisor.deadlines.train_timeout_in_force

    def step_done(self, step: int) -> None:
        with self.supervisor.step(step):
            pass


def _deadlines(train_timeout=TRAIN, start_step=0, watchdog=True) -> _Watched:
    config = SimpleNamespace(output=SimpleNamespace(run_dir="unused"), checkpoint=SimpleNamespace(exit_save_timeout=60.0),
                             parallel=SimpleNamespace(init_timeout=INIT),
                             diagnostics=SimpleNamespace(train_timeout=train_timeout, replica_check_every=0))
    s = supervisor.Supervisor(config)
    s.parallel = object()
    s.set_up(start_step, model=None)  # the signals are given back here
    s.watchdog = _Watchdog() if watchdog else None
    s.deadlines.watched = watchdog
    return _Watched(s)


def test_before_the_first_step_the_init_timeout_applies(group_timeouts):
    d = _deadlines()
    assert d.no_progress_limit() == INIT and not d.train_timeout_in_force
    d.at("data", step=1)
    d.at("forward")
    assert (d.watchdog.step, d.watchdog.phase, d.watchdog.armed) == (1, "forward", [])
    assert group_timeouts == []


def test_the_first_step_done_sets_the_train_timeout_once(group_timeouts):
    d = _deadlines()
    d.step_done(1)
    assert group_timeouts == [TRAIN + BACKSTOP_GRACE]  # the collectives leave the watchdog time to report
    assert d.watchdog.armed == [("first step done", TRAIN)] and d.no_progress_limit() == TRAIN
    d.step_done(2)
    d.step_done(3)
    assert group_timeouts == [TRAIN + BACKSTOP_GRACE] and len(d.watchdog.armed) == 1


def test_a_resumed_run_keeps_the_init_timeout_until_its_own_first_step(group_timeouts):
    d = _deadlines(start_step=2)
    assert d.no_progress_limit() == INIT  # global step 2 > 0, but this run has not stepped yet
    d.step_done(3)
    assert group_timeouts == [TRAIN + BACKSTOP_GRACE] and d.no_progress_limit() == TRAIN
    d.step_done(4)
    assert group_timeouts == [TRAIN + BACKSTOP_GRACE]


def test_a_checkpoint_gets_the_init_timeout_then_the_train_timeout_back(group_timeouts):
    d = _deadlines()
    d.step_done(1)
    group_timeouts.clear()
    d.watchdog.armed.clear()
    with d.checkpointing():
        assert d.watchdog.phase == "checkpoint" and group_timeouts == [INIT]
    assert group_timeouts == [INIT, TRAIN + BACKSTOP_GRACE]
    assert d.watchdog.armed == [("checkpoint", INIT), ("checkpointed", TRAIN)]


def test_a_checkpoint_before_the_first_step_leaves_the_groups_alone(group_timeouts):
    d = _deadlines()
    with d.checkpointing():
        pass
    assert group_timeouts == []  # they still have the init timeout
    assert d.watchdog.armed == [("checkpoint", INIT), ("checkpointed", INIT)]


def test_a_train_timeout_of_0_keeps_the_init_timeout(group_timeouts):
    d = _deadlines(train_timeout=0)
    d.step_done(1)
    with d.checkpointing():
        pass
    assert group_timeouts == [] and d.no_progress_limit() == INIT and not d.train_timeout_in_force
    assert d.watchdog.armed == [("checkpoint", INIT), ("checkpointed", INIT)]


def test_without_a_watchdog_the_collectives_get_the_train_timeout_itself(group_timeouts):
    d = _deadlines(watchdog=False)
    d.at("data", step=1, timeout=1.0)  # nobody to tell
    d.step_done(1)
    with d.checkpointing():
        pass
    assert group_timeouts == [TRAIN, INIT, TRAIN]
    assert d.collective_timeout() == TRAIN and _deadlines().collective_timeout() == TRAIN + BACKSTOP_GRACE
