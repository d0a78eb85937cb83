"""Issue 24: a new length every batch and micro-batches of their own length (``trim_microbatch``) cost no shape
inference and equal one device (fp32, every parameter) under 1F1B, interleaved 1F1B, ZB-V and DualPipeV, with
validation and predict; data parallel 2 runs in test_hardening.py's 4-rank launch."""

from __future__ import annotations

import pytest

from lightning_pipe._compat import stage_shapes
from tests.distributed.launcher import launch
from tests.distributed.scenarios.hardening import HardeningCase
from tests.distributed.test_hardening import assert_no_reinference, assert_parity
from tests.torch_tiers import SPLIT_BACKWARD_SCHEDULES, refused

pytestmark = [pytest.mark.distributed]

TRIM = dict(model="lm_trim", microbatches=4, batch=8, loss="sum_count", pad_label=-100, steps=4)
CASES = [
    HardeningCase(**TRIM, schedule="1f1b", validate=True, predict=True),
    HardeningCase(**TRIM, schedule="interleaved_1f1b", stages_per_rank=2),
    HardeningCase(**TRIM, schedule="zbv", predict=True),
    HardeningCase(**TRIM, schedule="dualpipev", validate=True),
    # one shape per batch (no trimming), a new one every batch, under a multi-stage schedule
    HardeningCase(**{**TRIM, "model": "lm"}, schedule="interleaved_1f1b", stages_per_rank=2, validate=True),
]
if refused("split_backward"):  # restricted torch tier (tests/unit/test_compat.py)
    CASES = [case for case in CASES if case.schedule not in SPLIT_BACKWARD_SCHEDULES]
if not stage_shapes.SUPPORTED:  # torch 2.11: shapes are not planned (a new one re-infers), nothing to trim with
    CASES = [case for case in CASES if case.model != "lm_trim"]


@pytest.mark.compact  # make test-torch: on every supported torch
@pytest.mark.timeout(900)
def test_pp2_new_lengths_and_trimmed_microbatches_match_one_device(tmp_path) -> None:
    results = launch("hardening", 2, CASES, tmp_path, timeout=600)
    for i, case in enumerate(CASES):
        assert_parity(results, i, case)
        for rank in results:
            assert_no_reinference(rank[i]["inferences"], case.validate)
