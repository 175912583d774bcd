"""float8.fsdp_all_gather (hybridpar.parallel.float8_gather), emulated on the CPU: FSDP2 gathers the
float8 linears' weights in float8, their scales precomputed after each optimizer step from the
amax of the whole weight (FSDP's shards and the mp slices). A run with it equals the float8 run
without it (fp32 param dtype: the same float8 values, so to rounding); the all-gathers of those
weights carry half the bytes of bf16; its checkpoints hold plain fp32 values and resume without
float8. Without the amax reduction over mp the runs differ: the equality can fail."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import rel_err
from tests.runs import make_config

# Each run imports torchao and trains two trainers: seconds of CPU a rank.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BOUND = 1e-5
STEPS = 3
LAYOUTS = {
    # name: (world, make_config keyword arguments)
    "mp2-dp_shard2": (4, dict(mp=2, dp_shard=2, strategy="hybrid_shard", dp=2)),
    "dp_shard2": (2, dict(mp=1, dp_shard=2, dp=2)),
}


def _config(corpus, run_dir, layout: str, gather: bool, **overrides):
    world, kwargs = LAYOUTS[layout]
    return make_config(corpus, run_dir, steps=STEPS, **kwargs, **{
        "float8.recipe": "tensorwise", "float8.fsdp_all_gather": gather, **overrides})


def _case_runs(configs: dict, drop_mp: bool = False) -> dict:
    """Train each config in turn: rank 0's losses, gradient norms and full parameters, and every
    rank's types of parameter local tensors and optimizer state. drop_mp: the precompute's amax is
    not reduced over mp (the check that the equality can fail)."""
    import torch.distributed as dist

    from hybridpar.parallel import float8_gather
    from hybridpar.parallel.state import full_state_dict
    from hybridpar.train import Trainer

    split_groups = float8_gather._split_groups
    results = {}
    for name, config in configs.items():
        trainer = Trainer(config)
        if drop_mp:
            mp = dist.get_process_group_ranks(trainer.parallel.mp_group)
            float8_gather._split_groups = lambda w: [g for g in split_groups(w)
                                                     if dist.get_process_group_ranks(g) != mp]
        try:
            history = trainer.run()
        finally:
            float8_gather._split_groups = split_groups
        state = [v for st in trainer.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        params = full_state_dict(trainer.model)  # collective: every rank gathers
        results[name] = {
            "losses": [m["loss"] for m in history], "grad_norms": [m["grad_norm"] for m in history],
            "params": params if dist.get_rank() == 0 else None,
            "gathered": len(float8_gather.gathered_weights(trainer.model_parts)),
            "state types": sorted({type(getattr(v, "_local_tensor", v)).__name__ for v in state}),
        }
    return results


def _errors(runs: dict) -> dict:
    plain, gathered = runs["without"], runs["with"]
    errors = {f"loss step {i + 1}": rel_err(torch.tensor(a), torch.tensor(b))
              for i, (a, b) in enumerate(zip(gathered["losses"], plain["losses"]))}
    errors.update({f"grad_norm step {i + 1}": rel_err(torch.tensor(a), torch.tensor(b))
                   for i, (a, b) in enumerate(zip(gathered["grad_norms"], plain["grad_norms"]))})
    errors.update({f"param {n}": rel_err(gathered["params"][n], v) for n, v in plain["params"].items()})
    return errors


_RUNS: dict = {}  # layout -> (its runs, the gathered run's checkpoint folder), made once per session


def _runs(layout: str, workers, corpus, tmp_path_factory):
    if layout not in _RUNS:
        root = tmp_path_factory.mktemp(f"float8-gather-{layout}")
        configs = {"without": _config(corpus, root / "without", layout, False),
                   "with": _config(corpus, root / "with", layout, True, **{"checkpoint.at_end": True})}
        runs = workers(LAYOUTS[layout][0]).run(_case_runs, configs)
        _RUNS[layout] = runs, Path(configs["with"].checkpoint_dir())
    return _RUNS[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_run_gathering_in_float8_equals_the_run_without(workers, check_close, corpus, tmp_path_factory, layout):
    runs, _ = _runs(layout, workers, corpus, tmp_path_factory)
    for rank in runs:
        # 7 linears in each of the debug model's 2 blocks; the head stays bf16 (float8.skip)
        assert rank["with"]["gathered"] == 14 and rank["without"]["gathered"] == 0, rank
        assert rank["with"]["state types"] == ["Tensor"], rank  # the optimizer's state: plain tensors
    print(f"\n{layout} losses with {runs[0]['with']['losses']}, without {runs[0]['without']['losses']}")
    check_close(f"float8 all-gather {layout} vs without", _errors(runs[0]), BOUND)


def test_without_the_amax_reduction_over_mp_the_runs_differ(workers, corpus, tmp_path):
    """The scale of a weight split over mp is the whole weight's only through the reduction over mp."""
    configs = {"without": _config(corpus, tmp_path / "without", "mp2-dp_shard2", False),
               "with": _config(corpus, tmp_path / "with", "mp2-dp_shard2", True)}
    errors = _errors(workers(4).run(_case_runs, configs, drop_mp=True)[0])
    worst = max(errors.values())
    print(f"\nwithout the reduction over mp: worst relative error {worst:.2e} ({max(errors, key=errors.get)})")
    assert worst > 100 * BOUND


def _case_resume(config) -> dict:
    from hybridpar.parallel.state import full_state_dict
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    start, loaded = trainer.step, full_state_dict(trainer.model)
    state = [v for st in trainer.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    types = sorted({type(getattr(v, "_local_tensor", v)).__name__ for v in state})  # as loaded
    history = trainer.run()
    return {"start": start, "loaded": loaded, "steps": [m["step"] for m in history], "state types": types}


def test_its_checkpoint_holds_plain_values_and_resumes_without_float8(workers, corpus, tmp_path_factory, tmp_path):
    """And with it again: the optimizer state read back is plain tensors too."""
    from torch.distributed.checkpoint import FileSystemReader

    runs, folder = _runs("mp2-dp_shard2", workers, corpus, tmp_path_factory)
    saved = folder / f"step-{STEPS:08d}"
    metadata = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    dtypes = {str(m.properties.dtype) for m in metadata.values() if hasattr(m, "properties")}
    assert dtypes == {"torch.float32"}, dtypes  # master weights and Adam's moments; no float8
    for path in saved.rglob("*"):  # no tensor subclass pickled into any file
        assert path.is_dir() or not any(word in path.read_bytes() for word in (b"torchao", b"Float8")), path
    final = runs[0]["with"]["params"]
    for float8 in ({}, {"float8.recipe": "tensorwise", "float8.fsdp_all_gather": True}):  # {}: float8.recipe "none"
        config = make_config(corpus, tmp_path / str(bool(float8)), steps=STEPS + 2, **LAYOUTS["mp2-dp_shard2"][1], **{
            "checkpoint.folder": str(folder), "checkpoint.resume": True, **float8})
        resumed = workers(4).run(_case_resume, config)[0]
        assert resumed["start"] == STEPS and resumed["steps"] == [STEPS + 1, STEPS + 2], resumed
        assert resumed["state types"] == ["Tensor"], resumed["state types"]
        assert all(torch.equal(resumed["loaded"][n], v) for n, v in final.items())


def _dry_run_gathers(tmp_path: Path, gather: bool) -> tuple[dict, str]:
    """The dry run of rank 0 of mp 2 x dp_shard 2 (a GPU job), bf16 param dtype: its dp_shard
    all-gather row and its printed report."""
    out = tmp_path / f"dry-{gather}.json"
    flags = {"model.preset": "debug", "data.seq_len": 64, "parallel.mp": 2, "parallel.dp_shard": 2,
             "fsdp.param_dtype": "bfloat16", "float8.recipe": "tensorwise", "float8.fsdp_all_gather": gather}
    result = subprocess.run([sys.executable, "-m", "hybridpar", "train", "--dry-run", "--world", "4",
                             "--json", str(out), *[x for k, v in flags.items() for x in (f"--{k}", str(v).lower())]],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["collectives"] if (r["dim"], r["op"]) == ("dp_shard", "all_gather")]
    return rows[0], result.stdout


def test_the_dry_run_shows_the_float8_linears_gathered_in_half_the_bytes(tmp_path):
    """Against bf16 gathers: each float8 linear's all-gather carries 1 byte an element instead of 2
    (each block gathered in forward and again in backward), as the planner prices it; the report's
    table shows the bytes."""
    from hybridpar.files import human_bytes
    from hybridpar.models.args import ModelArgs
    from hybridpar.plan.memory import gathered_bytes, local_param_shapes

    (bf16, _), (float8, report) = _dry_run_gathers(tmp_path, False), _dry_run_gathers(tmp_path, True)
    args = ModelArgs.from_preset("debug")
    block = local_param_shapes(args, 2)["block"]  # this mp rank's slices, which FSDP gathers whole
    gathers = 2 * args.n_layers
    linears_bf16 = gathers * 2 * sum(rows * cols for rows, cols in [s for s in block if len(s) == 2])
    print(f"\ndp_shard all-gathers of a step: bf16 {bf16['payload']:,} bytes, with float8.fsdp_all_gather "
          f"{float8['payload']:,} bytes; the linears' share in bf16 {linears_bf16:,} bytes")
    assert bf16["calls"] == float8["calls"]
    assert bf16["payload"] - float8["payload"] == linears_bf16 // 2  # the linears' bytes halve, nothing else changes
    assert gathers * (gathered_bytes(block, 2, False, 2) - gathered_bytes(block, 2, True, 2)) == linears_bf16 // 2
    shown = f"  {'dp_shard':<13} {'all_gather':<15} {2:>5} {float8['calls']:>6} {human_bytes(float8['payload']):>11}"
    assert shown in report, report
