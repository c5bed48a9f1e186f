"""The wheel: built from the tracked sources, installed in a fresh venv, scanlang.backends and
scanlang.recipes import from it (backends/ and recipes/ live at the repo root)."""
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"scanlang": "scanlang", "backends": "scanlang/backends", "recipes": "scanlang/recipes"}


def _tracked_python_files():
    out = subprocess.run(["git", "ls-files", "scanlang", "backends", "recipes"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: cannot list the tracked sources")
    return [p for p in out.stdout.split() if p.endswith(".py")]


def test_wheel_installs_and_imports_backends_and_recipes(tmp_path):
    files = _tracked_python_files()
    src = tmp_path / "src"
    for rel in files + ["pyproject.toml", "README.md"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, src / rel)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)],
                   check=True, capture_output=True)
    wheel = next(dist.glob("scanlang-*.whl"))
    import zipfile
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in files:
        top, _, rest = rel.partition("/")
        assert f"{PACKAGE_DIRS[top]}/{rest}" in names, f"{rel} is missing from the wheel (pyproject packages list)"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    # torch, sympy, numpy come from this interpreter's site-packages; scanlang only from the wheel
    # (an editable install here is a .pth finder, which PYTHONPATH entries do not process).
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"] + os.pathsep + sysconfig.get_paths()["platlib"])
    code = ("import scanlang, scanlang.backends.reference, scanlang.recipes; "
            "print(scanlang.__file__); print(scanlang.backends.reference.__file__); print(scanlang.recipes.__file__)")
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, env=env, cwd=tmp_path)
    for line in out.stdout.split():
        assert str(env_dir) in line, f"imported from outside the fresh venv: {line}"
