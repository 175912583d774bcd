"""`hybridpar doctor`: bandwidth arithmetic and layout rules on hand-made inputs, the data-guard part on
4 workers (a correct and a broken pipeline), and the command under torchrun and without a launcher."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpar.diagnostics.doctor import (
    bandwidths,
    bus_factor,
    check_layout,
    dim_groups,
    format_busbw,
    format_layout,
    layout_rows,
    parse_sizes,
    summarise_busbw,
)
from hybridpar.diagnostics.env import ERROR, OK, WARNING
from tests.runs import make_config

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# --- bandwidth arithmetic --------------------------------------------------------------------------


def test_busbw_follows_nccl_tests_formulas():
    # 64 MiB in 10 ms is an algorithm bandwidth of 6.71 GB/s; the bus factor scales it to link traffic.
    algbw, busbw = bandwidths("all_reduce", 64 * MiB, 0.010, 4)
    assert algbw == pytest.approx(6.7108864e9) and busbw == pytest.approx(6.7108864e9 * 2 * 3 / 4)
    assert bandwidths("all_gather", 64 * MiB, 0.010, 8)[1] == pytest.approx(6.7108864e9 * 7 / 8)
    assert bandwidths("reduce_scatter", 64 * MiB, 0.010, 2)[1] == pytest.approx(6.7108864e9 / 2)
    assert bus_factor("all_reduce", 1) == 0.0  # nothing crosses a link in a group of one
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        bus_factor("broadcast", 4)


def test_each_row_reports_the_slowest_rank_of_the_slowest_group():
    """Fake timings at world 4 (mp 2 x dp 2): a group finishes with its slowest rank, a row shows the
    slowest group of its dimension."""
    seconds = {("mp", 0): 1e-3, ("mp", 1): 2e-3, ("mp", 2): 4e-3, ("mp", 3): 1e-3,
               ("dp", 0): 1e-3, ("dp", 1): 1e-3, ("dp", 2): 3e-3, ("dp", 3): 1e-3,
               ("world", 0): 8e-3, ("world", 1): 1e-3, ("world", 2): 1e-3, ("world", 3): 1e-3}
    per_rank = [[{"dim": dim, "op": "all_reduce", "bytes": MiB, "seconds": seconds[dim, r]}
                 for dim in ("mp", "dp", "world")] for r in range(4)]
    rows = summarise_busbw(per_rank, 1, 1, 2, 1, 2)
    assert [(r["dim"], r["slowest_group"], r["time_us"]) for r in rows] == [
        ("mp", [2, 3], pytest.approx(4000)), ("dp", [0, 2], pytest.approx(3000)),
        ("world", [0, 1, 2, 3], pytest.approx(8000))]
    assert rows[0]["busbw_gbps"] == pytest.approx(MiB / 4e-3 * 1.0 / 1e9)  # n = 2: 2(n-1)/n = 1
    assert rows[0]["group_busbw_gbps"] == [pytest.approx(MiB / 2e-3 / 1e9), pytest.approx(MiB / 4e-3 / 1e9)]
    assert rows[2]["busbw_gbps"] == pytest.approx(MiB / 8e-3 * 1.5 / 1e9)  # n = 4: 2(n-1)/n = 1.5
    assert rows[1]["same_as"] == ["dp_shard"]
    table = format_busbw(rows).splitlines()
    assert table[0].split() == ["dim", "n", "size", "all_reduce_us", "busbw"]
    assert table[2].split() == ["dp=dp_shard", "2", "1M", "3000.0", f"{MiB / 3e-3 / 1e9:.3f}"]


def test_dimensions_are_measured_once_and_only_with_two_ranks_or_more():
    def names(*sizes):
        return [(name, same) for name, same, _ in dim_groups(*sizes)]

    assert names(1, 1, 2, 1, 2) == [("mp", []), ("dp", ["dp_shard"]), ("world", [])]
    assert names(1, 2, 2, 1, 2) == [("mp", []), ("dp", []), ("dp_shard", []), ("dp_replicate", []), ("world", [])]
    assert names(1, 1, 4, 1, 1) == [("dp", ["dp_shard", "world"])]
    assert names(1, 2, 1, 1, 2) == [("mp", []), ("dp", ["dp_replicate"]), ("world", [])]
    assert names(1, 1, 1, 1, 1) == []
    # Context parallelism: the cp groups are measured; dp_shard x cp is what FSDP spans.
    assert names(1, 1, 2, 2, 2) == [("mp", []), ("cp", []), ("dp", ["dp_shard"]), ("world", [])]
    assert dim_groups(1, 2, 2, 1, 2)[3][2] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # dp_replicate groups
    # Pipeline parallelism: the pp groups (one rank per stage) are measured after the in-stage ones.
    assert names(2, 1, 2, 1, 1) == [("dp", ["dp_shard"]), ("pp", []), ("world", [])]
    assert dim_groups(2, 1, 2, 1, 1)[1][2] == [[0, 2], [1, 3]]


def test_the_layout_table_shows_the_stage_only_with_pp():
    infos = [{"rank": r, "host": "h", "local_rank": r, "device": "cpu", "pid": 100 + r} for r in range(4)]
    with_pp = format_layout(layout_rows(infos, 2, 1, 2, 1, 1)).splitlines()
    assert with_pp[0].split()[5] == "pp_rank" and [line.split()[5] for line in with_pp[1:]] == ["0", "0", "1", "1"]
    assert "pp_rank" not in format_layout(layout_rows(infos, 1, 1, 4, 1, 1))


def test_sizes_parse_as_ranges_or_lists():
    assert parse_sizes("4K:64M") == [4 << 10 << 2 * i for i in range(8)]
    assert parse_sizes("1K:8K:2") == [1024, 2048, 4096, 8192]
    assert parse_sizes("4K,1MB,100") == [4096, MiB, 100]
    for bad in ("4X", "64M:4K", "1K:8K:1", "0"):
        with pytest.raises(ValueError, match="bad"):
            parse_sizes(bad)


# --- layout ----------------------------------------------------------------------------------------


def _infos(hosts, devices):
    return [{"rank": r, "host": h, "local_rank": r % 2, "device": d} for r, (h, d) in enumerate(zip(hosts, devices))]


def test_model_parallel_groups_spanning_hosts_are_a_warning():
    infos = _infos(["a", "a", "b", "b"], ["cuda:0", "cuda:1"] * 2)
    assert [f.level for f in check_layout(infos, 1, 1, 2, 1, 2)] == [OK]
    (finding,) = check_layout(infos, 1, 1, 1, 1, 4)
    assert finding.level == WARNING and "[0, 1, 2, 3] on ['a', 'b']" in finding.message


def test_two_ranks_on_one_gpu_are_an_error():
    infos = _infos(["a", "a", "b", "b"], ["cuda:0", "cuda:0", "cuda:0", "cuda:1"])
    infos[1]["local_rank"] = 1
    (finding,) = check_layout(infos, 1, 1, 2, 1, 2)
    assert finding.level == ERROR and finding.message.startswith("ranks [0, 1] on host a have the same device cuda:0")
    cpu = _infos(["a"] * 4, ["cpu"] * 4)
    for i in cpu:
        i["local_rank"] = i["rank"]
    assert [f.level for f in check_layout(cpu, 1, 1, 2, 1, 2)] == [OK]  # CPU ranks share the CPU by design


# --- the data guard on 4 workers -------------------------------------------------------------------


def _case_data_guard(config):
    import torch
    import torch.distributed as dist

    from hybridpar.data import build_dataloader
    from hybridpar.diagnostics.doctor import build_loader, first_step_batches, guard_batches, run_data_guard
    from hybridpar.train import Trainer
    from tests.distributed import parallel_dims

    parallel = parallel_dims(mp=2)
    loader = build_loader(config, parallel)
    batches = first_step_batches(loader, config.train.grad_accum)
    # The doctor must check the batches the trainer will train on.
    trainer_batch = next(Trainer(config, parallel=parallel).loader)
    same_as_trainer = all(torch.equal(a, b) for a, b in zip(batches[0], trainer_batch))
    good = guard_batches(parallel, batches)
    # The classic mistake: the sampler keyed by the global rank splits each model-parallel group.
    broken = build_dataloader(loader.sources[0].dataset, dp_rank=dist.get_rank(), dp_size=dist.get_world_size(),
                              micro_batch_size=config.data.micro_batch_size, seed=config.data.seed)
    bad = guard_batches(parallel, first_step_batches(broken, 1))
    config.data.source = str(Path(config.output.run_dir) / "missing.jsonl")
    unbuildable = run_data_guard(config, parallel)  # fails on every rank: reported, no hang
    return same_as_trainer, good, bad, unbuildable


def test_data_guard_passes_the_configured_pipeline_and_catches_a_broken_one(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path, mp=2, dp=2)
    for same_as_trainer, good, bad, unbuildable in workers(4).run(_case_data_guard, config):
        assert same_as_trainer
        assert good.level == OK and "the 2 data-parallel ranks all differ" in good.message
        assert bad.level == ERROR and "model-parallel group got different batches: [0, 1], [2, 3]" in bad.message
        assert unbuildable.level == ERROR and "the data pipeline could not be built: rank 0:" in unbuildable.message
        assert "missing.jsonl" in unbuildable.message


# --- the command ------------------------------------------------------------------------------------


def _env(**extra) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("TORCH_NCCL_", "TORCH_FR_",
                                                                                       "NCCL_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_doctor_under_torchrun_prints_the_report_and_passes(corpus, tmp_path):
    from hybridpar.config import dump_toml

    config_path = tmp_path / "train.toml"
    config_path.write_text(dump_toml(make_config(corpus, tmp_path / "run", mp=2, dp=2)))
    out = tmp_path / "doctor.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "-m", "hybridpar", "doctor", "--config", str(config_path), "--sizes", "4K,64K", "--iters", "2",
           "--warmup", "1", "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = result.stdout
    print(text)
    assert "4 ranks = dp_replicate 1 x dp_shard 2 x mp 2, gloo on cpu" in text
    layout = [line for line in text.split("== mesh layout")[1].split("\n== ")[0].splitlines()[2:] if line]
    assert [line.split()[0] for line in layout] == ["0", "1", "2", "3"]
    assert [line.split()[5:9] for line in layout] == [["0", "0", "0", "0"], ["1", "0", "0", "0"],
                                                      ["0", "1", "0", "1"], ["1", "1", "0", "1"]]
    assert "ok       data-guard: step-1 batches" in text and "doctor passed: 0 error(s)" in text

    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["mp"] == 2 and report["dp_shard"] == 2
    rows = report["busbw"]
    assert {(r["dim"], r["op"], r["bytes"]) for r in rows} == {
        (d, op, size) for d in ("mp", "dp", "world") for op in ("all_reduce", "all_gather", "reduce_scatter")
        for size in (4096, 65536)}
    for r in rows:  # the reported numbers are the formulas applied to the reported time
        assert r["time_us"] > 0 and r["busbw_gbps"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], r["n"]))


@pytest.mark.slow
def test_doctor_fails_on_a_planted_bad_environment(tmp_path):
    """World of one, no launcher: the old spelling is shadowed by hybridpar's default (an error), and a
    train timeout longer than the init timeout is only a warning."""
    out = tmp_path / "doctor.json"
    cmd = [sys.executable, "-m", "hybridpar", "doctor", "--no-busbw", "--diagnostics.train_timeout", "900",
           "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(NCCL_ASYNC_ERROR_HANDLING="1"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("error    deprecated-env: NCCL_ASYNC_ERROR_HANDLING=1 is ignored: TORCH_NCCL_ASYNC_ERROR_HANDLING=3 "
            "takes precedence") in result.stdout
    assert "warning  timeouts: diagnostics.train_timeout = 900 s is longer than" in result.stdout
    assert "doctor FAILED: 1 error(s), 1 warning(s)" in result.stdout
    assert json.loads(out.read_text())["errors"] == 1
