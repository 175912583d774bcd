"""Every command README.md and docs/*.md show in their ```bash blocks is checked, so a documented
command cannot go stale unnoticed: the cheap ones run as written (in this process), the training
and checkpoint commands run on tiny settings (the slow test), and the rest (many processes, Slurm,
your data or downloads, the whole test suite) are at least parsed: the hybridpar argv by the real
parser and, for train and doctor, the config with its overrides by the real loader; the world
(torchrun's, 1 without a launcher) against the mesh's sizes (and, with pipeline stages, preflight's
checks of them); a script by `bash -n` or the compiler. A command this file does not
recognise fails. The same checks hold the links between the pages, the bounds the pages quote
against the tests' constants, and README's preset table against models/presets/."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ("python", "python3")
# Inputs only the reader has: their corpus, a Llama download, their own config or tokenizer file.
USER_INPUTS = ("/data/", "$MODEL", "~/models", "my_docs.jsonl", "my.toml", "tokenizer.model")
# Environment variables documented that hybridpar's own code does not read.
OUTSIDE_ENV = {"OMP_NUM_THREADS", "PYTHONPATH"}
# Commands the slow test runs (file, start of the command); other world-1 variants of them are parsed.
RUN_SLOW = [
    ("README.md", "python -m hybridpar train --config local --parallel.mp 1"),
    ("docs/checkpoints.md", "python -m hybridpar train --config local --parallel.mp 1 --checkpoint.resume true"),
    ("README.md", "hybridpar verify runs/local/checkpoints"),
    ("docs/checkpoints.md", "hybridpar verify runs/local/checkpoints"),
    ("README.md", "hybridpar generate --checkpoint runs/local/checkpoints"),
    ("README.md", "hybridpar convert runs/local/checkpoints"),
    ("docs/troubleshooting.md", "NCCL_ASYNC_ERROR_HANDLING=1 python3 -m hybridpar doctor --no-busbw"),
]
EXPECTED_EXIT = {"NCCL_ASYNC_ERROR_HANDLING=1 python3 -m hybridpar doctor --no-busbw": 1}  # the page shows it failing
LISTING_BEGIN, LISTING_END = "<!-- test_docs listing begins -->", "<!-- test_docs listing ends -->"


@dataclasses.dataclass
class Command:
    file: str  # relative to the repository
    line: int
    text: str  # as documented: continuations joined, the comment dropped
    env: dict[str, str]  # leading VAR=value assignments
    argv: list[str]  # with the block's shell variables substituted


@dataclasses.dataclass
class Check:
    command: Command
    action: str  # "run" (the fast test, in this process), "run-slow" (the slow test) or "parse"
    reason: str
    hybridpar: Optional[list[str]] = None  # the hybridpar argv, if the command runs hybridpar
    world: Optional[int] = None  # torchrun's number of processes


def documented_commands() -> list[Command]:
    commands = []
    for path in DOCS:
        name = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```bash":
                i += 1
                continue
            i += 1
            variables: dict[str, str] = {}
            while i < len(lines) and lines[i].strip() != "```":
                start, text = i + 1, lines[i].strip()
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1].rstrip() + " " + lines[i].strip()
                i += 1
                words = shlex.split(text, comments=True)
                if not words:
                    continue
                env = {}
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                    key, value = words.pop(0).split("=", 1)
                    env[key] = value
                if not words:  # a plain assignment: a shell variable the block's next commands use
                    variables.update(env)
                argv = [re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), w) for w in words]
                commands.append(Command(name, start, _comment_free(text), env, argv))
            i += 1
    return commands


def _comment_free(text: str) -> str:
    """The command as written, without its trailing comment (a # outside quotes)."""
    quote = None
    for k, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or text[k - 1] in " \t"):
            return text[:k].rstrip()
    return text.rstrip()


def _known_env() -> str:
    sources = [*ROOT.glob("hybridpar/**/*.py"), *ROOT.glob("launch/*.sh"), ROOT / ".ci" / "run"]
    return "\n".join(p.read_text() for p in sources)


def _script(path: str) -> Path:
    script = ROOT / path
    assert script.is_file(), f"{path} does not exist"
    return script


def _bash_n(path: str) -> None:
    result = subprocess.run(["bash", "-n", str(_script(path))], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _parse_hybridpar(argv: list[str], world: Optional[int], where: str) -> None:
    """The real parser takes the argv; train's and doctor's config loads with the overrides; the
    mesh's sizes tile the world: torchrun's, 1 without a launcher, or the dry run's --world."""
    from hybridpar.cli import build_parser, command_names
    from hybridpar.config import find_config, load_config
    from hybridpar.mesh.layout import resolve_sizes

    if "--help" in argv:  # argparse prints the help and exits: the subcommand must exist
        argv = [w for w in argv if w != "--help"][:1]
        assert not argv or argv[0] in command_names(), f"{where}: {argv}"
        return
    try:
        args, extra = build_parser().parse_known_args(argv)
    except SystemExit as exit_:
        raise AssertionError(f"{where}: hybridpar {' '.join(argv)}: the parser refuses it") from exit_
    if args.command in ("train", "doctor"):
        config = load_config(find_config(args.config) if args.config else None, extra)
        world = args.world if args.command == "train" and args.dry_run and args.world else world
        if world:
            p = config.parallel
            mp = getattr(args, "mp", None) or p.mp
            replicate = p.dp_replicate
            if replicate == -1 and p.dp_shard > 0:  # the dry run's (and launch/slurm.sh's) "the rest"
                replicate = world // (mp * p.dp_shard * p.cp * p.pp)
            resolve_sizes(world, mp, p.dp_shard, replicate, p.cp, p.pp)  # raises MeshSizeError naming the sizes
            if p.pp > 1:  # the stages against the model's layers and the batch, as preflight checks them
                from hybridpar.preflight import check_values

                check_values(config, world)
    else:
        assert not extra, f"{where}: hybridpar {' '.join(argv)}: unrecognised {extra}"
        if args.command in ("eval", "convert") and world:  # mp x dp ranks, ep of the dp ones
            from hybridpar.mesh.layout import ep_split

            ep_split(resolve_sizes(world, args.mp)[2], args.ep)


def classify(c: Command, known_env: str) -> Check:
    where = f"{c.file}:{c.line}"
    for key in c.env:
        assert key in OUTSIDE_ENV or key in known_env, f"{where}: {key} is read by nothing in hybridpar or launch/"
    argv = c.argv
    if not argv:
        return Check(c, "parse", "a shell variable the next commands use")
    hp, world = None, None
    if argv[0] == "hybridpar":
        hp = argv[1:]
    elif argv[0] in PYTHON and argv[1:3] == ["-m", "hybridpar"]:
        hp = argv[3:]
    elif argv[0] == "torchrun" or (argv[0] in PYTHON and argv[1:3] == ["-m", "torch.distributed.run"]):
        rest = argv[1:] if argv[0] == "torchrun" else argv[3:]
        nproc, nnodes, k = 1, 1, 0
        while k < len(rest) and rest[k] != "-m" and not rest[k].endswith(".py"):
            flag = rest[k].replace("_", "-")
            if flag in ("--nproc-per-node", "--nnodes"):
                value = int(rest[k + 1])
                nproc, nnodes = (value, nnodes) if flag == "--nproc-per-node" else (nproc, value)
            k += 1 if flag == "--standalone" else 2
        world = nproc * nnodes
        if rest[k] == "-m":
            assert rest[k + 1] == "hybridpar", f"{where}: torchrun of an unknown module {rest[k + 1]}"
            hp = rest[k + 2:]
        else:
            compile(_script(rest[k]).read_text(), rest[k], "exec")
            return Check(c, "parse", f"{world} processes for minutes: a benchmark (script exists and compiles)")
    elif argv[0] in PYTHON and argv[1:3] == ["-m", "hybridpar.evaluate"]:
        model = argv[argv.index("--model") + 1] if "--model" in argv[:-1] else None
        assert model == "hybridpar", f"{where}: python -m hybridpar.evaluate runs lm-eval over --model hybridpar"
        assert (ROOT / "hybridpar" / "evaluate" / "__main__.py").is_file()
        return Check(c, "parse", "lm-eval's command line over the hybridpar model (tests/evaluate runs it)")
    elif argv[0] in PYTHON and argv[1].endswith(".py"):
        compile(_script(argv[1]).read_text(), argv[1], "exec")
        return Check(c, "parse", "a benchmark: minutes of CPU (script exists and compiles)")
    elif argv[0] in PYTHON and argv[1:3] == ["-m", "pytest"]:
        setup = (ROOT / "setup.cfg").read_text()
        for marker in argv[argv.index("-m", 3) + 1:][:1] if "-m" in argv[3:] else []:
            assert re.search(rf"^    {marker}:", setup, re.M), f"{where}: marker {marker!r} is not in setup.cfg"
        for path in (w for w in argv[3:] if w.startswith("tests/")):
            assert (ROOT / path).exists(), f"{where}: no {path}"
        return Check(c, "parse", "the tests themselves (markers and paths exist)")
    elif argv[0] == "bash":
        _bash_n(argv[1])
        reason = {"launch/local.sh": "4 processes for minutes", ".ci/run": "installs, then the whole suite",
                  "bench/gpu/first_light.sh": "the GPU check (its CPU path runs in tests/bench/test_first_light.py, which parses its flags here)",
                  "launch/llama3_8b_128k.sh": "a 16-rank dry run with a rehearsal (tests/launch/test_scripts.py runs it)",
                  "launch/llama3_405b.sh": "a 512-rank dry run with a rehearsal (tests/launch/test_scripts.py runs it)",
                  "launch/ft_local.sh": "replica groups for minutes (tests/replicas/test_replica_groups.py runs it)"}
        return Check(c, "parse", reason.get(argv[1], "a Slurm job's dry run: a 128-rank rehearsal") + " (bash -n)")
    elif argv[0] == "sbatch":
        script = next(w for w in argv if w.endswith(".sh"))
        _bash_n(script)
        return Check(c, "parse", "needs Slurm (bash -n)")
    elif argv[0] == "pip":
        setup = (ROOT / "setup.cfg").read_text()
        for extra in (e for found in re.findall(r"\.\[([\w,]+)\]", " ".join(argv)) for e in found.split(",")):
            assert re.search(rf"^{extra} =", setup, re.M), f"{where}: no extra {extra!r} in setup.cfg"
        return Check(c, "parse", "changes the environment (extras exist in setup.cfg)")
    elif argv[0] == "tensorboard":
        assert "tensorboard" in (ROOT / "setup.cfg").read_text()
        return Check(c, "parse", "a server (a dependency in setup.cfg)")
    if hp is None:
        raise AssertionError(f"{where}: tests/test_docs.py does not know how to check `{c.text}`: teach it")
    if any(mark in " ".join(argv) for mark in USER_INPUTS):
        return Check(c, "parse", "needs your data or a download", hp, world)
    if world:
        return Check(c, "parse", f"torchrun of {world} processes", hp, world)
    if any(c.file == f and c.text.startswith(start) for f, start in RUN_SLOW):
        return Check(c, "run-slow", "tiny settings, in the slow test", hp)
    command = hp[0] if hp[0] != "--help" else ""
    if "--help" in hp or command == "mesh" or (command == "plan" and "cpu" not in hp):
        return Check(c, "run", "as written", hp)
    if command == "lighthouse":
        return Check(c, "parse", "a server until stopped (launch/ft_local.sh starts it in the slow test)", hp)
    if command == "train" and "--dry-run" in hp:
        return Check(c, "parse", "a large model's rehearsal: tens of seconds", hp)
    return Check(c, "parse", "a variant of a command the slow test runs", hp)


def all_checks(errors: Optional[list[str]] = None) -> list[Check]:
    """Every documented command classified and parsed; one that fails goes to `errors` (or raises)."""
    known, checks = _known_env(), []
    for command in documented_commands():
        try:
            checks.append(classify(command, known))
            if checks[-1].hybridpar is not None:
                # A command without a launcher runs as a world of one: its mesh must fit one process.
                _parse_hybridpar(checks[-1].hybridpar, checks[-1].world or 1, f"{command.file}:{command.line}")
        except Exception as error:  # noqa: BLE001 - every failing command is reported, not the first
            if errors is None:
                raise
            errors.append(f"{command.file}:{command.line}: `{command.text}`: {type(error).__name__}: {error}")
    return checks


def listing(checks: list[Check]) -> str:
    rows = ["| action | page | command | why |", "|---|---|---|---|"]
    for ch in checks:
        text = ch.command.text if len(ch.command.text) <= 90 else ch.command.text[:87] + "..."
        rows.append(f"| {ch.action} | {ch.command.file} | `{text.replace('|', '&#124;')}` | {ch.reason} |")
    return "\n".join(rows)


def test_every_documented_command_is_known_and_parses():
    errors: list[str] = []
    checks = all_checks(errors)
    print("\n" + listing(checks))
    assert not errors, "documented commands that fail their check:\n" + "\n".join(errors)
    assert sum(ch.action != "parse" for ch in checks) >= 10
    for path in DOCS:
        text = path.read_text()
        for indented in re.findall(r"\n\n((?:    (?:hybridpar|python|torchrun|bash|sbatch) [^\n]*\n)+)", text):
            raise AssertionError(f"{path.name}: a command outside a ```bash block: {indented.strip()}")
    page = (ROOT / "docs" / "development.md").read_text()
    shown = page.split(LISTING_BEGIN, 1)[1].split(LISTING_END, 1)[0].strip()
    assert shown == listing(checks), "docs/development.md's list of checked commands is out of date: " \
                                     "paste the listing printed above between its markers"


def test_the_cheap_documented_commands_run(tmp_path, monkeypatch, capsys):
    from hybridpar.cli import main

    monkeypatch.chdir(tmp_path)
    ran, failed = 0, []
    for check in all_checks([]):  # a command that fails its parse is reported by the test above
        if check.action != "run":
            continue
        try:
            code = main(check.hybridpar)
        except SystemExit as exit_:  # --help
            code = exit_.code
        out = capsys.readouterr()
        if code != 0 or not out.out.strip():
            failed.append(f"{check.command.file}:{check.command.line}: `{check.command.text}` exits {code}: {out.err[-1000:]}")
        ran += 1
    assert not failed, "\n".join(failed)
    assert ran >= 6


@pytest.mark.slow
def test_the_training_and_checkpoint_commands_run_on_tiny_settings(corpus, tmp_path, monkeypatch, capsys):
    """The README's one-process run and its resume (each a process of its own), then the verify,
    generate, convert and doctor commands (in this process, each a world of one): as written, with
    tiny settings appended to the runs (overrides come last, so they win), in a folder of their own
    that is HOME too, so runs/local and ~/.cache/hybridpar are this test's."""
    from hybridpar.cli import main

    home = tmp_path / "home"
    cache = home / ".cache" / "hybridpar"
    tiny = ["--model.preset", "debug", "--model.vocab_size", "512", "--data.tokenizer_vocab_size", "512",
            "--data.seq_len", "32", "--data.micro_batch_size", "2", "--data.source", corpus["source"],
            "--data.cache_dir", str(cache), "--data.val_fraction", "0", "--train.eval_every", "0",
            "--fsdp.param_dtype", "float32", "--train.peak_flops", "1e12", "--output.tensorboard", "false",
            "--output.plot", "false"]
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
    checks = [ch for ch in all_checks([]) if ch.action == "run-slow"]
    trains = [ch for ch in checks if ch.hybridpar[0] == "train"]
    others = [ch for ch in checks if ch.hybridpar[0] != "train"]
    assert len(trains) == 2 and len(others) >= 5, [ch.command.text for ch in checks]
    checkpoints = tmp_path / "runs" / "local" / "checkpoints"
    for check, steps in zip(trains, ("2", "3")):  # the first run, then its resume
        where = f"{check.command.file}:{check.command.line}: `{check.command.text}`"
        result = subprocess.run([sys.executable, "-m", "hybridpar", *check.hybridpar, *tiny, "--train.steps", steps],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{where}:\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
    rows = [json.loads(x) for x in (tmp_path / "runs" / "local" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and (checkpoints / "step-00000003").is_dir()
    assert "resumed from" in result.stdout
    # The pages verify the main job's last checkpoint, step 200: this run's newest stands in for it.
    shutil.copytree(checkpoints / "step-00000003", checkpoints / "step-00000200")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    failed, ran = [], [f"{ch.command.file}:{ch.command.line}: `{ch.command.text}`" for ch in trains]
    for check in others:
        where = f"{check.command.file}:{check.command.line}: `{check.command.text}`"
        argv = []
        for word in check.hybridpar:  # `~` and globs expanded as a shell would
            word = os.path.expanduser(word)
            argv += sorted(glob.glob(word)) or [word] if "*" in word else [word]
        saved = dict(os.environ)
        os.environ.update(check.command.env)
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        finally:  # the commands set hybridpar's environment defaults: leave none behind
            os.environ.clear()
            os.environ.update(saved)
        out = capsys.readouterr()
        if code != EXPECTED_EXIT.get(check.command.text, 0) or not out.out.strip():
            failed.append(f"{where} exits {code}:\n{out.out[-1500:]}{out.err[-1500:]}")
        ran.append(where)
    print("\nran " + "\nran ".join(ran))
    assert not failed, "\n".join(failed)
    assert (tmp_path / "local-hf" / "config.json").is_file()


# --- what the pages say, against the code and the tests --------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_between_the_pages_resolve():
    anchors = {}
    for path in [*DOCS, ROOT / "bench" / "README.md"]:
        anchors[path.resolve()] = {_slug(m) for m in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path.resolve()
            assert resolved.exists(), f"{path.name}: link to {target}: no such file"
            if anchor:
                assert anchor in anchors.get(resolved, set()), f"{path.name}: link to {target}: no such heading"
    for name in ("training", "data", "slurm", "checkpoints", "troubleshooting", "planner", "api", "benchmarks",
                 "architecture", "development", "security"):
        assert f"({name}.md)" in (ROOT / "docs" / "README.md").read_text(), f"docs/README.md does not list {name}.md"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200, "README.md is the front door: keep it short"


# (page, the sentence quoting the bound with {} for it, test file, the bound's pattern in it)
BOUNDS = [
    ("training.md", "world-size-1 run within {}", "train/test_trainer.py", r"^BOUND = (\S+)"),
    ("training.md", "to a world-1 run within {}", "train/test_workflow.py", r"check_close\(layout, errors, (\S+)\)"),
    ("training.md", "gradient at mp 2 and 4 equal mp 1's within {}", "models/test_llama.py", r"^BOUND = (\S+)"),
    ("checkpoints.md", "with the following losses equal within {}", "checkpoint/test_dcp.py",
     r'check_close\(f"mp2-dp2 -> \{target\}", errors, (\S+)\)'),
    ("planner.md", "are within {}% of the", "test_plan.py", r"assert abs\(planned / counted - 1\) < 0\.(\d+)"),
    ("planner.md", "(the test allows {}%)", "test_plan.py", r"^TOLERANCE = 0\.0?(\d+)"),
    ("data.md", "The tests hold a preparation process to {} MB", "data/test_bounded_memory.py", r"^PEAK_MB = (\d+)"),
    ("evaluation.md", "word and byte perplexities agree within {}", "evaluate/test_lm_eval.py", r"^BOUND = (\S+)"),
    ("evaluation.md", "every log-likelihood and perplexity agrees within {}", "evaluate/test_llama4_eval.py",
     r"^BOUND = (\S+)"),
    ("training.md", "5 steps' losses within {} of the same recipe", "train/test_float8_training.py", r"^LOSS_BOUND, \S+ = (\S+),"),
    ("training.md", "step 1's gradients within {} (measured", "train/test_float8_training.py", r"^LOSS_BOUND, \S+ = \S+, (\S+)"),
]


@pytest.mark.parametrize("page,sentence,test_file,pattern", BOUNDS, ids=[f"{b[0]}:{b[2]}" for b in BOUNDS])
def test_quoted_bounds_are_the_ones_the_tests_hold(page, sentence, test_file, pattern):
    match = re.search(pattern, (ROOT / "tests" / test_file).read_text(), re.M)
    assert match, f"tests/{test_file} no longer matches {pattern}"
    bound = match.group(1)
    text = " ".join((ROOT / "docs" / page).read_text().split())
    assert sentence.format(bound) in text, f"docs/{page} should quote {sentence.format(bound)!r} (tests/{test_file})"


def test_the_readme_preset_table_is_the_preset_files():
    from hybridpar.models.args import ModelArgs

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [x.strip() for x in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0].startswith("`") and cells[1] != "parameters":
            for i, name in enumerate(re.findall(r"`([\w.]+)`", cells[0])):
                rows[name] = [cell.split(", ")[i] if ", " in cell else cell for cell in cells[1:9]]
    files = sorted(p.stem for p in (ROOT / "models" / "presets").glob("*.json"))
    assert sorted(rows) == files, "README's preset table and models/presets/ differ"
    for name, (params, dim, layers, heads, kv, ffn, vocab, seq) in rows.items():
        a = ModelArgs.from_preset(name)
        n = a.num_params()
        number, unit = params[:-1], {"B": 1e9, "M": 1e6}[params[-1]]
        decimals = len(number.split(".")[1]) if "." in number else 0
        assert f"{n / unit:.{decimals}f}" == number, (name, n, params)
        shown = [dim, layers, heads, kv, ffn, vocab, seq]
        actual = [a.dim, a.n_layers, a.n_heads, a.n_kv_heads or a.n_heads, a.ffn_hidden_dim, a.vocab_size, a.max_seq_len]
        assert [int(x) for x in shown] == actual, (name, shown, actual)


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return None


# Spans of docs/api.md that call something other than the API itself (a tensor's method, a result's).
NOT_API = {"weight.full_tensor", "weight.to_local", "describe", "by_dim", "summary", "wire_bytes", "state_dict",
           "load_state_dict", "num_params", "release", "text", "to_dict", "run", "wait", "close", "update", "note",
           "check", "e.mfu", "seconds", "allowed", "arange", "work", "error_type"}


def test_the_api_page_names_what_exists_with_those_arguments():
    """Every `name(arguments)` docs/api.md shows resolves, in the module its section or paragraph is
    about, and every keyword argument it names is a parameter of that function or class."""
    import inspect

    sections: list[str] = []
    context: list[str] = []  # modules and classes the paragraph has named so far
    failures = []

    def learn(obj) -> None:
        if inspect.ismodule(obj):
            context.append(obj.__name__)
        elif getattr(obj, "__module__", None):
            context.append(obj.__module__)
            if inspect.isclass(obj):
                context.append(f"{obj.__module__}.{obj.__qualname__}")

    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if line.startswith("## "):
            sections = [m for m in re.findall(r"`([\w.]+)`", line) if m.startswith(("hybridpar", "models"))]
        if not line.strip():
            context = []
        for dotted in re.findall(r"`((?:hybridpar|models)\.[\w.]+|[A-Z]\w+)`", line):
            candidates = [dotted, *(f"{m}.{dotted}" for m in sections)]
            found = next((o for o in map(_resolve, candidates) if o is not None), None)
            if found is not None:
                learn(found)
        for name, arguments in re.findall(r"`([A-Za-z_][\w.]*)\(([^`]*?)\)(?:\s*->[^`]*)?`", line):
            if name in NOT_API or name.split(".")[-1] in NOT_API:
                continue
            prefixes = [*reversed(context), *sections, "hybridpar", "hybridpar.models.args", "hybridpar.models.llama"]
            obj = next((o for o in map(_resolve, [*(f"{m}.{name}" for m in prefixes), name]) if o is not None), None)
            if obj is None:
                failures.append(f"{name}: not found in {sections} or {context}")
                continue
            learn(obj)
            try:
                parameters = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                continue
            for piece in arguments.split(","):
                keyword = piece.split("=")[0].strip()
                if "=" in piece and keyword.isidentifier() and keyword not in parameters:
                    failures.append(f"{name}: no parameter {keyword!r} (it takes {list(parameters)})")
    assert not failures, "docs/api.md is out of date:\n" + "\n".join(failures)
