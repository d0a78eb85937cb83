"""The spawn launcher (notebooks): Lightning starts the ranks, the main process gets the whole trained model."""

import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO, child_env

pytestmark = [pytest.mark.distributed, pytest.mark.parity]


@pytest.mark.timeout(240)
def test_spawned_ranks_return_every_stage_to_the_main_process():
    env = {k: v for k, v in child_env().items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "tests.distributed.spawn_check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0 and "SPAWN_PARITY_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
