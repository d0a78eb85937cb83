"""What ``pip install`` does to a user's torch: the package states a range, never a pin, so an installed torch in
the range (a CUDA build, 2.14, 2.15) is kept. The dev pin lives in the Makefile, not in the package metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _torch_requirement() -> Requirement:
    """pyproject.toml's (what pip builds the metadata from; the dry run below checks what pip then does)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return torch_dep


def test_torch_is_a_range_that_holds_every_checked_release() -> None:
    from lightning_pipe._compat.torch import CHECKED_TORCH

    req = _torch_requirement()
    assert all(s.operator not in ("==", "===", "~=") for s in req.specifier), req  # never a pin
    for release in CHECKED_TORCH:
        assert req.specifier.contains(f"{release}.0"), (release, req)
    assert not req.specifier.contains("2.10.0") and not req.specifier.contains("2.16.0"), req
    assert req.specifier.contains(Version(torch.__version__).base_version)
    assert 'DEV_TORCH ?= 2.13.0' in (REPO / "Makefile").read_text()  # the dev environment's pin


@pytest.mark.timeout(180)
def test_installing_the_project_keeps_the_installed_torch(tmp_path: Path) -> None:
    """``pip install -e .`` (a dry run, in the venv running this test) installs nothing but the project. This
    machine's pip configuration caps torch at 2.14.1 (a machine setting, not the package's): skipped here, as a
    user's machine has no such cap."""
    pytest.importorskip("wheel", reason="--no-build-isolation builds with this venv's setuptools and wheel")
    setuptools = pytest.importorskip("setuptools")
    if Version(setuptools.__version__) < Version("68"):
        pytest.skip(f"setuptools {setuptools.__version__} < 68 (pyproject.toml's build requirement) in this venv")
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--quiet",
                           "--report", str(report), "-e", str(REPO)], env=env, capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    installs = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert "torch" not in installs, f"pip would replace torch {torch.__version__} by {installs.get('torch')}"
    assert set(installs) <= {"lightning_pipe", "lightning-pipe"}, installs
