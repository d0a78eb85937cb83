"""The seed schedules as plain data: their plans, orders, bubbles and the settings they refuse (no process group).
Their numbers against one-process references: tests/distributed/test_seed_schedules.py."""

from __future__ import annotations

import pytest

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.schedules import available_schedules, compute_order, get_schedule_spec, plan_schedule, simulate
from lightning_pipe.versioned import VersionedPipelineStage


def plan(name: str, p: int = 2, m: int | None = 4, **settings):
    return plan_schedule(PipelineConfig(schedule=name, microbatches=m, **settings), p)


def test_pipedream_2bw_is_registered_with_a_versioned_stage() -> None:
    assert "pipedream_2bw" in available_schedules()
    assert get_schedule_spec("PipeDream_2BW").stage_class is VersionedPipelineStage


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_pipedream_2bw_runs_the_1f1b_order(p: int, m: int) -> None:
    two_bw, one_f_one_b = plan("pipedream_2bw", p, m), plan("1f1b", p, m)
    assert (two_bw.pipeline_size, two_bw.stages_per_rank, two_bw.microbatches) == (p, 1, m)
    assert compute_order(two_bw) == compute_order(one_f_one_b)
    # torch's runtime flushes every batch: the bubble is 1F1B's, in theory and in the replayed order
    assert two_bw.theoretical_bubble() == pytest.approx((p - 1) / (m + p - 1))
    assert simulate(compute_order(two_bw), p).bubble == pytest.approx(two_bw.theoretical_bubble())


def test_pipedream_2bw_defaults_to_two_micro_batches_per_rank() -> None:
    assert plan("pipedream_2bw", 4, None).microbatches == 8


@pytest.mark.parametrize(("settings", "names"), [
    ({"microbatches": 2}, ["microbatches=2, pipeline size=4", "schedule.microbatches"]),
    ({"stages_per_rank": 2}, ["stages_per_rank=2", "schedule.stages_per_rank"]),
    ({"recompute": "all"}, ["recompute='all'", "strategy.recompute", "functional_call"]),
    ({"recompute": 2}, ["recompute=2", "strategy.recompute"]),
])
def test_pipedream_2bw_refuses_what_cannot_hold(settings: dict, names: list[str]) -> None:
    config = PipelineConfig(schedule="pipedream_2bw", **{"microbatches": 8, **settings})
    with pytest.raises(PipelineConfigError) as err:
        plan_schedule(config, 4)
    for name in names:
        assert name in str(err.value)


def test_pipedream_2bw_takes_no_options() -> None:
    with pytest.raises(PipelineConfigError, match="takes no options"):
        plan_schedule(PipelineConfig(schedule="pipedream_2bw", schedule_options={"actions": [[]]}), 2)
