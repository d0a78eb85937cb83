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


@pytest.mark.timeout(420)
def test_chimera_matches_single_device(tmp_path) -> None:
    """One launch of 4 ranks (process start-up dominates on a small machine), two layouts:

    - p = 4 (rank r: down stage r + up stage 3-r; stage pairs {0, 3} and {1, 2}): SGD with validation and predict
      over the down pipeline (8 micro-batches); AdamW with accumulation and clipping (the norm counts each stage
      once); the recipe's GPT, whose embedding and head are tied across stages 0 and 3 (one object on ranks 0 and
      3, used by both pipelines).
    - 2 replicas x p = 2 (each rank holds both stages): the pairs sum, then the replicas average; a weight tied
      across the two stages; AdamW, clipping over the whole model.
    """
    cases = [
        TrainingCase(schedule="chimera", microbatches=8, check_grad_norms=False, predict=True),
        TrainingCase(schedule="chimera", microbatches=4, acc=2, clip=0.05, optimizer="adamw", validate=False,
                     check_grad_norms=False),
        TrainingCase(model="gpt", n_layers=7, schedule="chimera", microbatches=4, tied=True, optimizer="adamw",
                     clip=0.5, validate=False, check_grad_norms=False),
        TrainingCase(schedule="chimera", dp=2, microbatches=4, clip=0.05, optimizer="adamw", tied=True,
                     check_grad_norms=False),
        TrainingCase(schedule="chimera", dp=2, microbatches=4, acc=2, validate=False, check_grad_norms=False),
    ]
    check(launch("training", 4, cases, tmp_path, timeout=360), cases)
