"""The compact multi-rank set: every version-sensitive path once, for ``make test-torch TORCH=X`` on each supported
torch (docs/versions.md). Each test here is marked ``compact``; ``make test-torch`` runs them with the unit tests
and the other ``compact`` tests (a checkpoint resume, Hugging Face models, variable shapes, the timeline: marked in
their own files).

One 2-rank launch: each built-in schedule at pipeline 2 with validation, test and predict (forward-only runs of
action-list schedules: torch 2.15's ``WAIT_SEND_F``), custom lists with and without I/W, and pipeline 1 x data
parallel 2, x FSDP 2 and x tensor parallel 2 (two stages on one rank); PipeDream and 2BW against their references;
torch 2.15's per-edge P2P. On the restricted tier (torch 2.11 / 2.12) what it refuses is asserted to be refused, on
every rank, naming the feature and the torch release that has it right.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.config  # the per-edge flag's home (2.15)

from tests.distributed.launcher import launch, launch_runs
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase
from tests.torch_tiers import SPLIT_BACKWARD_SCHEDULES, refused

pytestmark = [pytest.mark.parity, pytest.mark.distributed, pytest.mark.compact]

F_B_ONLY = [["0F0", "0F1", "0F2", "0B0", "0B1", "0B2", "0F3", "0B3"],
            ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]]
WITH_I_W = [["0F0", "0F1", "0F2", "0F3", "0I0", "0W0", "0I1", "0W1", "0I2", "0W2", "0I3", "0W3"],
            ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3", "1W2", "1W3"]]


def _cases() -> list[tuple[TrainingCase, bool]]:
    """(case, refused on this torch)."""
    split_refused = refused("split_backward")
    cases = [
        TrainingCase(schedule="gpipe", predict=True),
        TrainingCase(schedule="1f1b", acc=2, clip=0.05, optimizer="adamw", predict=True),
        TrainingCase(schedule="interleaved_1f1b", stages_per_rank=2, predict=True),
        TrainingCase(schedule="looped_bfs", stages_per_rank=2, predict=True),
        TrainingCase(schedule="zb_h1", stages_per_rank=2, predict=True),
        TrainingCase(schedule="zbv", stages_per_rank=2, acc=2, clip=0.05, optimizer="adamw", predict=True),
        TrainingCase(schedule="dualpipev", stages_per_rank=2, predict=True),
        TrainingCase(schedule="v_half", predict=True),
        TrainingCase(schedule="custom", microbatches=None, schedule_options={"actions": F_B_ONLY}, predict=True),
        TrainingCase(schedule="custom", microbatches=None, schedule_options={"actions": WITH_I_W}, clip=0.05),
        TrainingCase(schedule="chimera", microbatches=4, check_grad_norms=False, predict=True),
        TrainingCase(schedule="interleaved_1f1b", stages_per_rank=2, dp=2, acc=2, clip=0.05, optimizer="adamw"),
        TrainingCase(schedule="interleaved_1f1b", stages_per_rank=2, fsdp=2, acc=2, clip=0.05, optimizer="adamw"),
        TrainingCase(model="tp", schedule="interleaved_1f1b", stages_per_rank=2, tp=2, acc=2, clip=0.05,
                     optimizer="adamw", predict=True),
    ]
    out = []
    for case in cases:
        split = case.schedule in SPLIT_BACKWARD_SCHEDULES or case.schedule_options == {"actions": WITH_I_W}
        no = split and split_refused
        out.append((replace(case, expect_error=True, steps=1) if no else case, no))
    return out


@pytest.mark.timeout(600)
def test_every_schedule_trains_validates_and_predicts_like_one_device(tmp_path) -> None:
    cases = _cases()
    results = launch("training", 2, [case for case, _ in cases], tmp_path, timeout=540)
    for i, (case, no) in enumerate(cases):
        if not no:
            assert_case_parity(results, i, case)
            continue
        for rank in range(2):
            res = results[rank][i]
            assert not res["ok"], f"{case.schedule}: accepted on a torch that computes its split backward wrongly"
            assert "PipelineConfigError" in res["error"] and "needs torch >= 2.13" in res["error"], res["error"]
            assert "wrong weight gradients" in res["error"], res["error"]


@pytest.mark.skipif(not hasattr(torch.distributed.config, "pipeline_per_edge_p2p"),
                    reason="torch.distributed.config.pipeline_per_edge_p2p is new in torch 2.15")
@pytest.mark.timeout(600)
def test_per_edge_p2p_is_honoured(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.15's one communicator per directed edge (``pipeline_per_edge_p2p``, set by its environment variable
    in every rank): torch's loop schedules, its action-list runtime, Chimera's own runtime and PipeDream's stages
    train as they do without it."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P", "1")
    cases = [TrainingCase(schedule="1f1b", acc=2, clip=0.05, optimizer="adamw", predict=True),
             TrainingCase(schedule="zbv", stages_per_rank=2, predict=True),
             TrainingCase(schedule="interleaved_1f1b", stages_per_rank=2, dp=2),
             TrainingCase(schedule="chimera", microbatches=4, check_grad_norms=False, predict=True)]
    results = launch("training", 2, cases, tmp_path, timeout=540)
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)
    assert all(rank[0]["per_edge_p2p"] for rank in results)


@pytest.mark.timeout(420)
def test_weight_stashing_schedules_match_their_one_process_references(tmp_path) -> None:
    """PipeDream and PipeDream-2BW (stage subclasses with their own forward / backward over stashed weights) against
    the one-process loops of their semantics, with validation on the live weights."""
    from tests.distributed.test_pipedream import check as check_pipedream
    from tests.distributed.test_seed_schedules import check as check_2bw

    pipedream, two_bw = TrainingCase(schedule="pipedream", steps=3), TrainingCase(schedule="pipedream_2bw", steps=3)
    results = launch_runs(2, [("pipedream", pipedream), ("training", two_bw)], tmp_path, timeout=360)
    check_pipedream(results, 0, pipedream)
    check_2bw(results, 1, two_bw, delay=1)
