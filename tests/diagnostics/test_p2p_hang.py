"""Hangs in a pipeline's sends and receives: what the P2P log records on gloo, how the analysis
matches a rank's receive with its peer's send, and a live job whose stage 1 stops inside its step."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpar.diagnostics.flight import analyse, format_report
from hybridpar.diagnostics.traces import P2P, RankTrace, trace_from_dump
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
TRAIN_TIMEOUT = 4.0
REPORT_WITHIN = TRAIN_TIMEOUT + 15.0  # the bound: train timeout + 15 s
PP = {"group": "7", "dim": "pp", "ranks": [0, 1]}


def _op(op: str, peer: int, n: int, **group) -> P2P:
    return P2P(op, peer, n=n, sizes=[[2, 8]], **{**PP, **group})


# --- the analysis on hand-made traces ----------------------------------------------------------

def test_the_peer_that_never_sent_is_named_with_its_stage_and_line():
    traces = {
        0: RankTrace(0, stack=["job.py:34 in exchange"], p2p=[_op("recv", 1, 5)],
                     p2p_issued={"7 send 1": 4, "7 recv 1": 5}, coords="pp 0, mp 0, dp 0"),
        1: RankTrace(1, stack=["job.py:48 in step"], p2p_issued={"7 recv 0": 4, "7 send 0": 4},
                     coords="pp 1, mp 0, dp 0"),
    }
    verdict = analyse(traces)
    (finding,) = verdict.findings
    assert (finding.kind, finding.ranks, finding.dim, finding.op, finding.seq) == ("not_arrived", [1], "pp", "recv", 5)
    report = format_report(verdict, "headline")
    assert ("CAUSE  rank 1 (stage 1) has not sent to rank 0 (stage 0), which waits in recv #5 from rank 1 (stage 1) "
            "on the pp group [0, 1]") in report
    assert "job.py:48 in step" in report.splitlines()[1]
    assert "rank 0 (stage 0) waits in recv #5 from rank 1 (stage 1) on the pp group [0, 1] (rank 1 has issued 4 " \
           "matching sends)" in report
    assert "pp recv<-1 #5" in report
    table = report.split("WHERE EACH RANK IS\n")[1].splitlines()
    assert table[0].startswith("  rank    0  pp 0, mp 0, dp 0  ") and "pp recv<-1 #5" in table[0], table
    assert table[1].startswith("  rank    1  pp 1, mp 0, dp 0  ") and "job.py:48 in step" in table[1], table


def test_a_peer_that_sent_is_not_blamed_and_a_group_of_no_pipeline_shows_no_stage():
    # Rank 1 issued its 5th send (both sides posted: the transport's problem, not a rank's).
    traces = {0: RankTrace(0, p2p=[_op("recv", 1, 5)]), 1: RankTrace(1, p2p_issued={"7 send 0": 5})}
    assert analyse(traces).findings == []
    # On a group of another dimension the same wait names ranks only.
    traces = {0: RankTrace(0, p2p=[_op("send", 1, 2, dim="world")]), 1: RankTrace(1, p2p_issued={"7 recv 0": 1})}
    (finding,) = analyse(traces).findings
    assert finding.text.startswith("rank 1 has not received from rank 0, which waits in send #2 to rank 1 on the "
                                   "world group [0, 1]")


def test_ranks_receiving_from_each_other_first_are_a_deadlock():
    traces = {0: RankTrace(0, p2p=[_op("recv", 1, 1)], p2p_issued={"7 recv 1": 1}),
              1: RankTrace(1, p2p=[_op("recv", 0, 1)], p2p_issued={"7 recv 0": 1})}
    (finding,) = analyse(traces).findings
    assert (finding.kind, finding.ranks) == ("order", [0, 1])
    assert "rank 0 (stage 0) waits in recv #1 from rank 1 (stage 1)" in finding.text
    assert "rank 1 (stage 1) waits in recv #1 from rank 0 (stage 0)" in finding.text


def test_a_rank_in_a_receive_is_not_blamed_for_the_collective_its_peer_waits_in():
    """Rank 1 waits in a receive from rank 0, which waits in a world all-reduce rank 1 never reached:
    neither is 'not in any collective'; the circle is the cause."""
    from hybridpar.diagnostics.traces import Collective, GroupTrace

    world = GroupTrace("0", "world", [0, 1], 3, 2, [Collective(3, "all_reduce", [[1]], 9)])
    traces = {0: RankTrace(0, groups={"0": world}, p2p_issued={"7 send 1": 1}),
              1: RankTrace(1, p2p=[_op("recv", 0, 2)], p2p_issued={"7 recv 0": 2})}
    (finding,) = analyse(traces).findings
    assert (finding.kind, finding.ranks) == ("order", [0, 1]), finding
    assert "rank 0 waits in all_reduce #3 on the world group" in finding.text


def test_a_dead_peer_is_named_with_the_receive_waiting_for_it():
    traces = {0: RankTrace(0, p2p=[_op("recv", 1, 3)], p2p_issued={"7 recv 1": 3})}
    verdict = analyse(traces, dead=[1])
    assert verdict.findings[0].text == ("rank 1 (stage 1) is gone: rank 0 (stage 0) waits in recv #3 from rank 1 "
                                        "(stage 1) on the pp group [0, 1]")


def test_gloos_completed_count_is_read_among_collectives_on_a_group_with_sends():
    """gloo (torch 2.13) numbers a group's status by every op, sends and receives included (op_id),
    its entries by collectives only: after two sends, all-reduce #3 (op 5) waits while op 4 is done."""
    def entry(seq, op_id):
        return {"pg_id": 1, "process_group": ("1", "mesh_pp"), "collective_seq_id": seq, "op_id": op_id,
                "record_id": seq - 1, "profiling_name": "gloo:all_reduce", "input_sizes": [[3]], "is_p2p": False}

    dump = {"entries": [entry(1, 1), entry(2, 4), entry(3, 5)],
            "pg_status": {"1": {"last_enqueued_collective": 5, "last_completed_collective": 4}}}
    (group,) = trace_from_dump(dump, {"rank": 0}).groups.values()
    assert (group.dim, group.issued, group.completed, group.pending.seq) == ("pp", 3, 2, 3)


# --- the P2P log on real gloo ranks --------------------------------------------------------------

def _p2p_log_case():
    """Rank 0 sends, rank 1 receives: through batch_isend_irecv, as pipelining's homogeneous batches
    (isend with group_dst), blocking send/recv; then an irecv rank 1 leaves open until rank 0 sends."""
    import torch
    import torch.distributed as dist

    from hybridpar.diagnostics import p2p, wrap
    from hybridpar.diagnostics.collectives import CollectiveCounter
    from hybridpar.diagnostics.traces import dump_flight_recorder

    rank = dist.get_rank()
    pp = dist.new_group([0, 1], group_desc="mesh_pp")
    x = torch.ones(2, 8)
    with p2p.P2PLog() as log, CollectiveCounter() as counter:
        op = dist.isend if rank == 0 else dist.irecv
        for work in dist.batch_isend_irecv([dist.P2POp(op, x, 1 - rank, pp)]):
            work.wait()
        kw = {"group_dst": 1} if rank == 0 else {"group_src": 0}
        op(x, group=pp, **kw).wait()
        (dist.send if rank == 0 else dist.recv)(x, 1 - rank, group=pp)
        dist.barrier(group=pp)
        open_ = None
        if rank == 1:
            work = dist.irecv(x, 0, group=pp)
            open_ = log.snapshot()
        dist.barrier(group=pp)
        if rank == 0:
            dist.send(x, 1, group=pp)
        else:
            work.wait()
        done = log.snapshot()
        counted = [r.kind for r in counter.records]
    dist.all_reduce(torch.ones(1), group=pp)
    recorded = [(e["profiling_name"], e["collective_seq_id"], e["op_id"], e["is_p2p"])
                for e in dump_flight_recorder()["entries"] if e["process_group"][0] == pp.group_name]
    return {"open": open_, "done": done, "counted": counted, "listeners": len(wrap.listeners()),
            "name": pp.group_name, "recorded": recorded}


def test_the_log_counts_every_send_and_receive_and_keeps_the_open_ones(workers):
    sender, receiver = workers(2).run(_p2p_log_case)
    name = sender["name"]
    assert sender["done"] == {"issued": {f"{name} send 1": 4}, "pending": []}
    assert receiver["done"] == {"issued": {f"{name} recv 0": 4}, "pending": []}
    (pending,) = receiver["open"]["pending"]
    assert pending == {"op": "recv", "peer": 0, "group": name, "dim": "pp", "ranks": [0, 1], "n": 4,
                       "sizes": [[2, 8]]}
    assert sender["counted"] == receiver["counted"] == ["barrier", "barrier"]  # P2P ops are no collectives
    assert sender["listeners"] == 0  # torch.distributed is torch's own again
    # What this log stands in for: gloo's flight recorder has no entry for the 4 sends and 4
    # receives, and numbers its entries among collectives but its ops (op_id) among all: 3 sends,
    # barrier, barrier, send, all_reduce on one side; 3 receives, barrier, irecv, barrier on the other.
    assert sender["recorded"] == [("gloo:barrier", 1, 4, False), ("gloo:barrier", 2, 5, False),
                                  ("gloo:all_reduce", 3, 7, False)], sender["recorded"]
    assert [op_id for _, _, op_id, _ in receiver["recorded"]] == [4, 6, 7], receiver["recorded"]


def _pipelining_case():
    """torch.distributed.pipelining's 1F1B and Interleaved1F1B at pp 2, without a listener and under
    the P2P log: the losses, and the log's counts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from hybridpar.diagnostics.p2p import P2PLog

    rank = dist.get_rank()
    pp = dist.new_group([0, 1], group_desc="mesh_pp")

    def step(interleaved: bool) -> list[float]:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 8) for _ in range(4)]
        x, target, losses = torch.randn(8, 8), torch.randn(8, 8), []
        loss = lambda y, t: ((y - t) ** 2).mean()  # noqa: E731
        if interleaved:  # stages 0 and 2 on rank 0, 1 and 3 on rank 1
            stages = [PipelineStage(layers[s], s, 4, torch.device("cpu"), group=pp) for s in (rank, rank + 2)]
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=loss, scale_grads=False)
        else:
            stage = PipelineStage(torch.nn.Sequential(*layers[2 * rank:2 * rank + 2]), rank, 2, torch.device("cpu"),
                                  group=pp)
            schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss, scale_grads=False)
        schedule.step(x) if rank == 0 else schedule.step(target=target, losses=losses)
        return [float(x) for x in losses]

    plain = [step(False), step(True)]
    with P2PLog() as log:
        logged = [step(False), step(True)]
    return {"same": plain == logged, "losses": len(logged[0]) + len(logged[1]), "log": log.snapshot()}


@pytest.mark.slow
def test_pipelining_runs_alike_under_the_log_and_every_send_is_counted_by_its_receiver(workers):
    first, last = workers(2).run(_pipelining_case)
    assert first["same"] and last["same"] and last["losses"] == 8
    issued = {rank: {key.split(" ", 1)[1]: n for key, n in r["log"]["issued"].items()} for rank, r in enumerate((first, last))}
    assert issued[0]["send 1"] == issued[1]["recv 0"] > 8 and issued[1]["send 0"] == issued[0]["recv 1"] > 8
    assert first["log"]["pending"] == last["log"]["pending"] == []


def test_the_log_listens_while_the_watchdog_watches_and_counts_on_across_a_pause(tmp_path, monkeypatch):
    import torch.distributed as dist

    from hybridpar.diagnostics import wrap
    from tests.diagnostics.test_watchdog import _watchdog

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", dist.HashStore)
    wd = _watchdog(tmp_path, world=1, timeout=600.0, interval=30.0)
    log = wd.beat.p2p
    wd.start()
    assert wrap.listeners() == (log,)
    wd.pause()
    assert wrap.listeners() == ()
    log.issued["7 send 1"] = 3  # counted before the pause: the same log goes on
    wd.start()
    assert wrap.listeners() == (log,) and wd.beat.p2p.issued == {"7 send 1": 3}
    wd.close()
    assert wrap.listeners() == ()


# --- a live job: stage 1 stops inside its step ---------------------------------------------------

def _run_job(run_dir: Path, *mode: str) -> tuple[dict, str]:
    """Run p2p_job.py; its hang_report.json and the report's text, checked to come within the bound."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "diagnostics" / "p2p_job.py"), str(run_dir), str(TRAIN_TIMEOUT), *mode]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    stalled = re.search(r"STALL on rank 1 at ([\d.]+)", result.stderr)
    assert stalled, f"the stall never came:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    report_path = run_dir / "hang_report.json"
    assert result.returncode != 0 and report_path.exists(), result.stderr[-4000:]
    delay = report_path.stat().st_mtime - float(stalled.group(1))
    text = result.stderr[result.stderr.index("hybridpar watchdog"):]
    print(f"\nreport {delay:.1f} s after the stall (bound {REPORT_WITHIN:g} s)\n" + "\n".join(text.splitlines()[:8]))
    assert delay <= REPORT_WITHIN
    return json.loads(report_path.read_text()), text


@pytest.mark.slow
def test_a_stage_stopped_inside_its_step_is_named_with_the_receive_its_peer_waits_in(tmp_path):
    report, text = _run_job(tmp_path / "run")
    first = report["findings"][0]
    # Two micro-batches a step: the first gradient of step 3 is rank 0's 5th receive from rank 1.
    assert (first["kind"], first["ranks"], first["dim"], first["op"], first["seq"]) == ("not_arrived", [1], "pp", "recv", 5)
    assert text.splitlines()[1].startswith(
        "CAUSE  rank 1 (stage 1) has not sent to rank 0 (stage 0), which waits in recv #5 from rank 1 (stage 1) on "
        "the pp group [0, 1]; rank 1 (stage 1) is in no collective and no send or receive: "
        "tests/diagnostics/p2p_job.py")
    assert report["ranks"]["0"]["waiting_in"] == ["pp recv<-1 #5"] and report["ranks"]["1"]["waiting_in"] == []
    assert [w["peer_issued"] for w in report["p2p_waits"]] == [4]

    # The same verdict offline, from the dumps both ranks left.
    from hybridpar.cli import main

    offline = tmp_path / "offline.json"
    assert main(["hang-report", str(tmp_path / "run" / "flight_recorder"), "--json", str(offline)]) == 0
    again = json.loads(offline.read_text())["findings"][0]
    assert {k: again[k] for k in ("kind", "ranks", "op", "seq", "text")} == \
        {k: first[k] for k in ("kind", "ranks", "op", "seq", "text")}


def test_the_heartbeats_name_for_a_group_wins_over_its_description():
    """A pipeline group the mesh shares with another dimension (pp spanning the world is the default
    group) is named as the heartbeat names the mesh's groups, in the trace of every rank."""
    info = {"rank": 0, "groups": {"0": {"dim": "pp", "ranks": [0, 1]}},
            "p2p": {"issued": {"0 recv 1": 1}, "pending": [{**PP, "group": "0", "dim": "world", "op": "recv",
                                                            "peer": 1, "n": 1, "sizes": [[2]]}]}}
    trace = trace_from_dump({"entries": []}, info)
    assert [(op.dim, op.who(1)) for op in trace.p2p] == [("pp", "rank 1 (stage 1)")]
    assert trace.p2p_issued == {"0 recv 1": 1}
    assert RankTrace.from_json(json.loads(json.dumps(dataclasses.asdict(trace)))) == trace


def _world_pipeline_case(trace_dir: str):
    """pp 2 and nothing else (world 2): the mesh's pp dimension is the default group, whose description
    says 'world'; a heartbeat's P2P log names it after the mesh, so an open receive is a stage's."""
    import torch
    import torch.distributed as dist

    from hybridpar.diagnostics.heartbeat import Heartbeat
    from tests.distributed import parallel_dims

    parallel = parallel_dims(pp=2)
    beat = Heartbeat(parallel, timeout=60.0, trace_dir=Path(trace_dir))
    x, pending = torch.ones(2, 8), None
    with beat.p2p as log:
        if parallel.rank == 1:
            work = dist.irecv(x, 0, group=parallel.pp_group)
            pending = log.snapshot()["pending"]
        dist.barrier()
        if parallel.rank == 0:
            dist.send(x, 1, group=parallel.pp_group)
        else:
            work.wait()
    return {"pending": pending, "world": parallel.pp_group is dist.group.WORLD}


def test_a_pipeline_spanning_the_world_is_named_pp_with_its_stages(workers, tmp_path):
    _, receiver = workers(2).run(_world_pipeline_case, str(tmp_path))
    assert receiver["world"]  # the case this is about: torch gives the pp dimension the default group
    (op,) = [P2P(**p) for p in receiver["pending"]]
    assert (op.dim, op.ranks) == ("pp", [0, 1])
    assert op.describe(1) == "recv #1 from rank 0 (stage 0) on the pp group [0, 1]"


@pytest.mark.slow
def test_a_stage_of_torchs_pipeline_stopped_in_its_forward_is_named_with_its_stage(tmp_path):
    """pp 2 on the mesh's own pp dimension (the default group at world 2), torch's 1F1B through
    PipelineEngine: the report names rank 1, its stage and coordinates, and the op rank 0 waits in."""
    report, text = _run_job(tmp_path / "run", "engine")
    first = report["findings"][0]
    assert (first["kind"], first["ranks"], first["dim"]) == ("not_arrived", [1], "pp"), first
    cause = text.splitlines()[1]
    assert cause.startswith(f"CAUSE  rank 1 (stage 1) has not "), cause
    assert f"rank 0 (stage 0), which waits in {first['op']} #" in cause and "on the pp group [0, 1]" in cause, cause
    assert text.splitlines()[2].startswith("       rank 1: pp 1, mp 0, dp 0 (replicate 0, shard 0) on "), text
