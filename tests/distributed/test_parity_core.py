"""Parity: GPipe and 1F1B under the strategy vs the same LightningModule trained on one device."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.scenarios import run_training

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

ATOL = 1e-5


def core_cases(dp: int) -> list[dict[str, Any]]:
    cases = []
    for schedule, acc, clip in itertools.product(("gpipe", "1f1b"), (1, 2), (None, 0.05)):
        cases.append(dict(schedule=schedule, dp=dp, acc=acc, clip=clip, steps=3,
                          optimizer="adamw" if acc == 2 else "sgd", predict=(dp == 1 and acc == 1 and clip is None)))
    # Tied input/output weights held by the first and the last stage (GPT-2 style), with clipping and accumulation.
    cases.append(dict(schedule="1f1b", dp=dp, acc=2, clip=0.05, tied=True, optimizer="adamw"))
    # layers built on the meta device in configure_model, allocated per rank at setup (tied across stages)
    cases.append(dict(schedule="1f1b", dp=dp, model="meta", tied=True, clip=0.05))
    # gradient_clip_algorithm="value": elementwise, after the data-parallel average
    cases.append(dict(schedule="gpipe", dp=dp, acc=2, clip=0.002, clip_algo="value"))
    return cases


def merge_replica(results: list[dict[str, Any]], case_idx: int, dp_rank: int) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for res in results:
        r = res[case_idx]
        if r["topology"][0] == dp_rank:
            params.update(r["params"])
    return params


def assert_case_parity(results: list[list[dict[str, Any]]], case_idx: int, case: dict[str, Any]) -> None:
    ref = run_training(case, pipeline=False)
    dp = case.get("dp", 1)
    for dp_rank in range(dp):
        got = merge_replica(results, case_idx, dp_rank)
        assert sorted(got) == sorted(ref["params"]), "every parameter lives on exactly one stage"
        for name, value in ref["params"].items():
            torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0, msg=lambda m: f"{case} {name}: {m}")
    # Every stage of a replica logs that replica's loss; the replicas' mean is the global batch loss.
    by_replica: dict[int, list[torch.Tensor]] = {}
    for res in results:
        by_replica.setdefault(res[case_idx]["topology"][0], []).append(torch.tensor(res[case_idx]["losses"]))
    for losses in by_replica.values():
        for other in losses[1:]:
            torch.testing.assert_close(other, losses[0], atol=0, rtol=0)
    mean_loss = torch.stack([losses[0] for losses in by_replica.values()]).mean(0)
    torch.testing.assert_close(mean_loss, torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
    for res in results:
        r = res[case_idx]
        # hooks fire as on one device: zero_grad per optimizer step, backward per batch
        assert r["calls"] == ref["calls"], (r["calls"], ref["calls"])
        assert r["meta_tensors"] == 0
        if "val_loss" in ref:
            # validation during fit (every 2 batches), trainer.validate and trainer.test: forward-only pipeline
            assert len(ref["fit_val_losses"]) >= 1
            for key in ("fit_val_losses", "val_loss", "test_loss"):
                torch.testing.assert_close(torch.tensor(r[key]), torch.tensor(ref[key]), atol=ATOL, rtol=0)
    if not case.get("tied"):
        # on_before_optimizer_step sees the full gradients (not wiped by zero_grad): the squared norms of the
        # stages of one replica add up to the single-device one, at every optimizer step
        stage_sq = torch.tensor([r[case_idx]["grad_sq_before_step"] for r in results
                                 if r[case_idx]["topology"][0] == 0]).sum(0)
        torch.testing.assert_close(stage_sq, torch.tensor(ref["grad_sq_before_step"]), rtol=1e-4, atol=1e-6)
    if case.get("predict"):
        torch.testing.assert_close(results[0][case_idx]["predictions"], ref["predictions"], atol=ATOL, rtol=0)
        assert results[0][case_idx]["predictions"].shape[0] == 22
        for res in results:
            torch.testing.assert_close(torch.tensor(res[case_idx]["val_loss_new_trainer"]),
                                       torch.tensor(ref["val_loss"]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("pp,dp", [(2, 1), (4, 1), (2, 2)], ids=["pp2", "pp4", "pp2xdp2"])
@pytest.mark.timeout(600)
def test_core_schedules_match_single_device(pp: int, dp: int, tmp_path) -> None:
    cases = core_cases(dp)
    results = launch("training", pp * dp, cases, tmp_path, timeout=420)
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)
