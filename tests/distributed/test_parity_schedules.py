"""Parity: every multi-stage schedule (interleaved 1F1B, looped BFS, ZB-H1, ZB-V, DualPipeV, V-Half, V-Min) and custom
action-list schedules under the strategy vs the same LightningModule trained on one device.

Pipeline size 2 mostly, so the 2-per-rank schedules run 4 stages (8 layers); V-Half / V-Min also at pipeline 4
(8 stages of one layer). One launch runs many cases:
process start-up dominates on a small machine. The parity assertion is tests/distributed/parity.py's.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from lightning_pipe.config import PipelineConfig
from lightning_pipe.schedules import compute_order, plan_schedule
from tests.distributed.launcher import launch
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

LOOP = [("interleaved_1f1b", 2), ("looped_bfs", 2), ("zb_h1", 2)]
V = [("zbv", 2), ("dualpipev", 2)]
GRID = list(itertools.product((1, 2), (None, 0.05)))  # (accumulate_grad_batches, gradient_clip_val)


def grid_cases(schedules: list[tuple[str, int]]) -> list[TrainingCase]:
    cases = []
    for (schedule, v), (acc, clip) in itertools.product(schedules, GRID):
        cases.append(TrainingCase(schedule=schedule, stages_per_rank=v, microbatches=4, acc=acc, clip=clip, steps=3,
                                  optimizer="adamw" if acc == 2 else "sgd", predict=(acc == 1 and clip is None)))
    return cases


def check_all(results: list[list[dict[str, Any]]], cases: list[TrainingCase]) -> None:
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)


@pytest.mark.timeout(600)
def test_loop_placement_schedules_match_single_device(tmp_path) -> None:
    """interleaved_1f1b, looped_bfs, zb_h1 (4 stages, rank r holds r and r+2), all with/without acc and clipping;
    plus 3 virtual stages per rank (6 stages) and ZB-H1 with one stage per rank."""
    cases = grid_cases(LOOP)
    cases += [TrainingCase(schedule="interleaved_1f1b", stages_per_rank=3, microbatches=4, acc=2, clip=0.05,
                           optimizer="adamw"),
              TrainingCase(schedule="zb_h1", stages_per_rank=1, microbatches=4, acc=2, clip=0.05, optimizer="adamw"),
              # stage outputs that are also saved for a weight gradient inside the stage, under a split backward
              TrainingCase(model="saved_outputs", schedule="zb_h1", stages_per_rank=2, microbatches=4, acc=2,
                           clip=0.05, optimizer="adamw"),
              # weights computed from reparametrised parameters (weight_norm) in every forward
              TrainingCase(model="weight_norm", schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4,
                           clip=0.05, optimizer="adamw"),
              # LSTM / GRU layers, a (outputs, summary) pair across a stage boundary
              TrainingCase(model="recurrent", schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4, acc=2,
                           clip=0.05),
              # a frozen stage 0 ([Note: a split backward with no input grad])
              TrainingCase(model="frozen_front", schedule="zb_h1", stages_per_rank=2, microbatches=4, validate=False)]
    check_all(launch("training", 2, cases, tmp_path, timeout=540), cases)


@pytest.mark.timeout(600)
def test_v_placement_schedules_match_single_device(tmp_path) -> None:
    """zbv and dualpipev (rank 0 holds stages 0 and 3: first *and* last), with/without acc and clipping, validation
    and test losses and predict (padded last batch) through forward-only runs; tied input/output weights whose two
    ends then live on the same rank. V-Half and V-Min (memory-capped V orders) likewise."""
    cases = grid_cases(V)
    cases += [TrainingCase(schedule="zbv", stages_per_rank=2, microbatches=4, acc=2, clip=0.05, tied=True,
                           optimizer="adamw", check_grad_norms=False),
              TrainingCase(schedule="dualpipev", stages_per_rank=2, microbatches=6, batch=12, acc=1, clip=0.05,
                           tied=True, check_grad_norms=False),
              TrainingCase(schedule="v_half", microbatches=4, acc=2, clip=0.05, tied=True, optimizer="adamw",
                           check_grad_norms=False),
              TrainingCase(schedule="v_min", microbatches=4, predict=True),
              # the last stage's output (prediction, f) and every boundary carry a tensor saved for a weight
              # gradient inside its stage ([Note: split backward detaches stage outputs])
              TrainingCase(model="saved_outputs", schedule="zbv", stages_per_rank=2, microbatches=4, clip=0.05),
              TrainingCase(model="saved_outputs", schedule="dualpipev", stages_per_rank=2, microbatches=4, acc=2,
                           optimizer="adamw", validate=False),
              # weight_norm: the weight half (W) differentiates through the reparametrisation
              TrainingCase(model="weight_norm", schedule="zbv", stages_per_rank=2, microbatches=4, acc=2, clip=0.05),
              # the weight half (W) through LSTM / GRU weights
              TrainingCase(model="recurrent", schedule="zbv", stages_per_rank=2, microbatches=4, acc=2, clip=0.05),
              # stage 0 frozen / without parameters: stage 1's inputs need no gradient, so torch's input half records
              # no weight for its weight half ([Note: a split backward with no input grad])
              TrainingCase(model="frozen_front", schedule="zbv", stages_per_rank=2, microbatches=4, acc=2, clip=0.05,
                           optimizer="adamw"),
              TrainingCase(model="param_free_front", schedule="dualpipev", stages_per_rank=2, microbatches=4,
                           clip=0.05, validate=False)]
    results = launch("training", 2, cases, tmp_path, timeout=540)
    check_all(results, cases)
    assert results[0][0]["topology"] == (0, 0) and results[0][0]["predictions"].shape[0] == 22


@pytest.mark.timeout(600)
def test_zero_bubble_with_data_parallel_matches_single_device(tmp_path) -> None:
    """DP 2 x PP 2 with the zero-bubble schedules: torch's I/W split bypasses DDP's gradient hooks (pytorch #144530);
    the strategy averages each stage's gradients once its last weight backward (W) has run (lightning_pipe/
    dp_overlap.py). ZB-V with tied input/output weights: both ends on rank 0, averaged once both stages finish.
    Interleaved 1F1B: two stages per rank with full backward (buckets launched from inside each last backward).
    V-Half with DP 2; V-Half and V-Min at pipeline 4 (8 one-layer stages, rank 0 holds 0 and 7: both tied ends)."""
    cases = [TrainingCase(schedule="zbv", stages_per_rank=2, dp=2, acc=1, clip=None),
             TrainingCase(schedule="zbv", stages_per_rank=2, dp=2, acc=2, clip=0.05, tied=True, optimizer="adamw",
                          check_grad_norms=False, validate=False),
             TrainingCase(schedule="interleaved_1f1b", stages_per_rank=2, dp=2, acc=2, clip=0.05, optimizer="adamw",
                          validate=False),
             TrainingCase(schedule="zb_h1", stages_per_rank=2, dp=2, acc=2, clip=0.05, optimizer="adamw"),
             TrainingCase(schedule="dualpipev", stages_per_rank=2, dp=2, acc=2, clip=0.05, optimizer="adamw"),
             TrainingCase(schedule="v_half", dp=2, acc=2, clip=0.05, optimizer="adamw", validate=False),
             TrainingCase(schedule="v_half", microbatches=8, batch=16, acc=2, clip=0.05, optimizer="adamw",
                          validate=False),
             TrainingCase(schedule="v_min", microbatches=8, batch=16, tied=True, check_grad_norms=False),
             # predict over 17 samples: replica 0 gets 9 (2 batches), replica 1 8 (1 batch); each predicts its own
             TrainingCase(schedule="1f1b", dp=2, steps=2, predict=True, predict_n=17)]
    check_all(launch("training", 4, cases, tmp_path, timeout=540), cases)


def _order_strings(schedule: str, stages_per_rank: int | None, microbatches: int) -> list[list[str]]:
    plan = plan_schedule(PipelineConfig(schedule=schedule, stages_per_rank=stages_per_rank,
                                        microbatches=microbatches), 2)
    order = compute_order(plan)
    return [[str(a) if a is not None else "" for a in order[r]] for r in range(2)]


@pytest.mark.timeout(600)
def test_custom_action_lists_match_single_device_and_1f1b(tmp_path) -> None:
    """A custom schedule written as 1F1B's action lists reproduces 1F1B bit for bit; ZB-V's lists given as a CSV
    file (V placement "as given", I/W split), a hand-written I/W schedule and a contiguous placement (two
adjacent stages per rank) match one device. Malformed lists are
    refused on every rank before the process group exists, naming rank, step and action."""
    one_f_one_b = _order_strings("1f1b", None, 4)
    csv_path = tmp_path / "zbv.csv"
    csv_path.write_text("\n".join(",".join(row) for row in _order_strings("zbv", 2, 4)) + "\n")
    hand_written = [["0F0", "0F1", "0F2", "0F3", "0I0", "0W0", "0I1", "0W1", "0I2", "0W2", "0I3", "0W3"],
                    ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3", "1W2", "1W3"]]
    # contiguous placement (rank 0: stages 0, 1; rank 1: stages 2, 3), neither loop nor V: "as given"
    contiguous = [[f"{s}F{m}" for m in range(4) for s in (0, 1)] + [f"{s}B{m}" for m in range(4) for s in (1, 0)],
                  [a for m in range(4) for a in (f"2F{m}", f"3F{m}", f"3B{m}", f"2B{m}")]]
    good = [TrainingCase(schedule="1f1b", acc=2, clip=0.05, optimizer="adamw"),
            TrainingCase(schedule="custom", schedule_options={"actions": one_f_one_b}, acc=2, clip=0.05,
                         optimizer="adamw"),
            TrainingCase(schedule="custom", microbatches=None,
                         schedule_options={"csv": str(csv_path), "placement": "v"}, predict=True),
            TrainingCase(schedule="custom", microbatches=None, schedule_options={"actions": hand_written}, clip=0.05),
            TrainingCase(schedule="custom", microbatches=None, schedule_options={"actions": contiguous}, acc=2,
                         optimizer="adamw", predict=True)]
    bad = {
        "missing backward": ([["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2"], one_f_one_b[1]],
                             "rank 0, step 5: action '0F3' has no '0B3'"),
        "stage not on rank": ([["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
                               ["1F0", "1B0", "0F1"] + one_f_one_b[1][2:]],
                              "rank 1, step 2: action '0F1'"),
        "deadlock": ([["0F0", "0B0", "0F1", "0B1", "0F2", "0B2", "0F3", "0B3"],
                      ["1F1", "1F0", "1B0", "1B1", "1F2", "1B2", "1F3", "1B3"]],
                     "rank 0, step 1: '0B0' waits for '1B0'; rank 1, step 0: '1F1' waits for '0F1'"),
    }
    cases = good + [TrainingCase(schedule="custom", microbatches=None, schedule_options={"actions": actions},
                                 expect_error=True) for actions, _ in bad.values()]
    results = launch("training", 2, cases, tmp_path / "run", timeout=540)
    for i, case in enumerate(good):
        assert_case_parity(results, i, case)
    for rank in range(2):
        ref, custom = results[rank][0]["params"], results[rank][1]["params"]
        assert sorted(ref) == sorted(custom)
        for name in ref:
            assert torch.equal(ref[name], custom[name]), f"custom 1F1B differs from 1F1B on {name}"
        assert results[rank][0]["losses"] == results[rank][1]["losses"]
    for j, (what, (_, expected)) in enumerate(bad.items()):
        for rank in range(2):
            res = results[rank][len(good) + j]
            assert not res["ok"], f"{what}: accepted"
            assert "PipelineConfigError" in res["error"] and expected in res["error"], (what, res["error"])
            assert "schedule_options" in res["error"], res["error"]
