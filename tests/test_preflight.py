"""One preflight for the job and its dry run (hybridpar.preflight.check_config): every refusal the docs
list for pipeline, context and sequence parallelism and for evaluation in the loop is said by
`hybridpar train` before anything trains and by `hybridpar train --dry-run` before anything is built,
in the same one line, exit code 2. Both run in this process, cheaply: the job as rank 0 of torchrun's
world up to the Trainer (a stand-in that fails the test if reached), the dry run up to its fake
process group."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpar.cli import main
from tests.test_pipeline_config import DOCUMENTED_REFUSALS, training_md_refusal_lines

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ["--config", "local", "--parallel.mp", "1"]  # the tiny model: 4 layers, micro_batch_size 4, validation on
DUALPIPEV = ["--parallel.pp", "2", "--parallel.pp_schedule", "DualPipeV"]  # refused by a torch without it
# The 405B rehearsal on 512 ranks: 8 micro-batches of a micro_batch_size of 1.
LLAMA_405B = ["--config", "llama2_70b", "--model.preset", "llama3.1_405b", "--parallel.mp", "8", "--parallel.pp", "8",
              "--parallel.dp_shard", "8"]


def _table_cases() -> list:
    """docs/training.md's table of pipeline refusals, row by row: (flags, world, the line it quotes);
    its last row is generate's (tests/test_pipeline_config.py)."""
    configs = [(LOCAL + flags, world) for flags, world in DOCUMENTED_REFUSALS]
    configs.insert(1, (LOCAL + DUALPIPEV, 2))  # the table's second row
    lines = training_md_refusal_lines()
    assert len(lines) == len(configs) + 1 and lines[-1].startswith("generation runs at pp = 1"), lines
    return [(flags, world, line) for (flags, world), line in zip(configs, lines)]


# The refusals the docs state in prose: (flags, world, what the line says).
PROSE_CASES = [
    # docs/training.md, Pipeline parallelism: "Two more come from what the pipeline itself cannot run".
    (LOCAL + ["--parallel.pp", "2", "--model.preset", "llama3.2_1b"], 2,
     "parallel.pp = 2 with a model whose output head is its embedding (tie_embeddings)"),
    (LOCAL + ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble"], 2,
     "parallel.pp_schedule = ZBVZeroBubble cannot run the validation forward"),
    # Long context: a seq_len not a multiple of 2 x cp (2 x cp x mp with sequence parallelism), a cp
    # whose product with mp and dp_replicate does not divide the world.
    (LOCAL + ["--parallel.cp", "2", "--data.seq_len", "126"], 2, "data.seq_len = 126 is not divisible by 2 x cp = 4"),
    (LOCAL + ["--parallel.mp", "2", "--parallel.cp", "2", "--data.seq_len", "124"], 4,
     "data.seq_len = 124 is not divisible by 2 x cp x mp = 8"),
    (LOCAL + ["--parallel.cp", "3"], 4, "world size 4 is not divisible by mp * cp * dp_replicate"),
    # Sequence parallelism: "data.seq_len must be a multiple of mp (refused otherwise, naming both)".
    (LOCAL + ["--parallel.mp", "2", "--data.seq_len", "127"], 2, "data.seq_len = 127 is not divisible by parallel.mp = 2"),
    # docs/evaluation.md, In the loop: pipeline or context parallelism, eval.limit and eval.num_fewshot out of range.
    (LOCAL + ["--parallel.pp", "2", "--eval.tasks", "arc_easy"], 2,
     "evaluation in the loop runs at pp 1 and cp 1, and this job has pp 2, cp 1"),
    (LOCAL + ["--parallel.cp", "2", "--eval.tasks", "arc_easy"], 2,
     "evaluation in the loop runs at pp 1 and cp 1, and this job has pp 1, cp 2"),
    (LOCAL + ["--eval.tasks", "arc_easy", "--eval.limit", "-1"], 1, "eval.limit must be"),
    (LOCAL + ["--eval.tasks", "arc_easy", "--eval.num_fewshot", "-2"], 1, "eval.num_fewshot must be 0 or more"),
    # Issue 49's: a pipeline micro-batch count that does not divide the micro-batch, and the 405B rehearsal.
    (LOCAL + ["--parallel.pp", "2", "--parallel.pp_microbatches", "3"], 2,
     "parallel.pp_microbatches = 3 does not divide data.micro_batch_size = 4"),
    (LLAMA_405B, 512, "parallel.pp_microbatches = 8 does not divide data.micro_batch_size = 1"),
]


class _NotToBeReached:
    def __init__(self, job):
        raise AssertionError("the job reached the Trainer: its preflight let the config through")


def _said(capsys) -> tuple[list[str], str]:
    out = capsys.readouterr()
    return [line for line in out.err.splitlines() if line.strip()], out.out


def _job(monkeypatch, capsys, flags: list, world: int, run_dir: Path) -> tuple[int, list[str], str]:
    """`hybridpar train` as rank 0 of `world` ranks (torchrun's variables): its exit code, stderr
    lines and stdout."""
    import hybridpar.train

    monkeypatch.setattr(hybridpar.train, "Trainer", _NotToBeReached)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    code = main(["train", *flags, "--output.run_dir", str(run_dir)])
    return (code, *_said(capsys))


def _dry_run(monkeypatch, capsys, flags: list, world: int, run_dir: Path) -> tuple[int, list[str], str]:
    """`hybridpar train --dry-run --world N`, outside any launcher: its exit code, stderr lines and stdout."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    code = main(["train", "--dry-run", "--world", str(world), *flags, "--output.run_dir", str(run_dir)])
    return (code, *_said(capsys))


@pytest.mark.parametrize("flags,world,line", _table_cases() + PROSE_CASES,
                         ids=lambda v: v if isinstance(v, str) else None)
def test_the_job_and_its_dry_run_refuse_alike_in_one_line(monkeypatch, capsys, tmp_path, flags, world, line):
    from hybridpar.pipeline import schedules as pipeline

    if flags[len(LOCAL):] == DUALPIPEV:
        monkeypatch.setattr(pipeline, "_torch_has", lambda name: False)  # a torch before DualPipeV
    _refused_alike(monkeypatch, capsys, tmp_path, flags, world, line)


def _without_torchao(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao fails; find_spec finds nothing


def _on_an_a100(monkeypatch) -> None:
    """A CUDA machine whose card has no float8 matmuls (compute capability 8.0)."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")


FLOAT8 = LOCAL + ["--float8.recipe", "rowwise"]
# docs/training.md, Float8: the refusals before any process group, each with what makes it (None: the flags)
# and the world size.
FLOAT8_CASES = [
    (LOCAL + ["--float8.recipe", "fp8"], None,
     "float8.recipe must be one of none, tensorwise, rowwise, rowwise_with_gw_hp, got 'fp8'", 1),
    (FLOAT8 + ["--float8.fsdp_all_gather", "true"], None,
     "float8.fsdp_all_gather needs float8.recipe = \"tensorwise\" (one scale per weight), got 'rowwise'", 1),
    # The tiny model's wq has 256 rows: 3 dp_shard ranks hold uneven shards.
    (LOCAL + ["--float8.recipe", "tensorwise", "--float8.fsdp_all_gather", "true"], None,
     "float8.fsdp_all_gather needs each float8 linear's rows split evenly over the 3 FSDP shards (dp_shard x cp), "
     "and attention.wq has 256 per mp rank; choose a parallel.dp_shard x parallel.cp dividing 256, add \"wq\" to "
     "float8.skip, or set float8.fsdp_all_gather = false", 3),
    (FLOAT8, _without_torchao,
     "float8.recipe needs torchao, which is not installed: pip install 'hybridpar[float8]' (or pip install "
     "'torchao>=0.18')", 1),
    (FLOAT8, _on_an_a100,
     "float8.recipe needs float8 matmuls (compute capability 8.9 or above: L4, H100, H200, B200), and this NVIDIA "
     "A100-SXM4-80GB has compute capability 8.0; set float8.recipe = \"none\"", 1),
]


@pytest.mark.parametrize("flags,setup,line,world", FLOAT8_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_float8_is_refused_in_one_line_by_the_job_and_its_dry_run(monkeypatch, capsys, tmp_path, flags, setup, line,
                                                                  world):
    if setup is not None:
        setup(monkeypatch)
    _refused_alike(monkeypatch, capsys, tmp_path, flags, world, line)
    section = (ROOT / "docs" / "training.md").read_text().split("\n## Float8\n", 1)[1].split("\n## ", 1)[0]
    assert f"`{line}`" in section  # as the page quotes it


def _refused_alike(monkeypatch, capsys, tmp_path, flags: list, world: int, line: str) -> None:
    """The job and the dry run both exit 2 with the one line holding `line`, before any process group
    or run folder."""
    import torch.distributed as dist

    monkeypatch.delenv("HYBRIDPAR_TRACEBACK", raising=False)
    run_dir = tmp_path / "run"
    code, job_said, job_out = _job(monkeypatch, capsys, flags, world, run_dir)
    assert (code, len(job_said), job_out) == (2, 1, ""), job_said + [job_out]
    assert job_said[0].startswith("hybridpar: error: ") and line in job_said[0], job_said
    assert not dist.is_initialized() and not run_dir.exists()  # refused before anything started
    code, dry_said, dry_out = _dry_run(monkeypatch, capsys, flags, world, run_dir)
    assert (code, dry_said, dry_out) == (2, job_said, ""), dry_said + [dry_out[-2000:]]
    assert not dist.is_initialized() and not run_dir.exists()


def test_a_config_the_job_takes_passes_the_same_preflight_in_the_dry_run():
    """The 405B rehearsal refused above passes with micro-batches of one sequence (as the job
    would), and so does each table row's config once its one mistake is put right."""
    from hybridpar.config import find_config, load_config
    from hybridpar.preflight import check_config

    overrides = LLAMA_405B[2:] + ["--data.micro_batch_size", "8"]
    sizes, args = check_config(load_config(find_config("llama2_70b"), overrides), 512)
    assert sizes == (8, 1, 8, 1, 8) and args.n_layers == 126
    fine = ["--parallel.pp", "2", "--parallel.pp_schedule", "ZBVZeroBubble", "--data.val_fraction", "0"]
    assert check_config(load_config(find_config("local"), LOCAL[2:] + fine), 2)[0] == (2, 1, 1, 1, 1)


@pytest.mark.parametrize("world,skip", [(4, "output"), (3, "wq,wk,wv,wo,w1,w2,w3,output")],
                         ids=["even", "uneven-skipped"])
def test_float8_all_gather_with_tensorwise_passes_the_preflight(world, skip):
    """float8.fsdp_all_gather is built: taken with tensorwise where every float8 linear's rows split
    evenly over the FSDP shards (the tiny model's over 4), or where the uneven ones stay in high
    precision (over 3 every linear's rows are uneven: 256, 128, 704, the head's 4096)."""
    from hybridpar.config import find_config, load_config
    from hybridpar.preflight import check_config

    flags = ["--float8.recipe", "tensorwise", "--float8.fsdp_all_gather", "true", "--float8.skip", skip]
    assert check_config(load_config(find_config("local"), LOCAL[2:] + flags), world)[0] == (1, 1, world, 1, 1)


def test_a_config_given_back_as_flags_is_the_same_config():
    """A config's values as flags (tests/test_dryrun.py rehearses its real runs so) load as that config:
    the dry run checks what the job would run (an empty eval.tasks, "[]", stays empty)."""
    from hybridpar.config import find_config, load_config

    for extra in ([], ["--eval.tasks", "arc_easy,hellaswag"]):
        config = load_config(find_config("local"), extra)
        flags = [x for s, section in config.to_dict().items() for k, v in section.items() for x in (f"--{s}.{k}", str(v))]
        assert load_config(None, flags).to_dict() == config.to_dict()


@pytest.mark.slow
def test_the_405b_rehearsal_runs_with_a_micro_batch_of_8(tmp_path):
    """The issue's command with --data.micro_batch_size 8 rehearses rank 0's stage (14 of the 126
    identical layers, 2 per stage: every size of 405B but the depth)."""
    cmd = [sys.executable, "-m", "hybridpar", "train", "--dry-run", "--world", "512", *LLAMA_405B,
           "--data.micro_batch_size", "8", "--model.n_layers", "14", "--output.run_dir", str(tmp_path / "run"),
           "--json", str(tmp_path / "dry.json")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "dry.json").read_text())
    assert report["ok"] and report["layout"].startswith("pp 8 x dp_replicate 1 x dp_shard 8 x mp 8 = 512 ranks")


LLAMA4 = LOCAL + ["--model.preset", "debug_llama4", "--data.seq_len", "64"]
# What does not run a Llama 4 model yet (issue 52), each refused by name: context parallelism, naming
# what of the model it does not run.
LLAMA4_CASES = [
    (LLAMA4 + ["--parallel.cp", "2"], 2,
     "parallel.cp = 2: context parallelism does not run Llama 4's chunked local attention (attention_chunk_size = "
     "8), RoPE-less layers' temperature tuning by position (attn_temperature_tuning) or routed experts (n_experts = "
     "4) yet; set parallel.cp = 1"),
]


@pytest.mark.parametrize("flags,world,line", LLAMA4_CASES, ids=["cp"])
def test_what_does_not_run_llama4_yet_is_refused_in_one_line(monkeypatch, capsys, tmp_path, flags, world, line):
    _refused_alike(monkeypatch, capsys, tmp_path, flags, world, line)


# parallel.ep (expert parallelism), each mistake in one line naming the key and what to change; with
# what does not run experts yet (context parallelism) ep changes nothing.
EP_CASES = [
    (LOCAL + ["--parallel.ep", "2"], 2,
     "parallel.ep = 2 splits a mixture of experts' experts, and this model is dense (no experts); set parallel.ep = 1"),
    (LLAMA4 + ["--parallel.ep", "3"], 3,
     "parallel.ep = 3 does not divide the model's 4 experts (n_experts, num_local_experts): each ep rank holds "
     "n_experts / ep; choose a parallel.ep dividing 4"),
    (LLAMA4 + ["--parallel.ep", "2", "--parallel.dp_replicate", "2"], 2,
     "parallel.ep = 2 does not divide parallel.dp_shard = 1: the experts are split over ep of the dp_shard ranks (it "
     "has none of its own); choose a parallel.ep dividing 1, or more dp_shard ranks"),
    (LLAMA4 + ["--parallel.ep", "0"], 1, "parallel.ep must be a positive integer (1: no expert parallelism), got 0"),
    (LLAMA4 + ["--parallel.ep", "2", "--parallel.cp", "2"], 4, LLAMA4_CASES[0][2]),
]


@pytest.mark.parametrize("flags,world", [(["--parallel.pp", "2", "--parallel.ep", "2"], 4),
                                         (["--float8.recipe", "tensorwise", "--parallel.ep", "2"], 2),
                                         (["--train.compile", "true", "--parallel.ep", "2"], 2)],
                         ids=["pp", "float8", "compile"])
def test_llama4_passes_the_preflight_with_pp_float8_and_compile(flags, world):
    """Issue 52: what was refused for Llama 4 and now runs (tests/train/test_expert_training.py and
    test_float8_training.py train it) passes the job's preflight."""
    from hybridpar.config import find_config, load_config
    from hybridpar.preflight import check_config

    assert check_config(load_config(find_config("local"), LLAMA4[2:] + flags), world)[1].n_experts == 4


def test_the_dry_run_and_the_planner_take_a_mixture_of_experts(monkeypatch, capsys, tmp_path):
    """The job takes the tiny Llama 4 (it passes the preflight); the rehearsal runs it on fake tensors with
    balanced routing and the planner prices it (issue 52: they refused it before)."""
    from hybridpar.config import find_config, load_config
    from hybridpar.preflight import check_config

    assert check_config(load_config(find_config("local"), LLAMA4[2:]), 2)[1].n_experts == 4
    for ep in ("1", "2"):  # the experts' loop (fp32: fake tensors have no fp32 grouped matmul) on host sizes
        code, said, out = _dry_run(monkeypatch, capsys, LLAMA4 + ["--parallel.ep", ep], 2, tmp_path / "run")
        assert code == 0 and "experts (routing balanced (fake tensors have no values to route by)" in out, (said, out)
    code = main(["plan", "--model", "llama4_scout", "--gpus", "64", "--global-batch", "64"])
    said, out = _said(capsys)
    assert code == 0 and "107.77B parameters (17.17B active per token" in out, (said, out)


@pytest.mark.slow
def test_the_dry_run_rehearses_a_mixture_of_experts_in_pipeline_stages(monkeypatch, capsys, tmp_path):
    """pp 2 x ep 2 (world 4): each stage's MoE layer rehearsed with balanced routing, and the planner's
    all-to-all bytes for the stage's experts equal those the real code issues (the planner refused pp before)."""
    code, said, out = _dry_run(monkeypatch, capsys, LLAMA4 + ["--parallel.pp", "2", "--parallel.ep", "2"], 4,
                               tmp_path / "run")
    assert code == 0 and "ok   mesh: pp 2 x dp_replicate 1 x dp_shard 2 (ep 2) x mp 1" in out, (said, out)
    planned = re.search(r"all-to-all per step (\S+ \S+) planned, (\S+ \S+) issued", out)
    assert planned and planned[1] == planned[2], out



# [moe] (a mixture of experts' load balance): balancing on a dense model, or a value out of range.
MOE_CASES = [*((LOCAL + [f"--moe.{key}", value], 1, f"moe.{key} = {value} balances a mixture of experts' router, "
                f"and this model is dense (no experts); set moe.{key} = 0")
               for key, value in (("router_aux_loss_coef", "0.01"), ("bias_update_rate", "0.001"))),
             (LLAMA4 + ["--moe.router_aux_loss_coef", "-0.1"], 1,
              "moe.router_aux_loss_coef must be >= 0, got -0.1; change moe.router_aux_loss_coef"),
             (LLAMA4 + ["--moe.hot_ratio", "1"], 1, "moe.hot_ratio must be > 1, got 1.0; change moe.hot_ratio"),
             (LLAMA4 + ["--moe.bias_update_rate", "0.001", "--fault_tolerance.enabled", "true"], 1,
              "moe.bias_update_rate with fault_tolerance.enabled: each replica group would move its routing bias by its "
              "own tokens alone (the groups share gradients, not token counts); set moe.bias_update_rate = 0 or "
              "fault_tolerance.enabled = false")]


@pytest.mark.parametrize("flags,world,line", EP_CASES + MOE_CASES,
                         ids=["dense", "experts", "dp_shard", "zero", "with-cp", "aux-dense", "bias-dense", "negative",
                              "hot_ratio", "bias-replica-groups"])
def test_an_ep_or_a_balance_that_cannot_act_on_the_experts_is_refused_in_one_line(monkeypatch, capsys, tmp_path, flags,
                                                                                  world, line):
    _refused_alike(monkeypatch, capsys, tmp_path, flags, world, line)
