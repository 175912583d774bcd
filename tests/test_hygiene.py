"""Project-wide rules that a reviewer would otherwise have to check by eye."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python_files():
    for folder in ("hybridpar", "models", "bench", "tests"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_torch_load_uses_weights_only():
    offenders, seen = [], 0
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                seen += 1
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert seen >= 3, "the check found no torch.load calls: it is not looking where the code is"
    assert not offenders, f"torch.load without weights_only=True: {offenders}"


def test_no_file_is_unpickled_without_a_restriction():
    """docs/security.md: outside hybridpar/safe_pickle.py no pickle.load(s), no DCP FileSystemReader
    (its read_metadata is a plain pickle.load), and every Unpickler subclass restricts find_class."""
    offenders, seen = [], {"pickle": 0, "reader": 0, "unpickler": 0}
    for folder in ("hybridpar", "models", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            # the restricted unpickler itself, and its benchmark's baseline (bytes it pickled itself)
            exempt = where in ("hybridpar/safe_pickle.py", "bench/safe_pickle.py")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pickle"
                        and node.attr in ("load", "loads")):
                    seen["pickle"] += 1
                    offenders += [] if exempt else [f"{where}:{node.lineno} pickle.{node.attr}"]
                if isinstance(node, ast.Call):
                    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    if name == "FileSystemReader":
                        seen["reader"] += 1
                        offenders += [] if exempt else [f"{where}:{node.lineno} DCP's FileSystemReader"]
                if isinstance(node, ast.ClassDef) and any(
                        (isinstance(b, ast.Attribute) and b.attr == "Unpickler") for b in node.bases):
                    seen["unpickler"] += 1
                    if not any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
                        offenders.append(f"{where}:{node.lineno} {node.name} does not restrict find_class")
    assert seen["unpickler"] >= 2, f"the check found no unpicklers: it is not looking where the code is ({seen})"
    assert not offenders, "unrestricted unpickling (use hybridpar.safe_pickle): " + ", ".join(offenders)



# argparse's own attributes, which change between Python versions: the CLI keeps registries of its own
# (hybridpar.cli: each parser's flags, the commands by name, command_names()).
ARGPARSE_PRIVATES = {"_option_string_actions", "_subparsers", "_group_actions", "_actions", "_defaults",
                     "_registries", "_positionals", "_optionals", "_action_groups", "_name_parser_map",
                     "_choices_actions", "_mutually_exclusive_groups", "_get_formatter", "_get_values"}


def _argparse_privates(source: str, where: str) -> list[str]:
    return [f"{where}:{node.lineno} .{node.attr}" for node in ast.walk(ast.parse(source, where))
            if isinstance(node, ast.Attribute) and node.attr in ARGPARSE_PRIVATES]


def test_nothing_reaches_into_argparse_privates():
    """hybridpar/, models/, bench/, tests/ and launch/'s scripts use argparse's public API only."""
    planted = _argparse_privates("build_parser()._subparsers._group_actions[0].choices", "x.py")
    assert sorted(planted) == ["x.py:1 ._group_actions", "x.py:1 ._subparsers"], planted
    offenders, parsers = [], 0
    for path in _python_files():
        text = path.read_text()
        parsers += text.count(".add_argument(")
        offenders += _argparse_privates(text, path.relative_to(ROOT).as_posix())
    for path in sorted((ROOT / "launch").glob("*.sh")):  # their embedded Python, as text
        offenders += [f"launch/{path.name}: .{name}" for name in sorted(ARGPARSE_PRIVATES)
                      if f".{name}" in path.read_text()]
    assert parsers > 100, f"the check found {parsers} add_argument calls: it is not looking where the CLI is"
    assert not offenders, f"argparse's private attributes (keep a registry of your own): {offenders}"

# --- the house's structure: imports of hybridpar/ and models/, read with ast ---------------------

MAX_LINES = 450


def _module_files() -> dict[str, Path]:
    """Every module of hybridpar/ and models/ by its dotted name (a package by its __init__.py)."""
    files = {}
    for folder in ("hybridpar", "models"):
        # models/ installs as hybridpar.models (setup.cfg's package_dir)
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = ("hybridpar",) + parts if folder == "models" else parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imports(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of the house it imports, anywhere in it (a function's lazy import too)."""
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases = [a.name for a in node.names]
                names: list = []
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                bases, names = [base], [a.name for a in node.names]
            else:
                continue
            for base in bases:
                # `from package import module` imports the module; `from module import name`, the module
                subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in files]
                targets.update(subs or [m for m in [base] if m in files])
        graph[name] = targets - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_house_has_no_import_circle():
    graph = _imports(_module_files())
    assert graph["hybridpar.train.trainer"], "the check found no imports: it is not reading the code"
    circles = [sorted(c) for c in _circles(graph)]
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_no_file_of_hybridpar_or_models_is_over_the_ceiling():
    lengths = {name: len(path.read_text().splitlines()) for name, path in _module_files().items()}
    assert len(lengths) > 50, "the check found few modules: it is not looking where the code is"
    over = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines (split them by what they do): {over}"


def _closure(graph: dict[str, set[str]], start) -> set[str]:
    """The modules `start` imports, directly or through others, and `start` itself."""
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def test_models_import_nothing_above_parallel_and_mesh():
    """models/ is a folder at the top of the checkout (installed as hybridpar.models), but the model stands on hybridpar.parallel and hybridpar.mesh.device: it
    may import them, what they import, and a module that needs nothing besides (hybridpar.mesh.ranks, say);
    not one that brings more under the model (config, data, checkpoint, train)."""
    graph = _imports(_module_files())
    base = _closure(graph, [m for m in graph if m.startswith("hybridpar.parallel")] + ["hybridpar.mesh.device"])
    models = [m for m in graph if m == "hybridpar.models" or m.startswith("hybridpar.models.")]
    assert "hybridpar.models.llama" in models and graph["hybridpar.models.llama"], "the check found no models/ imports"
    above = {f"{m} -> {t} (which brings {sorted(_closure(graph, [t]) - base - {t})})"
             for m in models for t in graph[m]
             if t.startswith("hybridpar") and t not in models and t not in base
             and not _closure(graph, [t]) - {t} - set(models) <= base}
    assert not above, f"models/ imports above hybridpar.parallel and hybridpar.mesh.device: {sorted(above)}"


def test_nothing_imports_models_by_its_folder_name():
    """models/ installs as hybridpar.models only: an `import models` works in a checkout and nowhere
    else (and would load the model a second time, as other classes)."""
    pattern = re.compile(r"^\s*(from|import)\s+models\b", re.M)
    files = [p for folder in ("hybridpar", "models", "bench", "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 150, "the check found few files"
    offenders = sorted(str(p.relative_to(ROOT)) for p in files if pattern.search(p.read_text()))
    assert not offenders, f"import hybridpar.models, not models: {offenders}"


def test_the_fast_paths_import_no_checkpoint_module():
    """hybridpar.fastpaths sits below hybridpar.checkpoint, which uses it."""
    graph = _imports(_module_files())
    arrows = {(m, t) for m, targets in graph.items() if m.startswith("hybridpar.fastpaths")
              for t in targets if t.startswith("hybridpar.checkpoint")}
    assert not arrows, f"fast paths importing checkpoint/: {sorted(arrows)}"


# State a module fills as it runs (an empty container or a weak dictionary bound at import, a `global`
# rebound) belongs to an object that owns it, where one can. Kept, and why:
KEPT = {("hybridpar/mesh/ranks.py", "_STARTS"): "a Start per process group, keyed weakly by the group it belongs to "
                                                "(torch gives a group no place of its own for it)",
        ("hybridpar/data/sources.py", "_SAID"): "what a walk of the sources noted, said once a process whatever "
                                                "walks them (tests/data/test_exactly_once.py holds it)"}
_CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakKeyDictionary",
               "WeakValueDictionary", "WeakSet"}


def _module_state(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of each module-level binding of an empty container, and of each `global` statement."""
    found = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        empty_literal = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not (
            getattr(value, "keys", None) or getattr(value, "elts", None))
        called = isinstance(value, ast.Call) and not value.args and not value.keywords and (
            getattr(value.func, "id", None) in _CONTAINERS or getattr(value.func, "attr", None) in _CONTAINERS)
        if empty_literal or called:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(ast.unparse(target), node.lineno) for target in targets]
    found += [(", ".join(node.names), node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Global)]
    return found


def test_no_module_keeps_state_it_fills_as_it_runs():
    offenders, kept = [], 0
    for folder in ("hybridpar", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            for name, line in _module_state(ast.parse(path.read_text(), where)):
                if (where, name) in KEPT:
                    kept += 1
                else:
                    offenders.append(f"{where}:{line} {name}")
    assert kept == len(KEPT), "the check did not find the state it keeps: it is not reading the code"
    assert not offenders, f"module-level state filled at run time; give it to an object that owns it: {offenders}"


def test_every_name_the_package_face_lists_resolves():
    """hybridpar/__init__.py hands names on lazily: each must still be where it looks."""
    import hybridpar

    assert [name for name in hybridpar.__all__ if getattr(hybridpar, name, None) is None] == []


# docs/development.md, "Speaking": print() is for what a command was asked to print. The command layer prints;
# so do these command bodies (their output is the command's answer), and a report written to the stream
# its caller passes (print(..., file=out)). Everything else logs (hybridpar.progress).
COMMAND_LAYER = {"hybridpar/cli/__init__.py", "hybridpar/cli/commands.py",  # the parser, what each command does
                 "hybridpar/cli/incidents_command.py",  # launch/slurm.sh's incidents command
                 "hybridpar/reporting.py"}  # and how a command says it failed
COMMAND_OUTPUT = {("hybridpar/plan/cpu.py", "<module>")}
TERMINAL = {"hybridpar/progress.py"}  # the handler that writes the records of the command line (log_to_terminal)


def _speakers(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, what) of each print() and sys.stdout/sys.stderr write in `path`."""
    found = []

    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                f = child.func
                if isinstance(f, ast.Name) and f.id == "print":
                    to = next((k.value for k in child.keywords if k.arg == "file"), None)
                    if not isinstance(to, ast.Name):  # print(..., file=out): the caller's stream
                        found.append((function, child.lineno, "print()"))
                elif (isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute)
                      and f.value.attr in ("stdout", "stderr") and isinstance(f.value.value, ast.Name)
                      and f.value.value.id == "sys"):
                    found.append((function, child.lineno, f"sys.{f.value.attr}.write()"))
            walk(child, inner)

    walk(ast.parse(path.read_text(), str(path)), "<module>")
    return found


def test_library_code_logs_instead_of_printing():
    offenders, allowed = [], 0
    for folder in ("hybridpar", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for function, line, what in _speakers(path):
                where = path.relative_to(ROOT).as_posix()
                if where in COMMAND_LAYER | TERMINAL or (where, function) in COMMAND_OUTPUT:
                    allowed += 1
                else:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} {what} in {function}")
    assert allowed >= 10, "the check found no print() in the command layer: it is not looking where the code is"
    assert not offenders, ("library code speaks through logging (log = logging.getLogger(__name__), or "
                           f"hybridpar.progress.note), not print: {offenders}")


def test_the_pipeline_lives_in_one_place():
    """Everything that pushes a batch through the model asks the step runner (hybridpar.pipeline.runner):
    no training module branches on the pipeline (an engine that may be None, pp compared with 1); the
    Trainer composes parts and stays well under the ceiling."""
    files = {name: path for name, path in _module_files().items() if name.startswith("hybridpar.train.")}
    assert "hybridpar.train.trainer" in files, "the check found no training module"
    branch = re.compile(r"engine is (not )?None|\bpp\s*(==|!=|>|>=|<|<=)\s*1\b|\.pp\s*(==|!=|>|>=|<|<=)")
    found = {name: line.strip() for name, path in files.items() for line in path.read_text().splitlines()
             if branch.search(line)}
    assert not found, f"pipeline branches outside hybridpar.pipeline: {found}"
    lines = len(files["hybridpar.train.trainer"].read_text().splitlines())
    assert lines < 300, f"train/trainer.py has {lines} lines: move what a part owns into the part"
