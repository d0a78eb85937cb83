"""Aux losses from a non-last stage under every schedule (issue 25), and transformers MoE models, vs one device."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch, launch_runs
from tests.distributed.parity import ATOL
from tests.distributed.scenarios.moe import AuxCase, MoECase, moe_reference, run_toy

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

FP16_TOL = 2 * 2**-11  # fp16 AMP on both sides, as tests/distributed/test_precision.py


def check_toy(results: list, index: int, case: AuxCase) -> None:
    ref = run_toy(case, pipeline=False)
    tol = FP16_TOL if case.precision == "16-mixed" else ATOL
    seen: set[str] = set()
    for rank, rank_results in enumerate(results):
        got = rank_results[index]
        for name, value in got["params"].items():
            torch.testing.assert_close(value, ref["params"][name], atol=tol, rtol=0,
                                       msg=lambda m, name=name, rank=rank: f"{case} rank {rank} {name}: {m}")
        seen |= set(got["params"])
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=tol, rtol=0)
        for mine, theirs in zip(got["aux"], ref["aux"], strict=True):
            assert mine.keys() == theirs.keys() and mine.keys() >= {"train_aux_loss", "train_aux_loss/act_l2"}
            for key in mine:
                assert abs(mine[key] - theirs[key]) < tol, (case, key, mine, theirs)
    assert seen == set(ref["params"])


TOY_CASES = [AuxCase(schedule="gpipe"), AuxCase(schedule="1f1b", acc=2, steps=4),
             AuxCase(schedule="interleaved_1f1b", stages_per_rank=2), AuxCase(schedule="looped_bfs", stages_per_rank=2),
             AuxCase(schedule="zb_h1"), AuxCase(schedule="zbv", stages_per_rank=2, aux_at=(1, 5)),
             AuxCase(schedule="dualpipev", stages_per_rank=2), AuxCase(schedule="chimera"),
             AuxCase(schedule="1f1b", precision="16-mixed")]


def check_moe(results: list, index: int, case: MoECase) -> dict[str, torch.Tensor]:
    ref, full = moe_reference(case)
    seen: set[str] = set()
    for rank, rank_results in enumerate(results):
        got = rank_results[index]
        for name, value in got["params"].items():
            torch.testing.assert_close(value, full[name], atol=ATOL, rtol=0,
                                       msg=lambda m, name=name, rank=rank: f"{case} rank {rank} {name}: {m}")
        seen |= set(got["params"])
        if case.dp == 1:  # logged per replica (like train_loss); the reference's numbers are the global batch's
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
            torch.testing.assert_close(torch.tensor(got["aux"]), torch.tensor(ref["aux"]), atol=ATOL, rtol=0)
    assert seen == set(ref["params"]), f"{case}: parameters not covered: {set(ref['params']) ^ seen}"
    return {n: v for rank_results in results for n, v in rank_results[index]["params"].items()}


MOE_CASES = [MoECase(family="mixtral"), MoECase(family="qwen2_moe", schedule="interleaved_1f1b", stages_per_rank=2),
             MoECase(family="olmoe", schedule="zbv", stages_per_rank=2, from_model=True)]
MOE_DP_CASES = [MoECase(family="qwen3_moe", dp=2, schedule="zbv", stages_per_rank=2)]


@pytest.mark.timeout(600)
def test_aux_losses_match_one_device_under_every_schedule_and_hf_moe_models_match_transformers(tmp_path) -> None:
    """One 2-rank launch. (1) The toy with aux terms on the first stage under every schedule family vs Lightning on
    one device. (2) Pipeline 2: Mixtral (1F1B), Qwen2-MoE with shared experts and a dense layer (interleaved 1F1B),
    OLMoE from an instantiated model (ZB-V) vs transformers with the per-micro-batch load-balancing loss: every
    parameter after 3 SGD steps, the loss and the logged aux term per step. The checks would fail without the
    per-micro-batch scale or the cross-stage token fractions: the pipeline's parameters are far from what either
    mistake gives."""
    runs = [("aux_toy", case) for case in TOY_CASES] + [("moe", case) for case in MOE_CASES]
    results = launch_runs(2, runs, tmp_path / "run", timeout=540)
    for i, case in enumerate(TOY_CASES):
        check_toy(results, i, case)
    for i, case in enumerate(MOE_CASES):
        got = check_moe(results, len(TOY_CASES) + i, case)
    for drop in ("microbatch_scale", "cross_stage_fractions"):
        _, wrong = moe_reference(MOE_CASES[-1], drop=drop)
        gap = max(float((got[n] - wrong[n]).abs().max()) for n in got)
        assert gap > 100 * ATOL, (drop, gap)


@pytest.mark.timeout(600)
def test_hf_moe_models_under_pipeline_and_data_parallelism_match_transformers(tmp_path) -> None:
    """Pipeline 2 x data parallel 2 (4 ranks), Qwen3-MoE under ZB-V: replicas average their aux terms like their
    gradients (and the token count the aux scale divides out is the replicas' sum)."""
    results = launch("moe", 4, MOE_DP_CASES, tmp_path / "run", timeout=540)
    for i, case in enumerate(MOE_DP_CASES):
        check_moe(results, i, case)
