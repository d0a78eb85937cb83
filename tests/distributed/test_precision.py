"""Precision under the pipeline vs the same precision on one device; activation recomputation and offload stay
exact.

Tolerances: fp32 paths (recomputation, offload) must match to 1e-5 as everywhere. Reduced-precision compute
rounds differently on a micro-batch than on the whole batch (matmul shapes and accumulation order differ), so
after 3 steps parameters may differ by a few units in the last place of the compute type, measured here at
<= 1 ulp: we allow 2 ulps of the largest parameter (|p| < 1): bf16 (8-bit mantissa) 2 * 2**-8, fp16 (11-bit)
2 * 2**-11 -- for 16-mixed too, whose master weights are fp32 but whose matmuls round in fp16.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.parity import merge_replica, reference
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

BF16_TOL, FP16_TOL, FP32_TOL = 2 * 2**-8, 2 * 2**-11, 1e-5

# validation is off: this file compares parameters, logged losses and the fp16 loss scale
CASES = [
    (TrainingCase(precision="bf16-mixed", schedule="gpipe", validate=False), BF16_TOL),
    (TrainingCase(precision="bf16-mixed", schedule="1f1b", acc=2, clip=0.05, validate=False), BF16_TOL),
    (TrainingCase(precision="16-mixed", schedule="1f1b", clip=0.05, validate=False), FP16_TOL),
    # an overflow in the last stage only, at the second optimizer step: every rank must skip it
    (TrainingCase(precision="16-mixed", schedule="1f1b", inf_grad_at_step=1, steps=4, validate=False), FP16_TOL),
    (TrainingCase(precision="bf16-true", schedule="1f1b", validate=False), BF16_TOL),
    (TrainingCase(precision="16-true", schedule="gpipe", validate=False), FP16_TOL),
    (TrainingCase(recompute="all", schedule="1f1b", acc=2, clip=0.05, validate=False), FP32_TOL),
    (TrainingCase(recompute=2, schedule="gpipe", optimizer="adamw", validate=False), FP32_TOL),
    # offload ([Note: activation offload]): under split backward (the W step reads the host copies after I), and
    # with recomputation on the same layers (their inputs offloaded) and on others
    (TrainingCase(offload="all", schedule="zbv", validate=False), FP32_TOL),
    (TrainingCase(offload=[1, 2, 5], recompute=2, schedule="interleaved_1f1b", acc=2, clip=0.05, optimizer="adamw",
                  validate=False), FP32_TOL),
    (TrainingCase(model="gpt", n_layers=6, tied=True, optimizer="adamw", offload=2, recompute="all", schedule="zbv",
                  n_data=64, check_grad_norms=False, validate=False), FP32_TOL),
]


@pytest.mark.timeout(600)
def test_precisions_recompute_and_offload_match_single_device(tmp_path):
    cases = [case for case, _ in CASES]
    results = launch("training", 2, cases, tmp_path, timeout=450)
    for i, (case, tol) in enumerate(CASES):
        ref = reference(case)
        got = merge_replica(results, i)
        for name, want in ref["params"].items():
            assert got[name].dtype == want.dtype
            torch.testing.assert_close(got[name].float(), want.float(), atol=tol, rtol=0,
                                       msg=lambda m, case=case, name=name: f"{case} {name}: {m}")
        for rank_results in results:
            r = rank_results[i]
            # the logged loss is the unscaled micro-batch average, on every rank
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                       atol=max(tol, 1e-5) * 4, rtol=0)
            # fp16: every rank's scaler moved exactly like the single-device one (skip + backoff at the overflow)
            assert r["scales"] == ref["scales"]
            assert bool(r["scales"]) == (case.precision == "16-mixed"), "a loss scale exactly when fp16 AMP"
        # (a rank may pack nothing: a recomputed and offloaded stage's first layer keeps only the stage's input)
        packed = sum(rank_results[i]["offloaded_tensors"] for rank_results in results)
        assert (packed > 0) == (case.offload != "none"), f"{case}: the offload hooks ran where asked"
    overflow = next(i for i, (c, _) in enumerate(CASES) if c.inf_grad_at_step is not None)
    assert results[0][overflow]["scales"][:2] == [2.0**16, 2.0**15]  # the overflow step backed off, once
