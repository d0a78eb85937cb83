"""Aux losses from a non-last stage under every schedule (issue 25), and transformers MoE models, vs one device."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.parity import ATOL
from tests.distributed.scenarios.moe import AuxCase, run_toy

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


def check_toy(results: list, index: int, case: AuxCase) -> None:
    ref = run_toy(case, pipeline=False)
    seen: set[str] = set()
    for rank, rank_results in enumerate(results):
        got = rank_results[index]
        for name, value in got["params"].items():
            torch.testing.assert_close(value, ref["params"][name], atol=ATOL, rtol=0,
                                       msg=lambda m, name=name, rank=rank: f"{case} rank {rank} {name}: {m}")
        seen |= set(got["params"])
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=ATOL, rtol=0)
        for mine, theirs in zip(got["aux"], ref["aux"], strict=True):
            assert mine.keys() == theirs.keys() and mine.keys() >= {"train_aux_loss", "train_aux_loss/act_l2"}
            for key in mine:
                assert abs(mine[key] - theirs[key]) < 1e-5, (case, key, mine, theirs)
    assert seen == set(ref["params"])


TOY_CASES = [AuxCase(schedule="gpipe"), AuxCase(schedule="1f1b", acc=2, steps=4),
             AuxCase(schedule="interleaved_1f1b", stages_per_rank=2), AuxCase(schedule="looped_bfs", stages_per_rank=2),
             AuxCase(schedule="zb_h1"), AuxCase(schedule="zbv", stages_per_rank=2, aux_at=(1, 5)),
             AuxCase(schedule="dualpipev", stages_per_rank=2), AuxCase(schedule="chimera"),
             AuxCase(schedule="1f1b", precision="16-mixed")]


@pytest.mark.timeout(600)
def test_aux_losses_from_a_non_last_stage_match_one_device_under_every_schedule(tmp_path) -> None:
    results = launch("aux_toy", 2, TOY_CASES, tmp_path / "run", timeout=540)
    for i, case in enumerate(TOY_CASES):
        check_toy(results, i, case)
