"""What `pip install .` puts into site-packages: one top-level name, hybridpar, with the model as
hybridpar.models (models/ at the top of the checkout is its source) and the presets beside it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, timeout=300)
    (found,) = out.glob("hybridpar-*.whl")
    return found


def test_the_wheel_holds_one_top_level_package_with_the_model_inside(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"hybridpar"}, f"site-packages would get {sorted(tops)}"
    for needed in ("hybridpar/models/llama.py", "hybridpar/models/args.py",
                   "hybridpar/models/presets/llama3.1_8b.json", "hybridpar/configs/local.toml"):
        assert needed in names, f"{needed} missing from the wheel"


@pytest.mark.slow
def test_installed_into_a_fresh_venv_hybridpar_models_imports_and_models_does_not(wheel, tmp_path):
    venv = tmp_path / "venv"
    # the system's packages (torch, numpy) are visible; hybridpar itself comes from the wheel
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
                   check=True, timeout=300)
    probe = ("import hybridpar, hybridpar.models.args as a; print(hybridpar.__file__); "
             "print(sorted(a.preset_names())[:1])\n"
             "try:\n    import models\nexcept ModuleNotFoundError:\n    print('no models')\n")
    out = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert str(venv) in lines[0], f"hybridpar came from {lines[0]}, not the venv"
    assert lines[1].startswith("['") and lines[2] == "no models", out.stdout
