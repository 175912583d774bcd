"""Shared fixtures: spawned worker pools (one per world size) and the equivalence-error table."""

from __future__ import annotations

import math
import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite starts hundreds of Python processes (a job's ranks, its launcher, a CLI run), each of which
# imports hybridpar and test modules. Where the environment forbids bytecode files (PYTHONDONTWRITEBYTECODE,
# to keep the checkout clean) each of them compiled those sources anew; they are cached outside the
# checkout instead, in a folder of the temp dir kept between sessions (a stale file is recompiled).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), f"hybridpar-pycache-{os.getuid()}"))
    sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False

import pytest  # noqa: E402

from hybridpar.progress import log_to_terminal  # noqa: E402
from tests.distributed import WorkerPool  # noqa: E402

# The library logs; tests read its lines where the command line shows them (stdout, stderr).
log_to_terminal()

@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small jsonl corpus (real text from the embedded corpus) and a cache folder shared by all runs."""
    import json

    from hybridpar.data import default_corpus_documents

    root = tmp_path_factory.mktemp("train_data")
    path = root / "docs.jsonl"
    with open(path, "w") as f:
        for doc in default_corpus_documents(400):
            f.write(json.dumps({"text": doc}) + "\n")
    return {"source": str(path), "cache_dir": str(root / "cache")}


# (test and label, worst quantity, its relative error, bound): one row per check_close call.
_ERRORS: list[tuple[str, str, float, float]] = []


@pytest.fixture(scope="session")
def workers():
    """workers(n) -> a WorkerPool of n gloo ranks, started once and reused by every test."""
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = WorkerPool(world_size)
        return pool

    yield get
    for pool in pools.values():  # every pool leaves at once: the session's end waits for the slowest only
        pool.stop()
    for pool in pools.values():
        pool.close()


# The extended tier (`python -m pytest -m extended`; setup.cfg leaves it out of a plain run, so CI's):
# costly cases whose mechanism another case in CI already runs, kept for a change that touches them.
# Each names the case that still runs. One list, so the tier is seen and pruned in one place.
EXTENDED = {
    # compile under mp x dp: compile runs in CI under pp (test_compiled_stages_under_pp) and cp
    # (test_context_parallel_training_matches_single_process[cp2-compile-ac_full]); 4 ranks compiling
    # C++ kernels on 2 cores ran past the case's 300 s on a loaded machine
    "tests/train/test_trainer.py::test_training_matches_single_process[mp2-dp_shard2-compile-ac_selective]",
    # world 8 with FSDP's zero2 and full AC: world 8 runs in CI as [mp2-hybrid_shard-2x2], full AC in
    # [cp2-compile-ac_full] and the dry run's [world8-mp2-2x2-ac]
    "tests/train/test_trainer.py::test_training_matches_single_process[mp2-hybrid_shard_zero2-2x2-ac_full]",
    # the store on another node than the stalled one: [store-host] runs the same exclusion and heal
    "tests/launch/test_heal.py::test_a_node_whose_ranks_stall_is_excluded_and_the_job_heals[other-node]",
    # a node failing preflight alone: the exclusion and requeue run in CI for a stall ([store-host])
    "tests/launch/test_heal.py::test_a_node_that_fails_the_preflight_alone_is_excluded",
    # float8.fsdp_all_gather's step, dry against real: [world4-mp2-dp2] holds the dry run to real steps
    # in CI, and test_float8_gather.py's CI case runs the float8 all-gathers on gloo
    "tests/test_dryrun.py::test_the_dry_run_reports_what_a_real_gloo_run_holds_and_sends[world4-mp2-dp2-float8_gather]",
    # float8.fsdp_all_gather: CI runs [mp2-dp_shard2] (FSDP and mp both split the weights)
    "tests/parallel/test_float8_gather.py::test_a_run_gathering_in_float8_equals_the_run_without[dp_shard2]",
    "tests/parallel/test_float8_gather.py::test_without_the_amax_reduction_over_mp_the_runs_differ",
    "tests/parallel/test_float8_gather.py::test_its_checkpoint_holds_plain_values_and_resumes_without_float8",
    "tests/parallel/test_float8_gather.py::test_the_dry_run_shows_the_float8_linears_gathered_in_half_the_bytes",
    # a rank killed with no restart left: the death's verdict under torchrun's teardown runs in CI in
    # test_watchdog's test_a_rank_that_dies_is_named_live, its node and the policy (no restart left:
    # exclude) in test_incidents (test_a_nodes_fault_names_its_nodes, test_the_policy), and slurm.sh's
    # exclusion, requeue and resume with the undisturbed losses in the stall's [store-host]
    "tests/launch/test_heal.py::test_a_node_that_kills_a_rank_is_excluded_when_no_restart_is_left",
    # a slow node: the straggler's stop at a saved step with a verdict naming its node runs in CI in
    # test_stragglers (test_a_straggler_over_the_exclusion_threshold_stops_the_run_with_a_checkpoint_
    # naming_its_node), and slurm.sh's exclusion, requeue and resume (a straggler is excluded as a
    # stall: incidents.decide) in the stall's [store-host]
    "tests/launch/test_heal.py::test_a_node_that_runs_slow_is_excluded_without_losing_a_step",
    # a second round of the same kill and restart: [1] runs it in CI (bench/restarts.py repeats it many times)
    "tests/launch/test_standalone_restart.py::test_a_killed_rank_under_torchrun_standalone_restarts_and_finishes[2]",
    # the 405B rehearsal's last stage: its first stage ([0]) runs the same 512-rank dry run in CI
    "tests/launch/test_scripts.py::test_llama3_405b_example_dry_run_rehearses_a_stage_pair_of_512_ranks[511]",
    # the skipped dp collective at world 8: [skip_dp] at world 4, and [kill_save_world8] at world 8
    "tests/diagnostics/test_watchdog.py::test_planted_fault_is_reported_naming_rank_group_and_collective[skip_dp_world8]",
    # the stall in mp's all_reduce at mp 2 x dp 2: [sleep_mp_cp2] plants the same stall with the same
    # checks (and the rank's cp place); the dp dimension's verdicts run in CI as [skip_dp] and [shape]
    "tests/diagnostics/test_watchdog.py::test_planted_fault_is_reported_naming_rank_group_and_collective[sleep_mp]",
    # a kill while a checkpoint is written at world 4: [kill_save_world8] makes the same death with the
    # same checks, the last complete checkpoint kept included
    "tests/diagnostics/test_watchdog.py::test_a_rank_that_dies_is_named_live[kill_save]",
    # lm-eval's command line under torchrun at 2 ranks: [1] says the missing checkpoint through the same
    # entry point, and one line once under torchrun (rank 0's, no rank's traceback) runs in CI in
    # test_cli's test_an_error_every_rank_raises_is_one_screen at world 4 (the same hybridpar.reporting)
    "tests/evaluate/test_refusals.py::test_lm_evals_command_line_says_a_missing_checkpoint_as_hybridpar_eval_does[2]",
    # bit-exact resume over 2x2 hybrid sharding: [mp2-dp2] in CI, and resume at another layout over 2x2
    "tests/checkpoint/test_dcp.py::test_resume_is_bit_exact_in_new_processes[mp2-hybrid2x2]",
    # a stop whose save cannot finish: a signal's stop and its checkpoint run in CI (test_stop's others)
    "tests/train/test_stop.py::test_a_stop_that_cannot_finish_ends_in_time_with_the_previous_checkpoint_intact",
    # float8 training at the other layouts and recipes: the Trainer at mp x dp with sequence
    # parallelism in CI ([tensorwise, mp2 x dp2]), the amax reductions over mp and cp (rowwise too)
    # in tests/parallel/test_float8.py, float8 stages under pp in the dry run's test_dryrun float8 case
    "tests/train/test_float8_training.py::test_float8_training_at_every_layout_equals_world_1",
    # the shape (the tiny preset at seq 512, 20 steps): 10 runs, ~15 min on 2 cores
    "tests/train/test_float8_training.py::test_float8_training_at_the_issues_shape",
}


def pytest_collection_modifyitems(config, items):
    """The fast tier (`python -m pytest -m fast`, the contributor's loop) is every test not marked
    slow or slurm: a test that takes more than a few seconds says so with @pytest.mark.slow.
    The extended tier is EXTENDED's cases."""
    # A case renamed away would leave the tier silently: where its whole file was collected, it is found.
    whole = not config.option.keyword and not any("::" in str(a) for a in config.invocation_params.args)
    files, ids = {item.nodeid.split("::")[0] for item in items}, {item.nodeid for item in items}
    lost = sorted(n for n in EXTENDED if n.split("::")[0] in files and n not in ids)
    if whole and lost:
        raise pytest.UsageError(f"tests/conftest.py EXTENDED names cases that do not exist: {lost}")
    for item in items:
        if item.nodeid in EXTENDED:
            item.add_marker(pytest.mark.extended)
        elif item.get_closest_marker("slow") is None and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.fast)


def compare(who: str, label: str, per_rank, bound: float) -> None:
    """per_rank: {name: error} or one such dict per rank (the worst rank counts); every error <= bound."""
    ranks = [per_rank] if isinstance(per_rank, dict) else list(per_rank)
    # A comparison of nothing would pass whatever the code did: a rank that compared no quantity fails.
    assert ranks and all(ranks), f"{label}: nothing was compared ({len(ranks)} ranks: {[len(r) for r in ranks]})"
    worst: dict[str, float] = {}
    for errors in ranks:
        for name, err in errors.items():
            err, before = float(err), worst.get(name)
            # NaN wins: max() would let a rank's NaN hide behind another rank's finite error.
            worst[name] = err if before is None or math.isnan(err) or err > before else before
    name = max(worst, key=worst.get)
    _ERRORS.append((f"{who} {label}", f"{name} (worst of {len(worst)})", worst[name], bound))
    bad = {n: e for n, e in worst.items() if not e <= bound}
    assert not bad, f"{label}: relative error above {bound:g}: " + ", ".join(f"{n}={e:.3g}" for n, e in bad.items())


@pytest.fixture
def check_close(request):
    """check_close(label, per_rank, bound): every relative error <= bound; all are printed at the end."""
    return lambda label, per_rank, bound: compare(request.node.name, label, per_rank, bound)


def pytest_terminal_summary(terminalreporter):
    if not _ERRORS:
        return
    terminalreporter.section("relative errors against single-process math (worst quantity per check)")
    width = max(len(check) for check, _, _, _ in _ERRORS)
    qwidth = max(len(quantity) for _, quantity, _, _ in _ERRORS)
    for check, quantity, err, bound in _ERRORS:
        terminalreporter.write_line(f"{check:<{width}}  {quantity:<{qwidth}}  {err:.2e}  (bound {bound:.0e})")
