"""A pool of spawned gloo workers that runs many test cases on one process group.

Starting torch in 4 or 8 processes costs seconds on 2 cores, so a pool is started once per world
size and every case is a module-level function sent to all ranks:

    results = pool.run(case_fn, arg, ...)   # one result per rank, in rank order

A case that raises on any rank fails with every rank's traceback. A case that hangs (a collective
one rank never joins) fails after `timeout` seconds and the pool is restarted for the next case.
After a rank's failure the others get `grace` seconds to report theirs (ERROR_GRACE): a case that
kills a rank on purpose, whose survivors hang in a collective, passes less.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any, Callable

DEFAULT_CASE_TIMEOUT = 300.0
ERROR_GRACE = 10.0


class WorkerError(AssertionError):
    pass


def child_pythonpath() -> str:
    """PYTHONPATH for a process a test starts: this checkout first, then the PYTHONPATH the tests
    were given (where torch or a carried wheel may come from: a GPU machine's /tmp/site)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))


def free_port() -> int:
    # hybridpar.mesh.device's, imported late: a spawned worker sets OMP_NUM_THREADS before torch loads.
    from hybridpar.mesh.layout import free_port as port

    return port()


def _worker_main(rank: int, world_size: int, port: int, conn) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import datetime

    import torch
    import torch.distributed as dist

    from hybridpar.progress import log_to_terminal

    log_to_terminal()  # as the command line does: the library's lines on stdout and stderr
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        before = _groups()
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("error", traceback.format_exc()))
        _destroy_groups_made_since(before)
    dist.destroy_process_group()
    # Nothing is left to run: skip the interpreter's teardown of torch (seconds per worker on 2 cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _groups() -> set:
    import torch.distributed as dist

    return set(dist.distributed_c10d._world.pg_map)


# Groups the cached meshes of parallel_dims() hold: kept for the next case that asks for the layout.
_KEPT: set = set()


def _destroy_groups_made_since(before: set) -> None:
    """Destroy the process groups a case made (its trainer's mesh, FSDP's, a checkpoint's), once every
    rank has finished it. Each gloo group keeps three threads polling: left alive, the hundreds of cases
    a worker runs leave it thousands of them, and the suite slows to a crawl as it goes."""
    import torch.distributed as dist

    made = _groups() - before - _KEPT
    if not made:
        return
    dist.barrier()  # a peer may still be in the case's last collective on one of them
    for group in made:
        dist.destroy_process_group(group)
    # A group's threads end when the group is freed, and a case's objects (meshes, modules, a trainer)
    # hold theirs in reference cycles that only the collector frees.
    gc.collect()


class WorkerPool:
    def __init__(self, world_size: int, start_timeout: float = 120.0) -> None:
        self.world_size, self._stopped = world_size, False
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect(start_timeout, "start-up")

    def _collect(self, timeout: float, what: str, grace: float = ERROR_GRACE) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                if self.conns[rank].poll(0.01):
                    try:
                        status, value = self.conns[rank].recv()
                    except (EOFError, OSError):  # the worker's end closed: it died
                        self.procs[rank].join(timeout=5)
                        status, value = "error", f"worker died (exit code {self.procs[rank].exitcode})"
                    (errors if status == "error" else results)[rank] = value
                    pending.discard(rank)
                elif not self.procs[rank].is_alive():
                    errors[rank] = f"worker died (exit code {self.procs[rank].exitcode})"
                    pending.discard(rank)
            if errors:
                # The other ranks are probably blocked in a collective the failed rank never joins.
                deadline = min(deadline, time.monotonic() + grace)
        if pending:
            self.close(force=True)  # hung ranks never read another message
        if pending or errors:
            detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            hung = f"; ranks {sorted(pending)} did not finish within the time limit" if pending else ""
            raise WorkerError(f"{what} failed on ranks {sorted(errors)}{hung}{detail}")
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_CASE_TIMEOUT,
            grace: float = ERROR_GRACE, **kwargs: Any) -> list[Any]:
        if not self.alive:
            raise WorkerError("the worker pool was closed by an earlier failure")
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, f"{fn.__name__}{args}", grace)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def stop(self) -> None:
        """Ask the workers to leave the process group and exit, without waiting (close() waits)."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        self._stopped = True

    def close(self, force: bool = False) -> None:
        """Stop the workers: politely (they leave the process group), or at once with force."""
        if not force and not self._stopped:
            self.stop()
        deadline = time.monotonic() + (0 if force else 10)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []


# --- helpers for case functions (they run inside the workers) ----------------------------------


def parallel_dims(mp: int = 1, dp_shard: int = -1, dp_replicate: int = 1, cp: int = 1, pp: int = 1):
    """One ParallelDims per layout per worker: building a mesh creates process groups, so reuse it."""
    import torch.distributed as dist

    from hybridpar.mesh.layout import resolve_sizes

    # Cache on the resolved sizes, so (mp=2) and (mp=2, dp_shard=2) at world 4 share one mesh.
    return _parallel_dims(*resolve_sizes(dist.get_world_size(), mp, dp_shard, dp_replicate, cp, pp))


@functools.lru_cache(maxsize=None)
def _parallel_dims(pp: int, dp_replicate: int, dp_shard: int, cp: int, mp: int):
    import hybridpar

    before = _groups()
    dims = hybridpar.init_parallel(mp=mp, dp_shard=dp_shard, dp_replicate=dp_replicate, cp=cp, pp=pp)
    _KEPT.update(_groups() - before)
    return dims


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are zero)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff
