"""A stop on request (SIGTERM, SIGINT, SIGUSR1): noted, never acted on mid-collective, agreed by every
rank at the same step, saved, and bounded in time; the watchdog takes it for neither a hang nor a death."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from hybridpar.train.stop import StopRequest
from tests.checkpoint.test_dcp import _case_run, _config, mp2_dp2_runs  # noqa: F401 - a fixture
from tests.distributed import rel_err

STOP_AT = 3  # the step in which the signal arrives (no periodic checkpoint is due then)

# --- the request on its own ---------------------------------------------------------------------


def test_signals_are_noted_and_handed_back_on_uninstall():
    seen = []
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    stop = StopRequest(60, on_signal=seen.append).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: only a note
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while stop.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (stop.requested, stop.signal_name, stop.count, seen) == (True, "SIGINT", 2, ["SIGINT"])
    finally:
        stop.finish()
        stop.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_deadline_calls_on_expire_unless_finished():
    expired = []
    stop = StopRequest(0.3, on_expire=expired.append).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.8)
        assert expired == [stop]
    finally:
        stop.uninstall()
    finished = StopRequest(0.3, on_expire=expired.append).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        finished.finish()
        time.sleep(0.8)
        assert expired == [stop]
    finally:
        finished.uninstall()


def _case_signal_while_blocked():
    """Rank 0 waits in a barrier for rank 1 (asleep for 3 s) when SIGUSR1 arrives: Python's handler
    cannot run until the barrier returns, the listener thread hears the signal at once."""
    import torch.distributed as dist

    heard = []
    stop = StopRequest(60, on_signal=lambda name: heard.append(time.monotonic())).install()
    try:
        if dist.get_rank() == 1:
            time.sleep(3)
        else:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        began = time.monotonic()
        dist.barrier()
        left = time.monotonic()
    finally:
        stop.finish()
        stop.uninstall()
    return {"heard_after": heard[0] - began if heard else None, "barrier": left - began}


def test_a_rank_blocked_in_a_collective_hears_the_signal_at_once(workers):
    result = workers(2).run(_case_signal_while_blocked)[0]
    print(f"\nsignal heard after {result['heard_after']:.2f} s; the barrier returned after {result['barrier']:.2f} s")
    assert result["heard_after"] < 1.5 < result["barrier"]


# --- in a training run: mp 2 x dp 2 -------------------------------------------------------------


def _case_stop(config, signal_rank, second_rank):
    """`signal_rank` gets SIGUSR1 in step STOP_AT's forward; `second_rank` gets SIGTERM while the
    stop's checkpoint is written. Returns what rank 0 printed and each rank's last step."""
    import contextlib
    import io

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hybridpar.train import Trainer

    trainer = Trainer(config)
    rank = dist.get_rank()

    def hook(module, args):
        if rank == signal_rank and trainer.step + 1 == STOP_AT:
            os.kill(os.getpid(), signal.SIGUSR1)

    trainer.model.register_forward_pre_hook(hook)
    real_save = dcp.save

    def save(*args, **kwargs):
        if rank == second_rank:
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal, in the middle of the save
        return real_save(*args, **kwargs)

    out = io.StringIO()
    dcp.save = save
    try:
        with contextlib.redirect_stdout(out):
            history = trainer.run()
    finally:
        dcp.save = real_save
    return {"out": out.getvalue(), "step": trainer.step, "steps": [m["step"] for m in history],
            "count": trainer.stop.count}


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(
        mp2_dp2_runs, workers, corpus, tmp_path, check_close):
    s = mp2_dp2_runs
    folder, run_dir = tmp_path / "ckpt", tmp_path / "run"
    results = workers(4).run(_case_stop, _config(corpus, folder, run_dir, (2, 2, 1)), 2, 2)
    lines = [line for r in results for line in r["out"].splitlines() if line.startswith("hybridpar: stopped")]
    print("\n" + "\n".join(lines))
    assert [r["step"] for r in results] == [STOP_AT] * 4 and results[0]["steps"] == list(range(1, STOP_AT + 1))
    assert [r["count"] for r in results] == [0, 0, 2, 0]  # its SIGTERM during the save changed nothing
    assert lines == [f"hybridpar: stopped on SIGUSR1 after step {STOP_AT}; checkpoint {folder / 'step-00000003'}. "
                     "To continue, run the same command again."]
    assert [p.name for p in folder.iterdir()] == ["step-00000003"]
    marker = json.loads((run_dir / "stopped.json").read_text())
    assert marker == {"signal": "SIGUSR1", "step": STOP_AT, "checkpoint": str(folder / "step-00000003")}

    # Resumed, the run ends where the uninterrupted one did.
    resumed = workers(4).run(_case_run, _config(corpus, folder, run_dir, (2, 2, 1)))[0]
    assert resumed["start"] == STOP_AT
    assert resumed["losses"] == s["straight"]["losses"][STOP_AT:]
    errors = {name: rel_err(resumed["params"][name], value) for name, value in s["straight"]["params"].items()}
    check_close("stopped at 3, resumed to 10", errors, 0.0)
    assert not (run_dir / "stopped.json").exists()  # it told of the stopped run's end


@pytest.mark.slow
def test_a_stop_that_cannot_finish_ends_in_time_with_the_previous_checkpoint_intact(corpus, tmp_path):
    """Every rank gets SIGTERM in step 3, and rank 2 hangs there: no rank can finish the step. Within
    checkpoint.exit_save_timeout every rank leaves on its own, rank 0 says so once, the previous
    checkpoint stays, and the watchdog (a longer train timeout) reports nothing."""
    from hybridpar.checkpoint.dcp import latest_checkpoint
    from tests.diagnostics.test_watchdog import FAULT_STEP, _run_fault

    timeout = 3.0
    result, fired_at = _run_fault(corpus, tmp_path, "stop_hang", 2, **{
        "checkpoint.every": 1, "checkpoint.exit_save_timeout": timeout, "diagnostics.train_timeout": 60})
    ended = time.time()
    lines = [line for line in result.stderr.splitlines() if "hybridpar: stopping on SIGTERM did not finish" in line]
    print(f"\nended {ended - fired_at:.1f} s after the signal: {lines}")
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-4000:]
    assert lines[0].endswith(f"{tmp_path / 'run' / 'checkpoints' / f'step-{FAULT_STEP - 1:08d}'} is intact and a "
                             "resumed run continues from it")
    assert "hybridpar watchdog" not in result.stderr
    assert ended - fired_at < timeout + 20  # torchrun's own teardown included
    latest = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest.name == f"step-{FAULT_STEP - 1:08d}" and (latest / ".metadata").exists()


# --- pp 2: SIGTERM, then the summary's resume row -----------------------------------------------


def _case_sigterm(config, at_step=None):
    """Train (resuming if configured); SIGTERM to rank 0 in its stage's forward of step `at_step`.
    What rank 0 printed, the step it started from, and each step's loss and learning rate."""
    import contextlib
    import io

    import torch.distributed as dist

    from hybridpar.train import Trainer

    trainer = Trainer(config)

    def hook(module, args):
        if dist.get_rank() == 0 and trainer.step + 1 == at_step:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.model_parts[0].register_forward_pre_hook(hook)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = trainer.run()
    return {"out": out.getvalue(), "start": trainer.start_step, "train_steps": trainer.config.train.steps,
            "losses": [m["loss"] for m in history], "lrs": [m["lr"] for m in history]}


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_and_resumed_by_its_summarys_row_is_the_uninterrupted_run(workers, corpus, tmp_path):
    """pp 2 (1F1B), 6 steps, SIGTERM in step 3: the summary's resume row is the same command (it said
    --train.steps 12, which stretched the cosine schedule); taken as printed, it keeps train.steps and
    trains steps 4-6 with the losses and learning rates of the run that was never stopped."""
    import shlex

    from hybridpar.cli import build_parser
    from hybridpar.config import find_config, load_config
    from tests.runs import make_config

    flags = {"parallel.pp": 2, "parallel.pp_microbatches": 2, "model.n_layers": 2, "data.val_fraction": 0.1,
             "train.eval_steps": 1, "optim.warmup_steps": 2}
    straight = workers(2).run(_case_sigterm, make_config(corpus, tmp_path / "straight", steps=6, **flags))[0]
    stopped = workers(2).run(_case_sigterm, make_config(corpus, tmp_path / "run", steps=6, **flags), STOP_AT)[0]
    print("\n" + stopped["out"][stopped["out"].index("hybridpar: stopped"):])
    assert stopped["losses"] == straight["losses"][:STOP_AT]

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    command, note = summary["commands"]["resume"].split("   ")
    argv = shlex.split(command)
    args, overrides = build_parser().parse_known_args(argv[argv.index("train"):])
    resumed = workers(2).run(_case_sigterm, load_config(find_config(args.config), overrides))[0]
    assert (resumed["start"], resumed["train_steps"]) == (STOP_AT, 6)
    assert resumed["losses"] == straight["losses"][STOP_AT:]
    assert resumed["lrs"] == straight["lrs"][STOP_AT:]
    assert note == "(the same run: on to step 6 on the same learning-rate schedule)"
    # The stop line and the summary's rows say what happened.
    assert "To continue, run the same command again with --checkpoint.resume true." in stopped["out"]
    assert (f"validation - (stopped on SIGTERM after step {STOP_AT}, before this run's first validation "
            "(train.eval_every = 0: after the last step))") in stopped["out"]
