"""The command line as a user runs it: `hybridpar train` without a launcher, and the quickstart script."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.distributed import child_pythonpath
from tests.wheel import build_wheel

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    # No launcher variables: the run must work as a plain process.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    return result


@pytest.mark.slow
def test_train_world_of_one_without_launcher(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: " + "the quick brown fox jumps. " * 20}) + "\n"
                            for i in range(200)))
    result = _run([sys.executable, "-m", "hybridpar", "train", "--model.preset", "debug", "--model.vocab_size", "512",
                   "--data.source", str(data), "--data.cache_dir", str(tmp_path / "cache"),
                   "--data.tokenizer_vocab_size", "300", "--data.seq_len", "32", "--train.steps", "3",
                   "--train.peak_flops", "1e12", "--output.run_dir", str(tmp_path / "run"),
                   "--output.tensorboard", "false", "--output.plot", "false", "--fsdp.param_dtype", "float32"], 300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step     3/3" in result.stdout
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # steps 1 and 3


def test_train_help_names_every_key_of_every_section_with_its_default_and_meaning():
    import dataclasses

    from hybridpar.config import Config

    result = _run([sys.executable, "-m", "hybridpar", "train", "--help"], 120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    page = (ROOT / "docs" / "training.md").read_text()  # the config key table
    checkpoints = (ROOT / "docs" / "checkpoints.md").read_text()  # the [checkpoint] keys' own table
    config = Config()
    for section in dataclasses.fields(config):
        assert f"[{section.name}]" in lines, section.name
        row = next(line for line in page.splitlines() if line.startswith(f"| `[{section.name}]` |"))
        for field in dataclasses.fields(getattr(config, section.name)):
            key = f"--{section.name}.{field.name}"
            line = next((x for x in lines if x.strip().startswith(key + " ")), None)
            assert line is not None, f"{key} missing from train --help"
            default = json.dumps(getattr(getattr(config, section.name), field.name))
            assert f"(default {default})  " in line and line.split(")  ", 1)[1].strip(), line
            if section.name != "checkpoint":  # the [checkpoint] row points to its own table
                assert f"`{field.name}`" in row, f"docs/training.md's [{section.name}] row does not name {field.name}"
            else:
                assert f"| `{field.name}` |" in checkpoints, f"docs/checkpoints.md's table does not name {field.name}"


@pytest.mark.slow
def test_a_wheel_installed_outside_the_checkout_trains_with_a_named_config(corpus, tmp_path):
    """`hybridpar train --config local` from a wheel in a fresh environment, run away from the
    checkout: the named configs and model presets are package data."""
    wheel = build_wheel(tmp_path)
    env_dir = tmp_path / "env"  # torch and the other dependencies come from this interpreter's packages
    made = _run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], 120)
    assert made.returncode == 0, made.stderr
    python = str(env_dir / "bin" / "python")
    installed = _run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], 300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    where = subprocess.run([python, "-c", "import hybridpar; print(hybridpar.__file__)"], cwd=away,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr  # not the checkout's
    result = subprocess.run(
        [python, "-m", "hybridpar", "train", "--config", "local", "--parallel.mp", "1", "--parallel.dp_shard", "1", "--train.steps", "2",
         "--model.preset", "debug", "--model.vocab_size", "512", "--data.tokenizer_vocab_size", "512",
         "--data.seq_len", "32", "--data.source", corpus["source"], "--data.cache_dir", corpus["cache_dir"],
         "--train.peak_flops", "1e12", "--output.run_dir", str(away / "run"), "--checkpoint.at_end", "false"],
        cwd=away, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step     2/2" in result.stdout


def test_bad_override_is_one_clear_line():
    result = _run([sys.executable, "-m", "hybridpar", "train", "--train.stepz", "3"], 120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("hybridpar: error: unknown config key 'train.stepz'")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_quickstart_script_trains_and_writes_its_outputs(tmp_path):
    """The README's main job, shortened: 4 processes, mp 2 x dp 2, the embedded corpus. 20 steps (the
    warm-up's, as in the full run) take the loss from 8.37 to 6.74 (the mean of steps 11-20)."""
    run_dir = tmp_path / "local"
    result = _run(["bash", "launch/local.sh", "--train.steps", "20", "--output.run_dir", str(run_dir)], 900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"\nquickstart loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
    assert rows[-1]["step"] == 20 and rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert any((run_dir / "tensorboard").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("mistake,flags,message", [
    ("same_data", {}, "hybridpar: error: data guard, step 1"),
    ("none", {"--parallel.mp": "3"}, "hybridpar: error: parallel.mp / parallel.dp_shard / parallel.dp_replicate"),
])
def test_an_error_every_rank_raises_is_one_screen(corpus, tmp_path, mistake, flags, message):
    """Under torchrun at world 4: the message once, from rank 0, without a traceback; a non-zero exit.
    Once the run has started, every rank's traceback is in the run folder's logs, which the message
    names; a mistake the checks before the start find leaves no run folder at all."""
    run_dir = tmp_path / "run"
    args = {"--config": "local", "--train.steps": "2", "--output.run_dir": str(run_dir), "--model.preset": "debug",
            "--model.vocab_size": "512", "--data.tokenizer_vocab_size": "512", "--data.seq_len": "32",
            "--data.source": corpus["source"], "--data.cache_dir": corpus["cache_dir"], "--train.peak_flops": "1e12",
            **flags}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "tests" / "diagnostics" / "cli_job.py"), mistake, "--",
           *[x for kv in args.items() for x in kv]]
    result = _run(cmd, 600)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    print("\n" + "\n".join(ours))
    assert len(ours) == 1 and ours[0].startswith(message), result.stderr[-3000:]
    assert not re.search(r"^\[rank\d+\]:", result.stderr, re.M), result.stderr[-3000:]  # no rank's traceback
    assert result.stderr.count("Traceback") <= 1  # torchrun's own, around its summary
    if mistake == "none":
        assert not run_dir.exists()
        return
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert logs == [f"rank-{r}.log" for r in range(4)] and str(run_dir / "logs") in ours[0]
    assert "Traceback" in (run_dir / "logs" / "rank-2.log").read_text()


def _bad_params_json(folder: Path) -> Path:
    path = folder / "params.json"
    path.write_text(json.dumps({"dim": "256", "n_layers": 4, "n_heads": 8, "vocab_size": 4096}))
    return path


BAD_DIM = 'params.json: "dim" must be an integer, got the string "256"'


def test_train_with_a_bad_params_json_is_one_clear_line(tmp_path):
    result = _run([sys.executable, "-m", "hybridpar", "train", "--model.params_json", str(_bad_params_json(tmp_path)),
                   "--output.run_dir", str(tmp_path / "run")], 120)
    assert result.returncode == 2, result.stdout + result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert len(ours) == 1 and ours[0].startswith(f"hybridpar: error: {tmp_path}/{BAD_DIM}"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_with_a_bad_params_json_at_world_2_prints_it_once(tmp_path):
    """Every rank reads the file and refuses it, before any process group; rank 0 alone prints the message."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "diagnostics" / "cli_job.py"), "none", "--",
           "--model.params_json", str(_bad_params_json(tmp_path)), "--output.run_dir", str(tmp_path / "run")]
    result = _run(cmd, 300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert len(ours) == 1 and ours[0].startswith(f"hybridpar: error: {tmp_path}/{BAD_DIM}"), result.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # refused before the start: nothing made


# --- first contact: --help without torch, and every mistake one line before anything starts -----------

def _hybridpar(cwd: Path, *argv: str, env: dict = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m hybridpar ...` as a user runs it from `cwd`, this checkout's hybridpar first."""
    return subprocess.run([sys.executable, "-m", "hybridpar", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**_env(), "PYTHONPATH": child_pythonpath(), **(env or {})})


# A start refused by its checks answers in seconds (torch is not even imported). Without the check the
# run starts, and under a launcher's variables waits for ranks that never come: the test says so by
# the missing refusal within this limit, not by a subprocess timeout minutes later.
REFUSAL_S = 30


def _answers_at_once(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) that must be done within REFUSAL_S; otherwise fails with what it printed."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=REFUSAL_S, **kwargs)
    except subprocess.TimeoutExpired as late:
        printed = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or ""
                          for o in (late.stdout, late.stderr))
        pytest.fail(f"no answer within {REFUSAL_S} s: no refusal, the start went on; it printed: {printed[-2000:]!r}")


@pytest.mark.parametrize("argv,code,refusal", [
    (["--help"], 0, None), (["train", "--help"], 0, None), (["plan", "--help"], 0, None),
    (["mesh", "--world", "8", "--mp", "2"], 0, None),
    (["train", "--optim.lr", "-1"], 2, "optim.lr must be > 0"),
    (["train", "--data.seq_len", "127", "--parallel.mp", "2"], 2, "data.seq_len = 127 is not divisible by parallel.mp = 2"),
    (["train", "--float8.recipe", "fp8"], 2, "float8.recipe must be one of none, tensorwise, rowwise"),
])
def test_help_mesh_and_a_refused_start_import_no_torch(argv, code, refusal, tmp_path):
    """The parser, the config's dataclasses and the checks before the start are torch-free: `--help`
    answers at once, and so does a mistake."""
    probe = ("import runpy, sys\nsys.argv = ['hybridpar', *sys.argv[1:]]\ntry:\n    runpy.run_module('hybridpar', "
             "run_name='__main__')\nexcept SystemExit as e:\n    print('exit', e.code or 0)\n"
             "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    result = _answers_at_once([sys.executable, "-c", probe, *argv], cwd=tmp_path,
                              env={**_env(), "PYTHONPATH": child_pythonpath(), "WORLD_SIZE": "2", "RANK": "0"})
    if refusal:  # the refusal's own line, not only its exit code
        assert f"hybridpar: error: {refusal}" in result.stderr, result.stderr
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == f"exit {code}", result.stderr
    assert result.stderr.strip().splitlines()[-1] == "no torch", result.stderr


def _one_line_refusal(result: subprocess.CompletedProcess, cwd: Path, before: set, *expected: str) -> str:
    """The mistake is one line on stderr, naming what to change; nothing else printed or left behind."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode not in (0, None), result.stdout + result.stderr
    assert len(lines) == 1 and lines[0].startswith("hybridpar"), result.stderr
    assert "Traceback" not in result.stderr and "HYBRIDPAR_TRACEBACK" not in result.stderr, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert {p.relative_to(cwd) for p in cwd.rglob("*")} == before, "a refused start left files behind"
    return lines[0]


MISTAKES = {
    # name: (argv, environment, what the line says); in a folder holding some_file, a_folder/ and empty/
    "config is a folder": (["train", "--config", "a_folder"], {}, ["--config a_folder is a folder", "TOML file"]),
    "run_dir under a file": (["train", "--output.run_dir", "some_file/run"], {},
                             ["output.run_dir", "some_file is a file", "choose another output.run_dir"]),
    "run_dir is a file": (["train", "--output.run_dir", "some_file"], {}, ["output.run_dir: some_file is a file"]),
    "checkpoint folder under a file": (["train", "--checkpoint.folder", "some_file/ckpt"], {}, ["checkpoint.folder"]),
    "negative lr": (["train", "--optim.lr", "-1"], {}, ["optim.lr must be > 0, got -1.0"]),
    "beta of 1": (["train", "--optim.beta2", "1"], {}, ["optim.beta2 must be >= 0 and < 1"]),
    "seq_len not a multiple of mp": (["train", "--data.seq_len", "127", "--parallel.mp", "2"],
                                     {"WORLD_SIZE": "2", "RANK": "0"},
                                     ["data.seq_len = 127 is not divisible by parallel.mp = 2", "multiple of 2"]),
    "mesh against the world": (["train", "--parallel.mp", "3"], {}, ["parallel.mp", "at 1 rank(s)"]),
    "missing tokenizer": (["train", "--data.tokenizer", "/nope"], {}, ["data.tokenizer: /nope does not exist",
                                                                     "\"\" to train one"]),
    "tokenizer folder without one": (["train", "--data.tokenizer", "empty"], {},
                                     ["data.tokenizer: the folder empty holds no tokenizer.model"]),
    "missing source": (["train", "--data.source", "/nope.jsonl"], {}, ["data.source: /nope.jsonl does not exist"]),
    "params_json a folder": (["train", "--model.params_json", "a_folder"], {}, ["model.params_json: a_folder is a folder"]),
    "dtype alias in config": (["train", "--fsdp.param_dtype", "bf16"], {}, ["fsdp.param_dtype: write 'bfloat16'"]),
    "json without dry run": (["train", "--json", "report.json"], {}, ["--json goes with --dry-run"]),
    "local config at world 1": (["train", "--config", "local"], {}, ["parallel.mp", "at 1 rank(s)"]),
    "generate: tokenizer folder without one": (
        ["generate", "--checkpoint", "a_folder", "--tokenizer", "empty", "--prompt", "hi"], {},
        ["--tokenizer: the folder empty holds no tokenizer.model or tokenizer.json"]),
    "generate: missing tokenizer": (["generate", "--checkpoint", "a_folder", "--tokenizer", "/nope", "--prompt", "hi"],
                                    {}, ["--tokenizer: /nope does not exist"]),
    "generate: dtype alias": (["generate", "--checkpoint", "a_folder", "--tokenizer", "some_file", "--prompt", "hi",
                               "--dtype", "bf16"], {}, ["--dtype: write 'bfloat16' (torch's name) instead of 'bf16'"]),
    "hang-report: nothing there": (["hang-report", "/nope"], {}, ["no flight-recorder dumps in /nope"]),
    "plan: dtype alias": (["plan", "--model", "tiny", "--gpus", "8", "--param-dtype", "bf16"], {},
                          ["--param-dtype: write 'bfloat16' (torch's name) instead of 'bf16'"]),
    "plan: reduce dtype alias": (["plan", "--model", "tiny", "--gpus", "8", "--reduce-dtype", "fp32"], {},
                                 ["--reduce-dtype: write 'float32'"]),
    "convert: the old --load-mp": (["convert", "a", "b", "--to", "hf", "--load-mp", "2"], {},
                                   ["unrecognized arguments: --load-mp 2", "hybridpar convert --help"]),
    "verify: nothing there": (["verify", "/nope"], {}, ["verify /nope: no such file or folder"]),
    "doctor: config is a folder": (["doctor", "--config", "a_folder"], {}, ["--config a_folder is a folder"]),
    "doctor: the old --out": (["doctor", "--out", "x.json"], {}, ["unrecognized argument --out"]),
    "train: a mistyped flag": (["train", "--confg", "local"], {}, ["--confg: did you mean --config?"]),
    "train: a flag that is no key": (["train", "--stps", "3"], {}, ["--stps; config keys look like --train.steps"]),
    "verify: not a checkpoint": (["verify", "a_folder"], {}, ["verify a_folder: not a checkpoint",
                                                               "folder of step-NNNNNNNN checkpoints"]),
    "convert: no source": (["convert", "/nope", "out", "--to", "hf"], {}, ["hybridpar: error: /nope does not exist"]),
    "convert: a shard size without a unit it knows": (
        ["convert", "/nope", "out", "--to", "hf", "--max-shard-size", "5XB"], {},
        ["--max-shard-size 5XB: not a size; write a byte count (5000000000) or a number with KB, MB, GB, TB"]),
    "convert: dtype alias": (["convert", "/nope", "out", "--to", "hf", "--dtype", "bf16"], {},
                             ["--dtype: write 'bfloat16' (torch's name) instead of 'bf16'"]),
    "mesh: sizes": (["mesh", "--world", "4", "--mp", "3"], {}, ["not divisible"]),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_a_mistake_is_one_line_before_anything_starts(name, tmp_path):
    argv, env, expected = MISTAKES[name]
    (tmp_path / "some_file").write_text("not a folder")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "empty").mkdir()
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    if argv[0] == "train":  # checked before the start, torch-free: at once
        result = _answers_at_once([sys.executable, "-m", "hybridpar", *argv], cwd=tmp_path,
                                  env={**_env(), "PYTHONPATH": child_pythonpath(), **env})
    else:
        result = _hybridpar(tmp_path, *argv, env=env)
    line = _one_line_refusal(result, tmp_path, before, *expected)
    assert "train one" not in line or argv[0] == "train", line  # generate's advice is not training's


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_run_dir_without_permission_is_one_line(tmp_path):
    (tmp_path / "locked").mkdir(mode=0o500)
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    _one_line_refusal(_hybridpar(tmp_path, "train", "--output.run_dir", "locked/run"), tmp_path, before,
                      "output.run_dir: no permission to write in locked")


def test_convert_into_an_existing_folder_names_the_overwrite_flag(tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "kept.txt").write_text("mine")
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    _one_line_refusal(_hybridpar(tmp_path, "convert", "nothing", "dst", "--to", "dcp"), tmp_path, before,
                      "dst already exists", "--overwrite")


@pytest.mark.slow  # rank 1 waits reporting.RANK_0_SPEAKS_S (10 s) for rank 0 to say it
def test_under_a_launcher_only_rank_0_prints_a_mistake_every_rank_makes(tmp_path):
    """Every rank runs the same checks; the others exit non-zero without a word."""
    result = _hybridpar(tmp_path, "train", "--optim.lr", "-1", env={"WORLD_SIZE": "2", "RANK": "1"})
    assert result.returncode == 2 and not result.stderr.strip(), result.stderr
    assert not list(tmp_path.iterdir())


def test_only_an_internal_error_suggests_the_traceback(tmp_path, capsys):
    from hybridpar.reporting import report_error as _report_error
    from hybridpar.config import ConfigError

    assert _report_error(ConfigError("optim.lr must be > 0"), None) == 2
    assert _report_error(IsADirectoryError(21, "Is a directory", "/data/x"), None) == 2
    assert capsys.readouterr().err.splitlines() == ["hybridpar: error: optim.lr must be > 0",
                                                    "hybridpar: error: /data/x: is a directory"]
    try:
        raise RuntimeError("the unexpected")
    except RuntimeError as raised:
        internal = raised
    assert _report_error(internal, tmp_path / "logs") == 1
    err = capsys.readouterr().err
    assert err.startswith("hybridpar: internal error: RuntimeError: the unexpected (traceback: ") and \
        "HYBRIDPAR_TRACEBACK=1" in err, err
    assert "Traceback" in (tmp_path / "logs" / "rank-0.log").read_text()
    with pytest.raises(RuntimeError):  # no run folder to log in: the traceback itself
        _report_error(internal, None)


def test_the_local_config_runs_alone_at_mp_1_and_as_mp2_x_dp2_at_four(tmp_path):
    from hybridpar.config import find_config, load_config
    from hybridpar.mesh.layout import resolve_sizes
    from hybridpar.preflight import check_values

    alone = load_config(find_config("local"), ["--parallel.mp", "1"])
    check_values(alone, 1)
    four = load_config(find_config("local"))
    check_values(four, 4)
    p = four.parallel
    assert resolve_sizes(4, p.mp, p.dp_shard, p.dp_replicate) == (1, 1, 2, 1, 2)


@pytest.mark.parametrize("overrides,world,said", [
    # 2 x cp = 4 chunks; with sequence parallelism each rank's chunks split again over mp: 2 x 2 x 2.
    (["--parallel.cp", "2", "--parallel.mp", "2", "--data.seq_len", "36"], 4, "data.seq_len = 36 is not divisible by "
     "2 x cp x mp = 8"),
    (["--parallel.cp", "2", "--parallel.mp", "1", "--data.seq_len", "38"], 2, "data.seq_len = 38 is not divisible by "
     "2 x cp = 4"),
    (["--parallel.cp", "4", "--parallel.mp", "2"], 12, "world size 12 is not divisible by mp * cp * dp_replicate = "
     "2 * 4 * 1 = 8"),
])
def test_a_context_parallel_job_that_cannot_cut_its_sequences_is_refused_in_one_line(overrides, world, said):
    from hybridpar.config import ConfigError, find_config, load_config
    from hybridpar.mesh.layout import MeshSizeError
    from hybridpar.preflight import check_values

    config = load_config(find_config("local"), overrides)
    with pytest.raises((ConfigError, MeshSizeError)) as info:
        check_values(config, world)
    assert said in str(info.value) and "\n" not in str(info.value), info.value
    fits = load_config(find_config("local"), overrides[:4] + ["--data.seq_len", "64"])
    if world != 12:
        check_values(fits, world)  # a seq_len the chunks divide passes


def _fake_checkpoint(folder: Path, damaged: bool = False) -> None:
    """A checkpoint folder as verify sees it: files and the manifest of their checksums."""
    from hybridpar.checkpoint.checksums import entry_of, write_manifest

    folder.mkdir(parents=True)
    files = {"params.json": b'{"dim": 64}', "train_state.json": b'{"step": 1}'}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    write_manifest(folder, {name: entry_of(data) for name, data in files.items()})
    if damaged:
        (folder / "train_state.json").write_bytes(b'{"step": 2}')


def test_verify_on_a_run_checkpoints_folder_checks_each_checkpoint(tmp_path, capsys):
    from hybridpar.cli import main

    def verify(path: Path) -> tuple[int, str]:  # in this process: the command's words, not its start-up
        code = main(["verify", str(path)])
        out = capsys.readouterr()
        return code, out.out + out.err

    checkpoints = tmp_path / "run" / "checkpoints"
    _fake_checkpoint(checkpoints / "step-00000010")
    _fake_checkpoint(checkpoints / "step-00000020")
    code, out = verify(checkpoints)
    assert code == 0, out
    assert f"{checkpoints}: 2 of 2 checkpoints ok; all ok" in out
    assert f"{checkpoints / 'step-00000010'}: 2 of 2 files ok; all ok" in out
    _fake_checkpoint(checkpoints / "step-00000030", damaged=True)
    code, out = verify(checkpoints)
    assert code == 1, out
    assert f"{checkpoints}: 2 of 3 checkpoints ok; NOT OK: step-00000030" in out
    code, out = verify(checkpoints / "step-00000020")  # one checkpoint, as before
    assert code == 0 and "checkpoints ok" not in out, out


@pytest.mark.parametrize("argv", [
    ["--model", "llama3_70b", "--gpus", "128", "--gpu", "h100", "--global-batch", "4Mtok"],
    ["--model", "llama2_7b", "--gpus", "16", "--global-batch", "256", "--param-dtype", "float32", "--compile",
     "--grad-sync", "every", "--seq-len", "2048", "--no-sequence-parallel"],
])
def test_the_plans_config_line_trains_what_was_planned(argv, tmp_path, capsys):
    """Pasted after `hybridpar train`, the best layout's config line sets every key the plan assumed."""
    import shlex

    from hybridpar.cli import build_parser, main
    from hybridpar.config import load_config

    report = tmp_path / "plan.json"
    assert main(["plan", *argv, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  config: "))[len("  config: "):]
    planned = json.loads(report.read_text())
    assert planned["best"] == line and planned["layouts"][0]["config"] == line
    best, w = planned["layouts"][0], planned["workload"]
    args, extra = build_parser().parse_known_args(["train", *shlex.split(line)])
    c = load_config(None, extra)
    preset = argv[argv.index("--model") + 1]
    assert (c.model.preset, c.data.seq_len, c.data.micro_batch_size) == (preset, w["seq_len"], w["micro_batch"])
    assert (c.parallel.mp, c.parallel.dp_shard, c.parallel.dp_replicate) == (
        best["mp"], best["dp_shard"], best["dp_replicate"])
    assert c.data.micro_batch_size * c.train.grad_accum * best["dp_shard"] * best["dp_replicate"] == \
        best["global_batch"] == (w["global_batch"] or best["global_batch"])
    assert (c.fsdp.param_dtype, c.fsdp.reduce_dtype) == (w["param_dtype"], w["reduce_dtype"])
    assert (c.fsdp.sharding_strategy, c.fsdp.activation_checkpointing) == (best["strategy"], best["ac"])
    assert c.fsdp.ac_every == (best["ac_every"] if best["ac"] == "selective" else 2)
    assert (c.train.grad_sync, c.train.compile, c.parallel.sequence_parallel) == (
        w["grad_sync"], w["compile"], best["sequence_parallel"])


# --- from the parser to a command and back: its exit code, or its failure --------------------------


def test_the_public_command_list_is_the_one_the_parser_offers():
    """hybridpar.cli.command_names() (what tests/test_docs.py checks documented commands against) is the
    list `hybridpar --help` offers, in its order."""
    from hybridpar.cli import build_parser, command_names

    offered = re.search(r"\{([^}]*)\}", build_parser().format_usage())  # usage: hybridpar ... {mesh,train,...}
    assert offered and list(command_names()) == offered[1].split(","), build_parser().format_usage()
    assert {"mesh", "train", "convert", "plan", "hang-report"} <= set(command_names())


def test_a_commands_return_value_is_the_exit_code(monkeypatch, tmp_path):
    from hybridpar import cli

    monkeypatch.setattr(cli, "cmd_verify", lambda args: 7)  # the parser registers the handler cli names
    assert cli.main(["verify", str(tmp_path)]) == 7


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_commands_mistake_is_the_clis_to_say_once(rank, monkeypatch, capsys):
    """A command raises its mistake; the CLI says it, once, on rank 0 (mesh sizes are wrong on every rank)."""
    from hybridpar import cli, reporting

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(reporting, "RANK_0_SPEAKS_S", 0.0)
    assert cli.main(["mesh", "--world", "4", "--mp", "3"]) == 2
    said = capsys.readouterr().err.splitlines()
    assert said == (["hybridpar: error: world size 4 is not divisible by mp * dp_replicate = 3 * 1 = 3; choose mp "
                     "and dp_replicate whose product divides 4 (divisors: [1, 2, 4])"] if rank == "0" else []), said


@pytest.mark.parametrize("error,code,says", [
    (RuntimeError("the unexpected"), 1, "hybridpar: internal error: RuntimeError: the unexpected (traceback: {logs}"
                                        "/rank-0.log; HYBRIDPAR_TRACEBACK=1 prints it here)"),
    (ValueError("a bad value"), 2, "hybridpar: error: a bad value (tracebacks: {logs}/rank-*.log)"),
], ids=["internal error", "bad input"])
def test_a_run_that_fails_once_it_has_a_folder_leaves_its_traceback_there(error, code, says, monkeypatch,
                                                                           tmp_path, capsys):
    """The trainer's failure reaches the command line with the run's logs/ (commands.RunFailed): the
    one line names the traceback written there; HYBRIDPAR_TRACEBACK=1 raises the error itself."""
    import hybridpar.train
    from hybridpar.cli import main

    def trainer(config):
        raise error

    monkeypatch.setattr(hybridpar.train, "Trainer", trainer)
    for key in ("WORLD_SIZE", "RANK", "HYBRIDPAR_TRACEBACK"):
        monkeypatch.delenv(key, raising=False)
    argv = ["train", "--output.run_dir", str(tmp_path / "run")]
    assert main(argv) == code
    assert capsys.readouterr().err.splitlines() == [says.format(logs=tmp_path / "run" / "logs")]
    assert f"{type(error).__name__}: {error}" in (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    monkeypatch.setenv("HYBRIDPAR_TRACEBACK", "1")
    with pytest.raises(type(error)) as raised:
        main(argv)
    assert raised.value is error
