"""The launcher's ranks ([Note: forked ranks] in tests/distributed/zygote.py): a rank forked from the pre-imported
server sees what a fresh ``python -m tests.distributed.worker`` process would: the rank Lightning's and
torchmetrics' ``rank_zero_only`` read from the environment at import, its own session, the repository as its working
directory. (With ``LIGHTNING_PIPE_TEST_SUBPROCESS_RANKS=1`` the same test checks plain processes.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.distributed import launcher
from tests.distributed.scenarios.probe import ProbeCase

pytestmark = [pytest.mark.distributed, pytest.mark.compact]


@pytest.mark.timeout(300)
def test_forked_ranks_see_their_rank_session_and_directory(tmp_path: Path) -> None:
    results = launcher.launch("probe", 4, [ProbeCase(), ProbeCase()], tmp_path)
    for rank, runs in enumerate(results):
        for r in runs:
            assert r == {"ok": True, "rank": str(rank), "lightning_rank_zero": rank, "torchmetrics_rank_zero": rank,
                         "own_session": True, "cwd": str(launcher.REPO), "world_size": "4"}, r
    if os.environ.get("LIGHTNING_PIPE_TEST_SUBPROCESS_RANKS") != "1":
        assert launcher._forkserver is not None, "the launch ran on forked ranks"
