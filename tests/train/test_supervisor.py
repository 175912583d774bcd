"""The supervisor touches the process only between open() and close(): made, it changes nothing; opened,
the tracing variables are set and the stop signals caught; closed, both are as they were. A Trainer's
run leaves the process (environment, signal handlers, torch.distributed) as it found it."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from hybridpar.diagnostics.timeouts import ENV_DEFAULTS
from hybridpar.train.stop import STOP_SIGNALS
from hybridpar.train.supervisor import Supervisor
from tests.runs import make_config

TRACING = (*ENV_DEFAULTS, "TORCH_FR_DUMP_TEMP_FILE")


def _process() -> tuple[dict, dict]:
    return dict(os.environ), {s: signal.getsignal(s) for s in STOP_SIGNALS}


def _config(run_dir) -> SimpleNamespace:
    return SimpleNamespace(output=SimpleNamespace(run_dir=str(run_dir)),
                           checkpoint=SimpleNamespace(exit_save_timeout=60.0))


@pytest.fixture
def unset_tracing(monkeypatch):
    """None of the tracing variables set, except NCCL_DEBUG, which the user chose: it stays theirs."""
    for name in TRACING:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")


def test_constructing_a_supervisor_changes_nothing(tmp_path, unset_tracing):
    before = _process()
    s = Supervisor(_config(tmp_path / "run"))
    assert _process() == before
    assert not (tmp_path / "run").exists()
    s.close()  # never opened: nothing to undo
    assert _process() == before


def test_open_sets_up_and_close_puts_the_process_back(tmp_path, unset_tracing):
    before = _process()
    with pytest.raises(RuntimeError, match="boom"):
        with Supervisor(_config(tmp_path)) as s:
            environ, handlers = _process()
            assert {name: environ.get(name) for name in TRACING} == {
                **ENV_DEFAULTS, "NCCL_DEBUG": "INFO",
                "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "flight_recorder" / "flight_recorder_rank_")}
            assert all(h == s.stop._handle for h in handlers.values()), handlers
            raise RuntimeError("boom")
    assert _process() == before
    s.open()  # a Trainer run once more opens again
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == ENV_DEFAULTS["TORCH_FR_BUFFER_SIZE"]
    s.close()
    assert _process() == before


def _case_run_leaves_the_process_alone(config):
    import torch.distributed as dist

    from hybridpar.train import Trainer
    from hybridpar.train import trainer as trainer_module

    for name in TRACING:  # as a fresh process has them (an earlier case's Trainer, never run, set them)
        os.environ.pop(name, None)
    before, functions = _process(), (dist.all_reduce, dist.Work.wait)
    during = []
    init_parallel = trainer_module.init_parallel

    def making_the_mesh(**kwargs):  # torch reads the variables when a process group is made
        during.append(os.environ.get("TORCH_FR_BUFFER_SIZE"))
        return init_parallel(**kwargs)

    trainer_module.init_parallel = making_the_mesh
    try:
        trainer = Trainer(config)
    finally:
        trainer_module.init_parallel = init_parallel
    guard = trainer.supervisor.guard

    def watched(step, batches):  # inside run(), once per step
        during.append((_process(), dist.all_reduce is not functions[0]))
        return guard(step, batches)

    trainer.supervisor.guard = watched
    trainer.run()
    at_the_mesh, *steps = during
    (environ, handlers), wrapped = steps[-1]
    after = _process()  # the tracing variables: the data's and the compiler's own settings are theirs
    return {"before": all(before[0].get(k) == after[0].get(k) for k in TRACING) and before[1] == after[1],
            "functions": (dist.all_reduce, dist.Work.wait) == functions,
            "during": (at_the_mesh, environ.get("TORCH_FR_BUFFER_SIZE"), wrapped,
                       all(h == trainer.supervisor.stop._handle for h in handlers.values()))}


@pytest.mark.slow
def test_a_trainer_run_leaves_the_process_as_it_found_it(workers, corpus, tmp_path):
    """At world 2 with straggler reports: the tracing variables set before the mesh is made; during the
    run they are, the signals caught and the collectives timed; afterwards none of it is left."""
    config = make_config(corpus, tmp_path, dp_shard=2, strategy="full_shard", dp=2, steps=2,
                         **{"diagnostics.straggler_every": 2})
    for result in workers(2).run(_case_run_leaves_the_process_alone, config):
        size = ENV_DEFAULTS["TORCH_FR_BUFFER_SIZE"]
        assert result == {"before": True, "functions": True, "during": (size, size, True, True)}, result


@pytest.mark.parametrize("schedule, pp_layers, pp_rank, stages", [
    ("1F1B", [], 0, None),  # pp 1: the replica check names no stage (the whole model is stage 0 of 1)
    ("1F1B", [], 1, [1]),
    ("Interleaved1F1B", [], 1, [1, 3]),
    ("ZBVZeroBubble", [], 0, [0, 3]),
    ("Interleaved1F1B", [1, 1, 1, 1, 1, 1], 1, [1, 3, 5]),
])
def test_the_replica_check_is_told_the_stages_this_rank_holds(schedule, pp_layers, pp_rank, stages):
    """The supervisor is told the step runner's stage ids (Trainer: supervisor.set_up), which are the
    layout's: the ones this rank builds."""
    from hybridpar.pipeline.runner import make_runner
    from hybridpar.pipeline.schedules import StageLayout

    layout = StageLayout.of(6, 1 if stages is None else 2, pp_rank, schedule, pp_layers)
    runner = make_runner([torch.nn.Linear(1, 1) for _ in layout.ids], layout, SimpleNamespace(pp=layout.n_stages))
    assert runner.stage_ids == (stages or [0])
