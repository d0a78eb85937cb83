"""Tensor parallelism per stage (``tensor_parallel_size``): pipeline 2 x tensor 2 equals one device.

One 4-rank launch: each stage's layers split by the module's ``parallelize_layer`` hook (column-wise input
projection, column-wise / row-wise MLPs; LayerNorms, a row-wise bias and the head replicated), with gradient
accumulation and global-norm clipping (split gradients summed over the tensor group, replicated ones counted once),
under every schedule of ``TENSOR_PARALLEL_SCHEDULES`` (the split input/weight backward of the zero-bubble family
included), then a checkpoint (whole tensors gathered per stage) that resumes exactly and loads on one device, then what
is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pipe import checkpoint as ckpt_lib
from tests.distributed.launcher import launch_runs
from tests.distributed.parity import ATOL, assert_case_parity, assert_same, merge_replica
from tests.distributed.scenarios import CheckpointCase, TrainingCase
from tests.distributed.scenarios.checkpoint import run_reference
from tests.distributed.scenarios.training import run_training
from tests.distributed.test_chimera import check as chimera_check
from tests.distributed.test_pipedream import check as pipedream_check
from tests.distributed.test_precision import BF16_TOL, FP16_TOL
from tests.distributed.test_seed_schedules import delayed_reference, max_difference

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

# a zero-bubble order written out by hand (p = 2, m = 4): every backward split into I and W, W deferred on rank 1
ZB_BY_HAND = [["0F0", "0F1", "0F2", "0F3", "0I0", "0W0", "0I1", "0W1", "0I2", "0W2", "0I3", "0W3"],
              ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3", "1W2", "1W3"]]
TRAINING = [
    TrainingCase(model="tp", schedule="1f1b", tp=2, acc=2, clip=0.05, optimizer="adamw"),
    # a second Trainer (predict, validate) on the already split module; a tiny clip: every step is clipped
    TrainingCase(model="tp", schedule="gpipe", tp=2, acc=3, steps=2, clip=0.01, predict=True),
    # two stages per rank: each tensor rank's P2P partner is the same tensor rank of the next stage; every layer
    # recomputed in the backward (its tensor-parallel all-reduces run again, in the same order on both ranks)
    TrainingCase(model="tp", schedule="interleaved_1f1b", stages_per_rank=2, tp=2, acc=2, clip=0.05,
                 recompute="all", validate=False),
    # split input/weight backward ([Note: tensor parallel stages]): DTensor's all-reduces run in the I pass (the
    # input gradient of a column-wise layer), in the same action order on both tensor ranks of a stage. V placement
    # (rank 0 holds the first and the last stage), with validation and AdamW ...
    TrainingCase(model="tp", schedule="zbv", stages_per_rank=2, tp=2, acc=2, clip=0.05, optimizer="adamw"),
    # ... DualPipeV's overlapped F/B actions, the interleaved ZB-H1, a hand-written I/W action list
    TrainingCase(model="tp", schedule="dualpipev", stages_per_rank=2, tp=2, acc=2, clip=0.05, validate=False),
    TrainingCase(model="tp", schedule="zb_h1", stages_per_rank=2, tp=2, acc=2, clip=0.05, validate=False),
    TrainingCase(model="tp", schedule="custom", microbatches=None, tp=2, acc=2, clip=0.05, validate=False,
                 schedule_options={"actions": ZB_BY_HAND}),
    # breadth-first over virtual stages (whole backward); clipping by value (each rank clamps its parts)
    TrainingCase(model="tp", schedule="looped_bfs", stages_per_rank=2, tp=2, clip=0.02, clip_algo="value",
                 validate=False),
]
# bf16-mixed (fp32 weights, bf16 compute) against one device in bf16-mixed: not bit-equal, because a row-wise layer
# all-reduces bf16 partial sums (each tensor rank's half of every dot product rounded to bf16, then their sum rounded
# again) where one device rounds each whole dot product once. So the parameters get test_precision.py's bf16 bound,
# 2 bf16 ulps of the largest |parameter| (~1 here): measured 5e-4 after 3 plain SGD steps (no clipping, which would
# shrink every update and hide the difference), the first logged loss differing by 6e-4 (one device: exact in bf16
# without tensor parallelism).
# fp16-mixed, the same way within test_precision.py's 2 fp16 ulps, and the loss scale must move exactly as on one
# device: the scaler unscales each rank's parts (lightning/precision.py). It starts at 2**10: at torch's 2**16 this
# model's whole-batch backward overflows on one device in the first step (the pipeline's per-micro-batch losses do
# not), and the runs would differ by a skipped step, not by rounding. Measured: 9e-5 (1f1b), 1e-6 (zbv, clipped).
BF16 = [TrainingCase(model="tp", schedule="1f1b", tp=2, precision="bf16-mixed", validate=False),
        TrainingCase(model="tp", schedule="1f1b", tp=2, precision="16-mixed", fp16_init_scale=2.0**10,
                     validate=False),
        # an overflow in one tensor rank's part of the last stage's gradient, at the second step: every rank skips it
        TrainingCase(model="tp", schedule="zbv", stages_per_rank=2, tp=2, precision="16-mixed",
                     fp16_init_scale=2.0**10, acc=2, clip=0.05, inf_grad_at_step=1, steps=4, validate=False)]
# PipeDream-2BW: each batch's gradient on the weights of one optimizer step earlier (stashed DTensor copies of the
# split parameters), compared with its one-process reference (test_seed_schedules.py), not with plain training
VERSIONED = [TrainingCase(model="tp", schedule="pipedream_2bw", tp=2, acc=2, clip=0.05, optimizer="adamw",
                          validate=False)]
# PipeDream: an update per micro-batch inside the schedule, each stage clipped by its own norm (split gradients'
# parts summed over the tensor group, not torch's clip_grad_norm_, which cannot mix DTensor and plain gradients) or
# by value; every backward on the stashed DTensor version its forward used
STASHING = [TrainingCase(model="tp", schedule="pipedream", tp=2, clip=0.05, optimizer="adamw", validate=False),
            TrainingCase(model="tp", schedule="pipedream", tp=2, clip=0.02, clip_algo="value", validate=False)]
# Chimera, pipeline 2: every rank holds both stages (one of each pipeline); each tensor rank has its own up pipeline
# and stage-pair group, and sums its parts with the same tensor rank of the other copy. (Its hook sees both copies'
# gradients: no gradient-norm check, as in test_chimera.py.)
CHIMERA = [TrainingCase(model="tp", schedule="chimera", tp=2, acc=2, clip=0.05, optimizer="adamw",
                        check_grad_norms=False)]
ERRORS = [
    # no parallelize_layer hook
    (TrainingCase(model="toy", tp=2, steps=1, validate=False, expect_error=True), "parallelize_layer"),
    # tied weights would be silently untied by a plan
    (TrainingCase(model="toy", tied=True, tp=2, steps=1, validate=False, check_grad_norms=False,
                  expect_error=True), "tied parameters"),
]


STEP4 = "epoch=0-step=4.ckpt"


@pytest.fixture(scope="module")
def pp2_tp2_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp")
    saved = root / "pp2_tp2"
    runs: list[tuple[str, Any]] = [("training", case) for case in TRAINING]
    runs += [("training", case) for case, _ in ERRORS]
    runs.append(("ckpt_train", CheckpointCase(tp=2, dir=str(saved), resume_from=str(saved / STEP4))))
    runs += [("training", case) for case in BF16 + VERSIONED]
    runs += [("pipedream", case) for case in STASHING]
    runs += [("training", case) for case in CHIMERA]
    return {"saved": saved, "results": launch_runs(4, runs, root / "out", timeout=360)}


@pytest.fixture(scope="module")
def pp2_tp2(pp2_tp2_run: dict[str, Any]) -> list[list[dict[str, Any]]]:
    results: list[list[dict[str, Any]]] = pp2_tp2_run["results"]
    return results


@pytest.mark.timeout(420)
def test_pipeline2_x_tensor2_matches_single_device(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    for i, case in enumerate(TRAINING):
        for rank, res in enumerate(pp2_tp2):
            r = res[i]
            assert r["tp_rank"] == rank % 2 and r["topology"] == (0, rank // 2)  # [Note: rank order]
            assert r["sharded_params"] > 0, "the hook split this rank's layers"
        assert_case_parity(pp2_tp2, i, case)


@pytest.mark.timeout(420)
def test_tensor_parallel_refuses_what_it_cannot_do(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    for i, (_, needle) in enumerate(ERRORS, start=len(TRAINING)):
        for res in pp2_tp2:
            assert not res[i]["ok"] and needle in res[i]["error"], res[i]
            assert "tensor_parallel_size" in res[i]["error"]


@pytest.mark.timeout(420)
def test_checkpoint_pp2_tp2_resumes_and_loads_on_one_device(pp2_tp2_run: dict[str, Any], tmp_path: Path) -> None:
    res, saved = pp2_tp2_run["results"], pp2_tp2_run["saved"]
    i = len(TRAINING) + len(ERRORS)
    for rank in res:  # stopped at step 4 and resumed == uninterrupted (every rank's gathered parameters)
        full, resumed = rank[i]["full"], rank[i]["resumed"]
        assert resumed["global_step"] == 8
        assert_same(resumed["params"], full["params"], 1e-6, "pp2 x tp2 resumed")
    # the checkpoint holds whole tensors: one device resumes from the consolidated file and trains on the same
    uninterrupted = merge_replica(res, i, run="full")
    case = CheckpointCase(tp=2)
    ref, _, _ = run_reference(case, ckpt_lib.consolidate(saved / STEP4, tmp_path / "one.ckpt"))
    assert_same(ref["params"], uninterrupted, 1e-5, "pp2 x tp2 -> one device")


def _after_checkpoint(results: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Per rank, the results of the runs after the checkpoint case (BF16, VERSIONED, STASHING, CHIMERA)."""
    start = len(TRAINING) + len(ERRORS) + 1
    return [rank[start:] for rank in results]


@pytest.mark.timeout(420)
def test_pipeline2_x_tensor2_mixed_precision_within_rounding(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    results = _after_checkpoint(pp2_tp2)
    for i, case in enumerate(BF16):
        tol = BF16_TOL if case.precision == "bf16-mixed" else FP16_TOL
        ref = run_training(case, pipeline=False)
        got = merge_replica(results, i)
        for name, want in ref["params"].items():
            assert got[name].dtype == want.dtype == torch.float32  # fp32 weights under mixed precision
        assert_same(got, ref["params"], tol, f"{case}")
        for rank in results:
            torch.testing.assert_close(torch.tensor(rank[i]["losses"]), torch.tensor(ref["losses"]),
                                       atol=4 * tol, rtol=0)
            assert rank[i]["scales"] == ref["scales"]  # fp16: the same skips and back-offs (bf16: none)
        if case.inf_grad_at_step is not None:
            assert (ref["scales"][0], ref["scales"][-1]) == (2.0**10, 2.0**9)  # the overflow happened: one back-off


@pytest.mark.timeout(420)
def test_pipedream_2bw_with_tensor_parallel_matches_its_reference(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    results = _after_checkpoint(pp2_tp2)
    for i, case in enumerate(VERSIONED, start=len(BF16)):
        got = merge_replica(results, i)
        assert_same(got, delayed_reference(case, delay=1), ATOL, f"{case}")
        # plain training (no delay) is far away: the comparison above can fail
        assert max_difference(got, delayed_reference(case, delay=0)) > 1e-4


@pytest.mark.timeout(420)
def test_pipedream_with_tensor_parallel_matches_its_reference(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    results = _after_checkpoint(pp2_tp2)
    for i, case in enumerate(STASHING, start=len(BF16) + len(VERSIONED)):
        pipedream_check(results, i, case)  # versions per micro-batch, parameters (every rank, whole), controls


@pytest.mark.timeout(420)
def test_chimera_with_tensor_parallel_matches_single_device(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    start = len(BF16) + len(VERSIONED) + len(STASHING)
    # parity with one device (validation included), and both copies of each stage bit-identical
    chimera_check([rank[start:] for rank in _after_checkpoint(pp2_tp2)], CHIMERA)


@pytest.mark.skipif(os.environ.get("LIGHTNING_PIPE_8_RANKS") != "1",
                    reason="8 processes (~70 s on 2 loaded cores): set LIGHTNING_PIPE_8_RANKS=1 to run")
@pytest.mark.timeout(600)
def test_pipeline2_x_replicas2_x_tensor2_matches_single_device(tmp_path: Path) -> None:
    """Replicas average each tensor rank's parts with the same tensor rank of the other replica: after the schedule
    (1f1b; zbv, whose split backward bypasses DDP-style hooks), or inside PipeDream's per-micro-batch update."""
    cases = [TrainingCase(model="tp", schedule="1f1b", dp=2, tp=2, acc=2, clip=0.05, optimizer="adamw",
                          validate=False),
             TrainingCase(model="tp", schedule="zbv", stages_per_rank=2, dp=2, tp=2, acc=2, clip=0.05,
                          validate=False)]
    # (SGD, unclipped: test_pipedream's check allows 1e-6, and AdamW turns the tensor split's other summation order
    # into 3e-6 on an element whose gradient is near zero; clipped SGD steps are too small to tell staleness apart)
    stashing = TrainingCase(model="tp", schedule="pipedream", dp=2, tp=2, steps=2, validate=False)
    runs: list[tuple[str, Any]] = [("training", case) for case in cases] + [("pipedream", stashing)]
    res = launch_runs(8, runs, tmp_path / "out", timeout=500)
    for i, case in enumerate(cases):
        for rank in res:
            assert rank[i]["sharded_params"] > 0
        assert_case_parity(res, i, case)
    pipedream_check(res, len(cases), stashing)
