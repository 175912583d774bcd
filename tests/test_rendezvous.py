"""hybridpar.mesh.rendezvous: every start of a job gets keys of its own in a store that torchrun keeps
across restarts (pytorch/pytorch#135712), whatever earlier starts left there."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

from tests.distributed import child_pythonpath, free_port


class _Lines(logging.Handler):
    """The module's warnings, whatever handlers the session's other tests left on "hybridpar"."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def said():
    handler = _Lines()
    logger = logging.getLogger("hybridpar.mesh.rendezvous")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def _store_server():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)


def _start(port: int, world: int, ranks=None, timeout: float = 20.0) -> dict:
    """One start of a job: `ranks` (all by default) each agree through their own client; rank -> name or error."""
    import torch.distributed as dist

    from hybridpar.mesh.rendezvous import agree_on_start

    out: dict = {}

    def rank_main(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30), wait_for_workers=False)
        try:
            out[rank] = agree_on_start(store, rank, world, timeout)
        except RuntimeError as err:
            out[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (range(world) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_every_start_agrees_on_a_new_name_whatever_earlier_starts_left_in_the_store(monkeypatch, said):
    import hybridpar.mesh.rendezvous as rendezvous

    server, world = _store_server(), 4
    first = _start(server.port, world)
    assert len(set(first.values())) == 1, first
    # A start that failed half-way: rank 3 never came (killed while importing torch); rank 0 names it.
    monkeypatch.setattr(rendezvous, "REPORT_EVERY", 0.5)
    failed = _start(server.port, world, ranks=[0, 1, 2], timeout=2.0)
    assert "did not start within 2 s" in str(failed[0]) and "rank(s) [3]" in str(failed[0]), failed
    assert any("waiting" in line and "rank(s) [3]" in line for line in said), said
    # Ranks 1 and 2 were answered (the process group then holds them until its own timeout).
    assert failed[1] == failed[2] and failed[1] not in first.values(), failed
    # The next start: stale tokens, answers and acknowledgements of both earlier starts are in the store.
    third = _start(server.port, world)
    names = set(third.values())
    assert len(names) == 1 and names.isdisjoint(first.values()), (first, third)
    print(f"\nthree starts on one store: {first[0][:8]}, (failed: rank 3 missing), {third[0][:8]}")


def test_a_rank_waiting_for_rank_0_says_so(monkeypatch, said):
    import hybridpar.mesh.rendezvous as rendezvous

    server = _store_server()
    monkeypatch.setattr(rendezvous, "REPORT_EVERY", 0.3)
    monkeypatch.setenv("LOCAL_RANK", "0")
    out = _start(server.port, 2, ranks=[1], timeout=1.0)
    assert "rank 0 did not answer rank 1 within 1 s" in str(out[1])
    assert any("rank 1 has waited" in line for line in said), said


_RANK = """
import sys, torch, torch.distributed as dist
from hybridpar.mesh.device import init_parallel
p = init_parallel(mp=1, timeout=60)
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", int(t.item()), "world", p.world_size, flush=True)
"""


@pytest.mark.slow
def test_process_groups_of_later_starts_on_torchruns_kept_store_connect(tmp_path):
    """The store plays torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE, the default since torch
    2.5): two starts of two ranks on it, as torchrun's restarts would, each one's gloo group and
    all-reduce working. Without a name per start the second start reads the first one's addresses."""
    server, world = _store_server(), 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONPATH=child_pythonpath(), OMP_NUM_THREADS="1", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(server.port), TORCHELASTIC_USE_AGENT_STORE="True")
    for start in range(2):
        procs = [subprocess.Popen([sys.executable, "-c", _RANK], env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                                                   "TORCHELASTIC_RESTART_COUNT": str(start)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        outs = []
        for proc in procs:
            try:
                outs.append(proc.communicate(timeout=90)[0])
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                pytest.fail(f"start {start} hung in set-up")
        assert [p.returncode for p in procs] == [0] * world, f"start {start}:\n" + "\n".join(outs)[-3000:]
        assert all(f"sum 3 world {world}" in out for out in outs), outs
    assert free_port()  # (the server is still up: every start used the one store)
