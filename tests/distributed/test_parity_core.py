"""Parity: GPipe and 1F1B under the strategy vs the same LightningModule trained on one device."""

from __future__ import annotations

import itertools

import pytest

from tests.distributed.launcher import launch
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


def core_cases(dp: int) -> list[TrainingCase]:
    cases = []
    for schedule, acc, clip in itertools.product(("gpipe", "1f1b"), (1, 2), (None, 0.05)):
        cases.append(TrainingCase(schedule=schedule, dp=dp, acc=acc, clip=clip, steps=3,
                                  optimizer="adamw" if acc == 2 else "sgd",
                                  predict=(dp == 1 and acc == 1 and clip is None)))
    # Tied input/output weights held by the first and the last stage (GPT-2 style), with clipping and accumulation.
    cases.append(TrainingCase(schedule="1f1b", dp=dp, acc=2, clip=0.05, tied=True, optimizer="adamw",
                              check_grad_norms=False))
    # layers built on the meta device in configure_model, allocated per rank at setup (tied across stages)
    cases.append(TrainingCase(schedule="1f1b", dp=dp, model="meta", tied=True, clip=0.05, check_grad_norms=False))
    # gradient_clip_algorithm="value": elementwise, after the data-parallel average
    cases.append(TrainingCase(schedule="gpipe", dp=dp, acc=2, clip=0.002, clip_algo="value"))
    if dp > 1:
        # the data-parallel average after the schedule (overlap off), and switching between both ways every step
        cases.append(TrainingCase(schedule="1f1b", dp=dp, acc=2, clip=0.05, optimizer="adamw", dp_overlap=False,
                                  validate=False))
        cases.append(TrainingCase(schedule="1f1b", dp=dp, acc=1, steps=4, tied=True, dp_overlap="alternate",
                                  validate=False, check_grad_norms=False))
    return cases


@pytest.mark.parametrize("pp,dp", [(2, 1), (4, 1), (2, 2)], ids=["pp2", "pp4", "pp2xdp2"])
@pytest.mark.timeout(600)
def test_core_schedules_match_single_device(pp: int, dp: int, tmp_path) -> None:
    cases = core_cases(dp)
    results = launch("training", pp * dp, cases, tmp_path, timeout=420)
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)
