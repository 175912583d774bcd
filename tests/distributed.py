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

import gc
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any, Callable

DEFAULT_CASE_TIMEOUT = 300.0
ERROR_GRACE = 10.0
WORKER_TIMEOUT = 120.0  # the workers' collective timeout (a case's trainer sets its own)


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
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=WORKER_TIMEOUT))
    _share_meshes()
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
        _after_case(before)
    dist.destroy_process_group()
    # Nothing is left to run: skip the interpreter's teardown of torch (seconds per worker on 2 cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _groups() -> set:
    import torch.distributed as dist

    return set(dist.distributed_c10d._world.pg_map)


# One DeviceMesh per layout per worker, whichever case asks: every case builds meshes (a trainer, a
# checkpoint load), and each mesh its own gloo groups, three polling threads each. A world-4 worker
# held 1,020 such threads by test_trainer (load average 1,000; stop 46's CI ran out of its 90 minutes).
# Destroying a case's groups is not enough: DTensor's sharding caches hold meshes that compare equal by
# layout, so a later case's tensors would name the earlier mesh's destroyed groups.
_MESHES: dict = {}


def _share_meshes() -> None:
    """hybridpar.mesh.device builds its meshes through these two names: give each layout's one back."""
    import hybridpar.mesh.device as device

    make, split = device.init_device_mesh, device.unflatten_mesh

    def init_device_mesh(device_type, mesh_shape, **kwargs):
        key = ("init", device_type, tuple(mesh_shape), repr(sorted(kwargs.items())))
        if key not in _MESHES:
            _MESHES[key] = make(device_type, mesh_shape, **kwargs)
        return _MESHES[key]

    def unflatten_mesh(mesh, sizes, names, dim=0):
        key = ("unflatten", id(mesh), dim, tuple(sizes), tuple(names))  # mesh: a shared one, alive for good
        if key not in _MESHES:
            _MESHES[key] = split(mesh, sizes, names, dim)
        return _MESHES[key]

    device.init_device_mesh, device.unflatten_mesh = init_device_mesh, unflatten_mesh


def _shared_group_names() -> set:
    names = set()
    for mesh in _MESHES.values():
        root = mesh._get_root_mesh()
        names.update(root._pg_registry)
        names.update(mesh._dim_group_names)
        for flat in root._flatten_mapping.values():
            names.update(flat._dim_group_names)
    return names


def _after_case(before: set) -> None:
    """Destroy the other process groups a case made (a checkpointer's, fairscale's), once every rank has
    finished it, and give the shared meshes' groups back their first timeout (a trainer sets its own)."""
    import datetime

    import torch.distributed as dist

    from hybridpar.compat.torch import set_pg_timeout

    shared = _shared_group_names()
    made = [g for g in _groups() - before if g.group_name not in shared]
    if made:
        dist.barrier()  # a peer may still be in the case's last collective on one of them
        for group in made:
            dist.destroy_process_group(group)
    for group in _groups():
        if group.group_name in shared:
            set_pg_timeout(datetime.timedelta(seconds=WORKER_TIMEOUT), group)
    if made:
        # A group's threads end when it is freed, and a case's objects hold theirs in reference cycles.
        # Only then: a full collection costs 0.1-0.2 s of CPU a rank, after every case of the suite.
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


def parallel_dims(mp: int = 1, dp_shard: int = -1, dp_replicate: int = 1, cp: int = 1, pp: int = 1, ep: int = 1):
    """A ParallelDims of the layout, inside a case (its groups end with the case: cheap to build, 20 ms at
    world 8 once the first mesh is made)."""
    import hybridpar

    return hybridpar.init_parallel(mp=mp, dp_shard=dp_shard, dp_replicate=dp_replicate, cp=cp, pp=pp, ep=ep)


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are zero)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff
