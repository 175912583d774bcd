"""The session's worker pool stays as light as it started: a case's process groups end with it, and the
meshes cases build are one per layout."""

import os


def _case_groups(mp: int):
    import torch.distributed as dist

    import hybridpar

    hybridpar.init_parallel(mp=mp)  # as a trainer builds its mesh
    hybridpar.init_parallel(mp=mp, cp=2)  # and one with context parallelism (an unflattened FSDP mesh)
    dist.new_group()  # as a checkpointer makes its own (async saves)
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_the_cases_leave_no_process_group_threads_behind(workers):
    """Each gloo group polls in three threads of its own and the pool runs hundreds of cases: left
    alive, they reached 1,020 threads in a world-4 worker and a load average of 1,000."""
    pool = workers(4)
    rounds = []
    for _ in range(3):
        during = [max(pool.run(_case_groups, mp)) for mp in (1, 2)]
        rounds.append((during, max(pool.run(_threads))))
    print(f"\nthreads per worker, (in the cases, after them) per round: {rounds}")
    # The case's own group (new_group) ended with it: a case held more threads than the pool after it.
    assert all(min(during) > after for during, after in rounds[1:]), f"a case's group outlived it: {rounds}"
    assert rounds[1] == rounds[2], f"each round of the same cases left more threads: {rounds}"
