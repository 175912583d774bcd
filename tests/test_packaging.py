"""What `pip install .` puts into site-packages: one top-level name, hybridpar, with the model as
hybridpar.models (models/ at the top of the checkout is its source) and the presets beside it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tests.wheel import ROOT, build_wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_one_top_level_package_with_the_model_inside(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"hybridpar"}, f"site-packages would get {sorted(tops)}"
    for needed in ("hybridpar/models/llama.py", "hybridpar/models/args.py",
                   "hybridpar/models/presets/llama3.1_8b.json", "hybridpar/configs/local.toml"):
        assert needed in names, f"{needed} missing from the wheel"
    # setup.cfg lists the packages (find: cannot see models/ as hybridpar.models): a new sub-package
    # of hybridpar/ must be added there, or the wheel goes without it
    tree = [p.relative_to(ROOT).as_posix() for pattern in ("**/*.py", "configs/*.toml")
            for p in sorted((ROOT / "hybridpar").glob(pattern))]
    tree += [f"hybridpar/{p.relative_to(ROOT).as_posix()}" for pattern in ("*.py", "presets/*.json")
             for p in sorted((ROOT / "models").glob(pattern))]
    missing = [name for name in tree if "__pycache__" not in name and name not in names]
    assert len(tree) > 100 and not missing, f"not in the wheel (setup.cfg's packages): {missing}"


def test_the_repository_holds_no_symlink():
    """models/ becomes hybridpar.models by setup.cfg's package_dir, not by a link: a link does not
    survive every checkout (an archive, a Windows clone) and a copy that follows it doubles it."""
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert len(listed.stdout.splitlines()) > 100 and links == [], f"symlinks in the repository: {links}"


def test_a_checkout_on_the_path_binds_its_own_models_folder(tmp_path):
    """PYTHONPATH=<checkout> (the tests' child processes) gets this checkout's models/ as
    hybridpar.models, whatever editable install of another checkout the interpreter has."""
    probe = ("import hybridpar, hybridpar.models.args as a, hybridpar.models.fields as f\n"
             "print(hybridpar.__file__); print(a.__file__); print(a.check_field is f.check_field)\n"
             "print(hybridpar.models.args is a); print(len(a.preset_names()))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:4] == [str(ROOT / "hybridpar" / "__init__.py"), str(ROOT / "models" / "args.py"), "True", "True"], lines
    assert int(lines[4]) == len(list((ROOT / "models" / "presets").glob("*.json"))), lines


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
