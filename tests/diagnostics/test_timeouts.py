"""Tracing defaults respect the user's settings; after step 1 a stuck collective fails within the train timeout."""

from hybridpar.diagnostics.timeouts import ENV_DEFAULTS, apply_env_defaults
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
