"""No devices: what a user's install relies on, without installing anything (the installs
themselves, on fresh clones, are scripts/check_install.sh's, which CI runs): which Python
``scripts/python`` picks, and what the wheel ships."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _fake_python(path: pathlib.Path, name: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho {name} "$@"\n')
    path.chmod(0o755)


@pytest.mark.parametrize(
    ("env", "venv", "picked"),
    [
        ({}, True, "dotvenv"),  # a distribution's python3: install.sh made ./.venv
        ({}, False, "python3"),
        ({"VIRTUAL_ENV": "x"}, True, "python3"),  # an active venv wins over ./.venv
        ({"CONDA_PREFIX": "x"}, True, "python3"),
        ({"PYTHON": "ENV"}, True, "frompython"),
    ],
)
def test_scripts_python_picks_the_installed_python(tmp_path, env, venv, picked):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "python", repo / "scripts")
    if venv:
        _fake_python(repo / ".venv" / "bin" / "python", "dotvenv")
    _fake_python(tmp_path / "bin" / "python3", "python3")
    _fake_python(tmp_path / "frompython", "frompython")
    unset = ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX")
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    clean["PATH"] = f"{tmp_path / 'bin'}:{clean['PATH']}"
    clean.update({k: str(tmp_path / "frompython") if v == "ENV" else v for k, v in env.items()})
    done = subprocess.run(
        [str(repo / "scripts" / "python"), "-m", "pytest", "a b"],
        capture_output=True, text=True, env=clean, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert done.stdout == f"{picked} -m pytest a b\n"


def test_scripts_python_imports_its_checkout_from_the_folder_above(tmp_path):
    """From the folder above a clone named ``overlap``, ``python -c``/``-m`` find the clone
    folder itself first (cwd is on the path: an empty namespace package); ``scripts/python``
    puts its checkout first, so the package inside the clone is imported."""
    clone = tmp_path / "overlap"
    shutil.copytree(
        ROOT / "overlap", clone / "overlap", ignore=shutil.ignore_patterns("__pycache__")
    )
    (clone / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "python", clone / "scripts")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH")
    }
    env["PYTHON"] = sys.executable
    show = "import overlap; print(overlap.__file__)"
    done = subprocess.run([str(clone / "scripts" / "python"), "-c", show], capture_output=True,
                          text=True, env=env, cwd=tmp_path, check=True)  # fmt: skip
    assert done.stdout.strip() == str(clone / "overlap" / "__init__.py"), done.stdout


def test_the_wheel_ships_the_type_marker_and_the_license(tmp_path):
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT / "overlap", src / "overlap", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(src)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("overlap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "overlap/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("/LICENSE") for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Requires-Dist: numpy<2.4" in text
    assert "Provides-Extra: test" in text
