"""schedule="auto" and partition="time"/"memory" on 2 real ranks: every rank profiles (a meta-built model one layer
at a time), rank 0 decides, all adopt its plan, and training equals the same module on one device; a slowed rank or
an artificially slow layer gets less work, and rank 0 logs the choice with the runners-up."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import launch
from tests.distributed.parity import assert_case_parity
from tests.distributed.scenarios import TrainingCase

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


@pytest.mark.timeout(600)
def test_auto_schedule_matches_single_device(tmp_path) -> None:
    cases = [TrainingCase(schedule="auto", microbatches=None, steps=3),
             # built on meta in configure_model: profiled one layer at a time, tied across the first and last stage
             TrainingCase(schedule="auto", microbatches=None, model="meta", tied=True, check_grad_norms=False),
             # a fixed schedule, split by measured time at setup (partition="memory" runs in test_trace.py)
             TrainingCase(schedule="zbv", microbatches=4, partition="time", steps=2, validate=False)]
    results = launch("training", 2, cases, tmp_path, timeout=420)
    for i, case in enumerate(cases):
        assert_case_parity(results, i, case)


@pytest.mark.timeout(600)
def test_a_slowed_rank_gets_fewer_layers(tmp_path) -> None:
    """Rank 1 pauses 3 ms per layer call (a throttled or shared device): the profiles taken on every rank show it,
    and the plan every rank adopts gives it fewer layers than rank 0."""
    from tests.distributed.scenarios.planner import SlowRankCase

    cases = [SlowRankCase(),
             # layers of 0.5 ms per sample, layer 0 with 2.5 ms more (on every rank): its stage gets fewer layers
             SlowRankCase(slow_rank=None, slow_layer=0, delay_s=0.0025, layer_s=0.0005)]
    results = launch("planner_slow_rank", 2, cases, tmp_path, timeout=420)
    plans = [rank[0]["plan"] for rank in results]
    assert plans[0] == plans[1]  # one plan, adopted everywhere
    plan = plans[0]
    assert plan["rank_speeds"][1] > 2 * plan["rank_speeds"][0]
    held = [sum(n for n, r in zip(plan["partition"], plan["stage_ranks"]) if r == rank) for rank in (0, 1)]
    assert held[1] < held[0], plan["layout"]
    plan = results[0][1]["plan"]
    assert plan == results[1][1]["plan"]
    counts = plan["partition"]
    assert counts[0] < 8 / len(counts), plan["layout"]  # the stage holding the slow layer 0 holds fewer
    # rank 0 logged the choice and why: the layout with its predicted step, and the two runners-up with theirs
    text = "\n".join(results[0][1]["logged"])
    assert plan["layout"] in text and "predicted step" in text and "runners-up" in text, text
    assert len(plan["runners_up"]) == 2 and all(r["layout"] in text for r in plan["runners_up"])
    assert not results[1][1]["logged"]
