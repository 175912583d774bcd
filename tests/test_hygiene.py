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
