"""Chimera (two pipelines in opposite directions on the same ranks) vs the same LightningModule on one device.

[Note: Chimera placement and semantics] in lightning_pipe/schedules/chimera.py: after the stage-pair gradient sum a
step is plain mini-batch training, so the parity check is the one every synchronous schedule passes (fp32, 1e-5).
Ranks r and p-1-r hold copies of the same two stages: they must also agree exactly with each other.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


def check(results: list[list[dict[str, Any]]], cases: list[TrainingCase]) -> None:
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)
        # the two copies of each stage (ranks r and p-1-r of one replica) are bit-identical
        by_topology = {tuple(rank[i]["topology"]): rank[i]["params"] for rank in results}
        p = len(by_topology) // case.dp
        for (dp_rank, pp_rank), params in by_topology.items():
            mirror = by_topology[(dp_rank, p - 1 - pp_rank)]
            assert sorted(params) == sorted(mirror)
            for name, value in params.items():
                torch.testing.assert_close(value, mirror[name], atol=0, rtol=0)


@pytest.mark.timeout(300)
def test_chimera_p2_matches_single_device(tmp_path) -> None:
    """p = 2: each rank holds both stages (rank 0: down 0 + up 1; rank 1: down 1 + up 0). SGD; AdamW with
    accumulation and clipping (the norm counts each stage once); a weight tied across the two stages."""
    cases = [
        TrainingCase(schedule="chimera", microbatches=4, check_grad_norms=False, predict=True),
        TrainingCase(schedule="chimera", microbatches=4, acc=2, clip=0.05, optimizer="adamw", validate=False,
                     check_grad_norms=False),
        TrainingCase(schedule="chimera", microbatches=4, tied=True, optimizer="adamw", clip=0.05, validate=False,
                     check_grad_norms=False),
    ]
    check(launch("training", 2, cases, tmp_path, timeout=240), cases)
