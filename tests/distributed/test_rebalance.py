"""rebalance_every_n_steps on 2 real ranks, one launch: layers move mid-run with their Adam state, training equals
one device, the moves are logged, a slowed rank ends with fewer layers, and a checkpoint saved after a rebalance
resumes into another layout; and a run resumed with rebalancing keeps the uninterrupted run's split and cadence."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.parity import ATOL, assert_same, merge_replica
from tests.distributed.scenarios.rebalance import RebalanceCase, run_reference

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


@pytest.mark.timeout(600)
def test_rebalance_moves_layers_and_training_stays_exact(tmp_path) -> None:
    cases = [
        # block 5 sleeps 4x the others, last on the heavy first stage: moving it (alone) balances the stages
        RebalanceCase(partition=(6, 2), slow_layer=5, ckpt=str(tmp_path / "ckpt")),
        # every block on rank 1 sleeps 12 ms more: rank 1 is read as ~4x slower and keeps fewer layers. Blocks 2 and
        # 5 share a weight: block 5 joins block 2 on rank 0 (one copy, one optimizer entry, no tie group left)
        RebalanceCase(base_s=0.004, slow_rank=1, rank_delay_s=0.012, tied=True, tie_blocks=(2, 5), steps=4,
                      timeline=True),
        # case 0 interrupted by a checkpoint at step 4 (after its first move), resumed with the same settings
        RebalanceCase(partition=(6, 2), slow_layer=5, steps=4, ckpt=str(tmp_path / "ckpt4"), resume_steps=4,
                      resume_rebalance=True),
    ]
    results = launch("rebalance", 2, cases, tmp_path / "run", timeout=420)

    slow_layer, slow_rank = 0, 1
    # (1) a slow layer: measured as the costliest, moved from rank 0 to rank 1 by the first decision, and logged
    first = results[0][slow_layer]["events"][0]
    assert max(range(8), key=lambda i: first["costs"][i]) == 5, first
    assert (5, 0, 1) in first["moves"], first
    assert results[1][slow_layer]["events"] == results[0][slow_layer]["events"]  # every rank decided the same
    logged = "\n".join(results[0][slow_layer]["logged"])
    assert "split [6, 2] -> " in logged and "layer 5: pipeline rank 0 -> 1" in logged, logged
    for i in (slow_layer, slow_rank):  # each rank ends holding what the last decision's split gives it
        split = results[0][i]["events"][-1]["proposed"]
        assert [rank[i]["layers"] for rank in results] == [list(range(split[0])), list(range(split[0], 8))]
    # (2) a slowed rank gets fewer layers
    events = results[0][slow_rank]["events"]
    assert events[0]["speeds"][1] > 1.5 * events[0]["speeds"][0], events
    held = [len(rank[slow_rank]["layers"]) for rank in results]
    assert held[1] < held[0], held
    assert "layers.5.fc.weight" not in results[1][slow_rank]["params"]  # the tied block left rank 1
    # the trace recorder follows the rebuilt engine: every step recorded, m forwards per stage, before and after
    assert all(rank[slow_rank]["timeline"] == [2] * 4 for rank in results), [r[slow_rank]["timeline"] for r in results]
    # parity: a run with a rebalance mid-way equals one device (parameters with their AdamW state moved)
    for i, case in enumerate(cases[:2]):
        ref = run_reference(case, case.steps)
        got = merge_replica(results, i)
        # a tied weight's copy on another rank (the head's, on the last rank) equals the one-device weight too
        for alias, name in (("layers.7.weight", "layers.0.weight"), ("layers.5.fc.weight", "layers.2.fc.weight")):
            if alias in got and alias not in ref["params"]:
                torch.testing.assert_close(got.pop(alias), ref["params"][name], atol=ATOL, rtol=0)
        assert_same(got, ref["params"], ATOL, f"case {i}")
        for rank in results:
            assert rank[i]["losses"] == pytest.approx(ref["losses"], abs=ATOL)
    # (3) a checkpoint saved after the rebalance ([4, 4] + moved optimizer state) resumes into the uniform layout
    ref = run_reference(cases[0], cases[0].steps + cases[0].resume_steps)
    assert_same(merge_replica(results, slow_layer, key="resumed"), ref["params"], ATOL, "resumed")
    # (4) a resumed run rebalances on the uninterrupted run's cadence ([Note: resuming a rebalanced run]): it starts
    # on the split its checkpoint was saved with (after the move at step 4) and decides next at step 8, as case 0
    resumed = 2
    first, uninterrupted = results[0][resumed]["events"], results[0][slow_layer]["events"]
    assert [e["step"] for e in first] == [4] and first[0]["proposed"] != [6, 2], first
    for rank in results:
        assert rank[resumed]["resumed_start"] == first[0]["proposed"], rank[resumed]["resumed_start"]
        assert [e["step"] for e in rank[resumed]["resumed_events"]] == [e["step"] for e in uninterrupted
                                                                        if e["step"] > 4], rank[resumed]
    ref = run_reference(cases[resumed], cases[resumed].steps + cases[resumed].resume_steps)
    assert_same(merge_replica(results, resumed, key="resumed"), ref["params"], ATOL, "resumed with rebalancing")
