"""Project-wide rules that a reviewer would otherwise have to check by eye."""

import ast
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
