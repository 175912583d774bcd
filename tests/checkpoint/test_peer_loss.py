"""A checkpoint collective that lost its peer (a rank died mid-save or mid-load) ends the rank's part
without another collective: the agreement the error paths make otherwise (is the disk full? which
rank found damage?) cannot complete, and on the survivors it met the peers' next save collective,
which the watchdog read as collectives out of step: "the program's own fault (mismatch)" instead of
the dead rank's node (tests/launch/test_heal.py's kill, seen once under heavy load)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

LOST = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.3]:29500"


def _issued() -> int:
    import torch.distributed as dist

    from hybridpar.compat.torch import sequence_number

    return sequence_number(dist.group.WORLD)


def _case_save_loses_a_peer(folder: str) -> tuple[str, int]:
    """Both ranks' DCP save raise a peer loss (a third rank vanished): what the save raised, and the
    collectives this rank issued after."""
    import torch.distributed.checkpoint as dcp

    from hybridpar.checkpoint.dcp import Checkpointer
    from tests.distributed import parallel_dims

    model = torch.nn.Linear(4, 4)
    checkpointer = Checkpointer(Path(folder), parallel_dims(mp=1), keep=2)
    at_loss = []

    def lost(*args, **kwargs):
        at_loss.append(_issued())
        raise RuntimeError(LOST)

    save, dcp.save = dcp.save, lost
    try:
        checkpointer.save(1, model, torch.optim.AdamW(model.parameters()), {}, {})
        raised = "no error"
    except Exception as err:  # noqa: BLE001 - returned to the test
        raised = f"{type(err).__name__}: {err}"
    finally:
        dcp.save = save
    return raised, _issued() - at_loss[0]


def _case_load_agreement_loses_a_peer() -> tuple[str, int]:
    from hybridpar.checkpoint import verify

    before = _issued()

    def lost(*args, **kwargs):
        raise RuntimeError(LOST)

    agree, verify.raise_if_any_failed = verify.raise_if_any_failed, lost
    try:
        verify.share_load_failure(None, "load step-00000001")
        raised = "no error"
    except Exception as err:  # noqa: BLE001 - returned to the test
        raised = f"{type(err).__name__}: {err}"
    finally:
        verify.raise_if_any_failed = agree
    return raised, _issued() - before


@pytest.mark.parametrize("case", ["save", "load"])
def test_a_rank_that_lost_a_peer_issues_no_further_collective(workers, tmp_path, case):
    results = (workers(2).run(_case_save_loses_a_peer, str(tmp_path)) if case == "save" else
               workers(2).run(_case_load_agreement_loses_a_peer))
    print(f"\n{case}: {results}")
    for raised, issued_after in results:
        assert raised == f"RuntimeError: {LOST}" and issued_after == 0, results


def _rank_dies_in_save(rank: int, port: int, out: str) -> None:
    """World 3: step 2's save; rank 2 dies between DCP's gather_object's size all-gather and its gather,
    so rank 0 (the coordinator) fails in the gather while rank 1's send completes and it goes on to
    the broadcast of the result. Each survivor writes its trace (as its watchdog would send it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import datetime

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from hybridpar.checkpoint.dcp import Checkpointer
    from hybridpar.diagnostics.traces import dump_flight_recorder, trace_from_dump
    from tests.distributed import parallel_dims

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=20))
    model = torch.nn.Linear(8, 8)
    checkpointer = Checkpointer(Path(out) / "checkpoints", parallel_dims(mp=1), keep=3)
    checkpointer.save(1, model, torch.optim.AdamW(model.parameters()), {}, {})
    gather = c10d.gather
    c10d.gather = lambda *a, **k: os._exit(9) if rank == 2 else gather(*a, **k)
    try:
        checkpointer.save(2, model, torch.optim.AdamW(model.parameters()), {}, {})
        note = "no error"
    except Exception as err:  # noqa: BLE001 - this rank's note in its trace
        note = f"raised {type(err).__name__}: {err}"
    info = {"rank": rank, "note": note, "groups": {"0": {"dim": "world", "ranks": [0, 1, 2]}}}
    trace = dataclasses.asdict(trace_from_dump(dump_flight_recorder(), info))
    Path(out, f"trace{rank}.json").write_text(json.dumps(trace))
    os._exit(0)  # the dead rank's group cannot be torn down


@pytest.mark.slow
def test_a_rank_dead_in_a_save_is_its_nodes_fault_in_the_verdict(tmp_path):
    """The watchdog's analysis of the survivors' traces: the dead rank, its node to exclude (before, the
    coordinator's agreement all-gather met rank 1's broadcast: "the program's own fault (mismatch)")."""
    import multiprocessing

    from hybridpar.diagnostics.flight import analyse
    from hybridpar.diagnostics.node_fault import node_fault
    from hybridpar.diagnostics.traces import RankTrace
    from hybridpar.mesh.layout import free_port

    port, spawn = free_port(), multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_rank_dies_in_save, args=(r, port, str(tmp_path))) for r in range(3)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0, 0, 9], [p.exitcode for p in ranks]
    traces = {r: RankTrace.from_json(json.loads((tmp_path / f"trace{r}.json").read_text())) for r in (0, 1)}
    assert all("Connection closed by peer" in t.note or "reset by peer" in t.note for t in traces.values())
    verdict = analyse(traces, dead=[2])
    fault = node_fault(verdict.findings, [2], {0: "n1", 1: "n1", 2: "n2"}, 3)
    print(f"\nfindings {[(f.kind, f.ranks) for f in verdict.findings]}; node fault {fault}")
    assert [f.kind for f in verdict.findings if f.kind != "failed"] == ["dead"], verdict.findings
    assert fault == {"kind": "death", "nodes": ["n2"], "ranks": [2]}, fault
