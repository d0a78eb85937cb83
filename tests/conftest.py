"""Isolation between tests: state that Lightning and torch.distributed keep per process, restored after each test.

The same fixtures as Lightning's own test suite (``tests_pytorch/conftest.py``): a Trainer sets ``RANK``/``WORLD_SIZE``
style variables and ``rank_zero_only.rank``, and a test that fails half-way may leave a default process group behind;
without these, the next test in the same pytest process would inherit them and pass or fail for the wrong reason.
"""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.lean_imports import skip_torchmetrics_extras

skip_torchmetrics_extras()  # before Lightning imports torchmetrics: [Note: lean test imports]

from lightning.pytorch.utilities import rank_zero as pl_rank_zero  # noqa: E402
from lightning_utilities.core import rank_zero as utilities_rank_zero  # noqa: E402

# Today Lightning re-exports lightning_utilities' function (one object); restore both in case they ever diverge.
_RANK_ZERO_ONLY = {id(fn): fn for fn in (pl_rank_zero.rank_zero_only, utilities_rank_zero.rank_zero_only)}


@pytest.fixture(autouse=True)
def restore_env_variables() -> Iterator[None]:
    """Put ``os.environ`` back exactly as it was before the test (values changed, added or removed)."""
    saved = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def restore_rank_zero_only() -> Iterator[None]:
    """``rank_zero_only.rank`` is a process-wide attribute a Trainer sets from its strategy's global rank."""
    saved = {key: getattr(fn, "rank", None) for key, fn in _RANK_ZERO_ONLY.items()}
    yield
    for key, fn in _RANK_ZERO_ONLY.items():
        if saved[key] is None:
            if hasattr(fn, "rank"):
                del fn.rank
        else:
            fn.rank = saved[key]


@pytest.fixture(autouse=True)
def teardown_process_group() -> Iterator[None]:
    """Destroy a default process group the test left (multi-rank tests run their ranks in child processes)."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``small_tmpfs("64k")``: a tmpfs of that size under ``tmp_path``, unmounted after the test (a real full disk);
    the test is skipped, saying why, where mounting is not permitted (it needs root)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a {size} tmpfs here ({done.stderr.strip() or 'mount failed'}); "
                        "test_checkpoint_integrity.py injects the failure of a full disk instead")
        mounted.append(where)
        return where

    yield mount
    gc.collect()  # a failed torch.save may leave its file open until collected: the disk would stay busy
    for where in mounted:
        done = subprocess.run(["umount", str(where)], capture_output=True, text=True)
        if done.returncode != 0:  # still busy: detach it now, freed when the last file closes
            subprocess.run(["umount", "--lazy", str(where)], check=False)
