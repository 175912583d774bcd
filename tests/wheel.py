"""A wheel of the working tree, as a fresh clone would build it."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(tmp: Path) -> Path:
    """Builds from a copy of the sources: a build in the checkout reuses its build/ folder, whose stale
    files (a package setup.cfg no longer lists) would hide a wheel's missing module."""
    source = tmp / "src"
    for folder in ("hybridpar", "models"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (found,) = (tmp / "wheel").glob("hybridpar-*.whl")
    return found
