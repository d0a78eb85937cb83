"""Chimera (two pipelines in opposite directions on the same ranks) vs the same LightningModule on one device.

[Note: Chimera placement and semantics] in lightning_pipe/schedules/chimera/spec.py: after the stage-pair gradient sum a
step is plain mini-batch training, so the parity check is the one every synchronous schedule passes (fp32, 1e-5).
Ranks r and p-1-r hold copies of the same two stages: they must also agree exactly with each other.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pipe import checkpoint as ckpt_lib
from lightning_pipe.config import PipelineConfig
from lightning_pipe.schedules import compute_order, plan_schedule
from tests.distributed.launcher import launch, launch_runs
from tests.distributed.parity import ATOL, assert_case_parity, assert_same, merge_replica, reference
from tests.distributed.scenarios import CheckpointCase, TraceCase, TrainingCase
from tests.distributed.scenarios.checkpoint import optimizer_by_name, run_reference
from tests.distributed.scenarios.hardening import HardeningCase
from tests.distributed.test_hardening import MASKED, VARLEN, assert_parity
from tests.distributed.test_precision import FP16_TOL
from tests.models import ToyRegressor

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

    In the same processes: a checkpoint save / exact resume / reshard, a PipelineTimeline trace, the hardening
    cases (variable sequence lengths; a token-weighted (sum, count) loss over 2 replicas with accumulation) and
    fp16 AMP with an injected overflow.
    """
    cases = [
        TrainingCase(schedule="chimera", microbatches=8, check_grad_norms=False, predict=True),
        TrainingCase(schedule="chimera", microbatches=4, acc=2, clip=0.05, optimizer="adamw", validate=False,
                     check_grad_norms=False),
        TrainingCase(model="gpt", n_layers=7, schedule="chimera", microbatches=4, tied=True, optimizer="adamw",
                     clip=0.5, validate=False, check_grad_norms=False),
        TrainingCase(schedule="chimera", dp=2, microbatches=4, clip=0.05, optimizer="adamw", tied=True,
                     check_grad_norms=False),
    ]
    # checkpoints: ranks r and 3-r hold the same layers with the same values; both write them (the checkpoint
    # writer keeps one copy per key) and both read them back
    ckpt = CheckpointCase(schedule="chimera", dir=str(tmp_path / "chimera"),
                          resume_from=str(tmp_path / "chimera" / STEP4))
    # the same checkpoint resumed by another layout: 1F1B on 2 replicas x 2 stages
    other = CheckpointCase(schedule="1f1b", dp=2, resume_from=ckpt.resume_from)
    runs = [("training", c) for c in cases] + [("ckpt_train", ckpt), ("ckpt_resume", other)]
    runs.append(("trace", TraceCase(schedule="chimera", microbatches=4, steps=2)))  # PipelineTimeline
    # variable sequence lengths (re-inference of both pipelines' shapes, validate, predict), p = 4; a token-weighted
    # (sum, count) loss with uneven counts per micro-batch, pipeline and replica, 2 x p = 2
    hardening = [HardeningCase(**VARLEN, schedule="chimera"), HardeningCase(**MASKED, schedule="chimera", dp=2, acc=2)]
    runs += [("hardening", c) for c in hardening]
    # fp16 AMP with an overflow in the last stage at the second step (both of its copies: every rank skips it), p = 4
    fp16 = TrainingCase(precision="16-mixed", schedule="chimera", inf_grad_at_step=1, steps=4, clip=0.05,
                        validate=False, check_grad_norms=False)
    runs.append(("training", fp16))
    results = launch_runs(4, runs, tmp_path / "out", timeout=400)
    check(results, cases)
    check_checkpoints(results, len(cases), ckpt, Path(ckpt.dir or ""))
    check_trace(results, len(cases) + 2)
    for j, case in enumerate(hardening):
        assert_parity(results, len(cases) + 3 + j, case)
    check_fp16(results, len(cases) + 5, fp16)


def check_fp16(results: list[list[Any]], i: int, case: TrainingCase) -> None:
    """As tests/distributed/test_precision.py: 2 fp16 ulps, and every rank's loss scale moves as on one device."""
    ref = reference(case)
    assert_same(merge_replica(results, i), ref["params"], FP16_TOL, "chimera fp16")
    for rank in results:
        assert rank[i]["scales"] == ref["scales"] and ref["scales"][:2] == [2.0**16, 2.0**15]


def check_trace(results: list[list[Any]], i: int) -> None:
    """PipelineTimeline records what each rank ran: both stages' calls in the merged order (each pipeline numbers
    its own micro-batches: the up pipeline's 0 is the batch's m/2), and a bubble metric."""
    m = 4
    order = compute_order(plan_schedule(PipelineConfig(schedule="chimera", microbatches=m), 4))
    for rank, rank_results in enumerate(results):
        (record,) = rank_results[i]["records"]
        ran = [f"{s['stage']}{s['kind']}{s['mb']}" for s in record["slices"] if s["kind"] in "FB"]
        want = [f"{a.stage_index}{a.computation_type.value}{a.microbatch_index % (m // 2)}" for a in order[rank]]
        assert ran == want, f"rank {rank}"
        assert sorted(record["stages"]) == sorted({rank, 3 - rank})
        assert rank_results[i]["last_bubble"] is not None
        # the Chimera paper's (p - 2) / (2m + p - 2), logged next to the measured bubble
        assert rank_results[i]["seen"][-1]["pipeline/bubble_theory"] == pytest.approx(2 / 10)


STEP4 = "epoch=0-step=4.ckpt"


def check_checkpoints(results: list[list[Any]], i: int, case: CheckpointCase, root: Path) -> None:
    """Stopped after 4 of 8 steps and resumed == uninterrupted == one device; the checkpoint holds every parameter
    once (the plain module loads it); another layout resumes from it as from any checkpoint."""
    reference, _, _ = run_reference(replace(case, dir=None, resume_from=None))
    for rank in results:
        full, resumed = rank[i]["full"], rank[i]["resumed"]
        assert resumed["global_step"] == 8
        assert_same(resumed["params"], full["params"], 1e-6, "chimera resumed params")
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][4:]), atol=1e-6,
                                   rtol=0)
    assert_same(merge_replica(results, i, run="full"), reference["params"], ATOL, "chimera vs one device")
    plain = ToyRegressor.load_from_checkpoint(ckpt_lib.as_file(root / STEP4), optimizer="adamw")
    params = {n: p.detach() for n, p in plain.named_parameters(remove_duplicate=False)}
    assert_same(merge_replica(results, i, run="resumed", key="start_params"), params, 0, "chimera loaded params")
    ckpt = ckpt_lib.consolidated(root / STEP4)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.1)
    opt.load_state_dict(ckpt["optimizer_states"][0])
    assert_same(merge_replica(results, i, run="resumed", key="start_optim"), optimizer_by_name(plain, opt), 0,
                "chimera loaded optimizer state")
    resharded = merge_replica(results, i + 1, key="start_params")
    assert_same(resharded, params, 0, "1F1B dp2 x pp2 loaded from a Chimera checkpoint")


@pytest.mark.skipif(os.environ.get("LIGHTNING_PIPE_8_RANKS") != "1",
                    reason="8 processes (~35 s on 2 idle cores): set LIGHTNING_PIPE_8_RANKS=1 to run")
@pytest.mark.timeout(600)
def test_chimera_p4_with_data_parallel_matches_single_device(tmp_path) -> None:
    """2 replicas x p = 4: four stage-pair groups, two up-pipeline groups, then the replicas average."""
    cases = [TrainingCase(schedule="chimera", dp=2, microbatches=4, clip=0.05, optimizer="adamw", tied=True,
                          check_grad_norms=False, steps=2)]
    check(launch("training", 8, cases, tmp_path, timeout=500), cases)
