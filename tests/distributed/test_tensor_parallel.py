"""Tensor parallelism per stage (``tensor_parallel_size``): pipeline 2 x tensor 2 equals one device.

One 4-rank launch: each stage's layers split by the module's ``parallelize_layer`` hook (column-wise input
projection, column-wise / row-wise MLPs; LayerNorms, a row-wise bias and the head replicated), with gradient
accumulation and global-norm clipping (split gradients summed over the tensor group, replicated ones counted once),
then what is refused.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.launcher import launch_runs
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

TRAINING = [
    TrainingCase(model="tp", schedule="1f1b", tp=2, acc=2, clip=0.05, optimizer="adamw"),
    # a second Trainer (predict, validate) on the already split module; a tiny clip: every step is clipped
    TrainingCase(model="tp", schedule="gpipe", tp=2, acc=3, steps=2, clip=0.01, predict=True),
    # two stages per rank: each tensor rank's P2P partner is the same tensor rank of the next stage
    TrainingCase(model="tp", schedule="interleaved_1f1b", stages_per_rank=2, tp=2, acc=2, clip=0.05,
                 validate=False),
]
ERRORS = [
    # no parallelize_layer hook
    (TrainingCase(model="toy", tp=2, steps=1, validate=False, expect_error=True), "parallelize_layer"),
    # tied weights would be silently untied by a plan
    (TrainingCase(model="toy", tied=True, tp=2, steps=1, validate=False, check_grad_norms=False,
                  expect_error=True), "tied parameters"),
]


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    runs: list[tuple[str, Any]] = [("training", case) for case in TRAINING]
    runs += [("training", case) for case, _ in ERRORS]
    return launch_runs(4, runs, tmp_path_factory.mktemp("tp") / "out", timeout=300)


@pytest.mark.timeout(400)
def test_pipeline2_x_tensor2_matches_single_device(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    for i, case in enumerate(TRAINING):
        for rank, res in enumerate(pp2_tp2):
            r = res[i]
            assert r["tp_rank"] == rank % 2 and r["topology"] == (0, rank // 2)  # [Note: rank order]
            assert r["sharded_params"] > 0, "the hook split this rank's layers"
        assert_case_parity(pp2_tp2, i, case)


@pytest.mark.timeout(400)
def test_tensor_parallel_refuses_what_it_cannot_do(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    for i, (_, needle) in enumerate(ERRORS, start=len(TRAINING)):
        for res in pp2_tp2:
            assert not res[i]["ok"] and needle in res[i]["error"], res[i]
            assert "tensor_parallel_size" in res[i]["error"]
