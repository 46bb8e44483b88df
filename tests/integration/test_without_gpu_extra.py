"""A contributor's install without the ``gpu`` extra (no torch, no nvidia-cudnn-frontend) runs the strict type check:
``mypy`` against this environment's packages with torch and cudnn hidden (their names are then Any)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_EXTRA = ("torch", "torchgen", "functorch", "cudnn", "nvidia_cudnn_frontend")


def test_mypy_passes_without_torch_and_cudnn(tmp_path: Path) -> None:
    mypy = Path(sys.prefix) / "bin" / "mypy"
    if not mypy.is_file() and not shutil.which("mypy"):
        pytest.skip("mypy is not installed (the dev extra)")
    packages = tmp_path / "site-packages"  # this environment's packages, less the gpu extra's
    packages.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.split("-")[0].split(".")[0] not in GPU_EXTRA:
            (packages / entry.name).symlink_to(entry)
    venv.create(tmp_path / "env", with_pip=False)
    env_python = tmp_path / "env" / "bin" / "python"
    purelib = subprocess.run([env_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "packages.pth").write_text(f"{packages}\n")
    probe = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('cudnn'), u.find_spec('sqlalchemy'))"
    found = subprocess.run([env_python, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert found[:2] == ["None", "None"] and found[2] != "None", found
    r = subprocess.run([mypy if mypy.is_file() else "mypy", "--python-executable", env_python,
                        "--cache-dir", tmp_path / "mypy-cache"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
