"""Flight-recorder dump files: written as JSON, read back by `hybridpar hang-report` with torch's own
pickled dumps beside them, and a pickle crafted to run a command refused naming its global."""

from __future__ import annotations

import json
import pickle

from tests.untrusted import payloads


def _case_dump(folder: str) -> int:
    """A collective on every rank, then this rank's dump written as the watchdog writes it."""
    import torch
    import torch.distributed as dist

    from hybridpar.diagnostics.traces import dump_flight_recorder, write_dump

    dist.all_reduce(torch.ones(3))
    dump = dump_flight_recorder()
    dump["hybridpar"] = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "step": 7}
    write_dump(folder, dist.get_rank(), dump)
    return len(dump["entries"])


def test_dumps_are_json_and_read_back(workers, tmp_path):
    from hybridpar.diagnostics.traces import DUMP_FORMAT, dump_path, load_dumps

    entries = workers(2).run(_case_dump, str(tmp_path))
    assert all(n >= 1 for n in entries), entries
    for rank in (0, 1):
        saved = json.loads(dump_path(tmp_path, rank).read_text())
        assert saved["format"] == DUMP_FORMAT and saved["hybridpar"]["rank"] == rank
    traces, world, skipped = load_dumps(tmp_path)
    assert sorted(traces) == [0, 1] and world == 2 and skipped == []
    assert traces[1].step == 7 and all(g.issued >= 1 for g in traces[1].groups.values())


def _torch_dump(issued: int) -> dict:
    """A dump as torch pickles it (TORCH_FR_DUMP_TEMP_FILE): plain containers only."""
    entries = [{"record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": i + 1,
                "profiling_name": "nccl:all_reduce", "input_sizes": [[4]], "state": "completed", "is_p2p": False}
               for i in range(issued)]
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {"0": {"last_completed_collective": issued}}, "entries": entries}


def test_the_dump_holds_nccls_own_recorder_beside_the_other_backends(monkeypatch):
    """ProcessGroupNCCL records into a recorder of its own (_dump_nccl_trace, CUDA builds): without
    it a hang on GPUs would be reported with no collective at all."""
    import torch

    from hybridpar.diagnostics.traces import dump_flight_recorder

    c10d = torch._C._distributed_c10d
    gloo = {"version": "2.10", "pg_config": {"1": {"name": "1", "desc": "mesh_mp", "ranks": "[0, 1]"}},
            "pg_status": {"1": {"last_completed_collective": 1}},
            "entries": [{**_torch_dump(1)["entries"][0], "pg_id": 1, "profiling_name": "gloo:broadcast"}]}
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a: pickle.dumps(gloo, protocol=2))
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a: pickle.dumps(_torch_dump(3), protocol=2), raising=False)
    dump = dump_flight_recorder()
    assert [e["profiling_name"] for e in dump["entries"]] == ["gloo:broadcast"] + ["nccl:all_reduce"] * 3
    assert sorted(dump["pg_status"]) == sorted(dump["pg_config"]) == ["0", "1"]
    monkeypatch.delattr(c10d, "_dump_nccl_trace")  # a CPU build: the other backends' recorder alone
    assert [e["profiling_name"] for e in dump_flight_recorder()["entries"]] == ["gloo:broadcast"]


def test_hang_report_reads_dumps_and_refuses_a_crafted_pickle(tmp_path, capsys):
    from hybridpar.cli import main

    folder = tmp_path / "dumps"
    folder.mkdir()
    (folder / "nccl_trace_rank_0").write_bytes(pickle.dumps(_torch_dump(5), protocol=2))
    (folder / "nccl_trace_rank_1").write_bytes(pickle.dumps(_torch_dump(4), protocol=2))  # one behind
    (folder / "notes_1.txt").write_text("collected from node 3\n")
    (folder / "rank_1.json").write_text(json.dumps({"entries": []}))  # JSON, but not naming itself a dump
    assert main(["hang-report", str(folder)]) == 0
    out = capsys.readouterr()
    assert "2 of 2 ranks' dumps" in out.out and "rank" in out.out
    skipped = [line for line in out.err.splitlines() if "skipped" in line]
    assert len(skipped) == 2 and all("not a flight-recorder dump" in line for line in skipped), out.err

    marker = tmp_path / "marker"
    for case, (name, data) in payloads(marker, _torch_dump(3)).items():  # run, a dump like the others
        (folder / "nccl_trace_rank_2").write_bytes(data)
        code = main(["hang-report", str(folder)])
        assert not marker.exists(), case  # first: a reader that ran it would go on to a report
        assert code == 2, case
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hybridpar: error")]
        print(f"\n{case}: {errors}")
        assert len(errors) == 1 and f"import {name}," in errors[0] and "nccl_trace_rank_2" in errors[0]
