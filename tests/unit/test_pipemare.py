"""PipeMare's rule as plain data: its plan and order, delays, learning-rate factor, velocity decay, options and the
settings it refuses (no process group). Its numbers against a one-process reference: tests/distributed/test_pipemare.py."""

from __future__ import annotations

import pytest

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.runtime.stage import PipelineStage
from lightning_pipe.schedules import compute_order, get_schedule_spec, plan_schedule, simulate
from lightning_pipe.schedules.pipedream.stages import pipedream_version
from lightning_pipe.schedules.pipemare.rule import (
    DEFAULT_DECAY,
    DEFAULT_WARMUP,
    PipeMareRule,
    backward_version,
    forward_version,
    rule_from_options,
    stage_delay,
)
from lightning_pipe.schedules.pipemare.stages import PipeMareStage


def plan(p: int = 2, m: int | None = 4, **settings):
    return plan_schedule(PipelineConfig(schedule="pipemare", microbatches=m, **settings), p)


def test_pipemare_is_registered_with_its_stage_in_its_folder() -> None:
    spec = get_schedule_spec("pipemare")
    assert spec.stage_class is PipeMareStage and issubclass(PipeMareStage, PipelineStage)
    assert PipeMareStage.updates_per_microbatch
    assert PipeMareStage.__module__.startswith("lightning_pipe.schedules.pipemare.")
    assert set(spec.options) == {"lr_reschedule", "discrepancy_correction"}


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 4), (4, 4), (4, 8)])
def test_pipemare_delays_follow_from_its_executed_order(p: int, m: int) -> None:
    """Replay torch's 1F1B order (what the stage runs): counting each stage's updates (one after every backward,
    applied before the next action) gives the versions the forwards and backwards see."""
    mare = plan(p, m)
    assert compute_order(mare) == compute_order(plan_schedule(PipelineConfig(schedule="1f1b", microbatches=m), p))
    assert simulate(compute_order(mare), p).bubble == pytest.approx((p - 1) / (m + p - 1))
    for s, actions in compute_order(mare).items():
        updates, forward, backward = 0, {}, {}
        for action in actions:
            kind, j = action.computation_type.value, action.microbatch_index
            if kind == "F":
                forward[j] = updates
            else:
                backward[j] = updates
                updates += 1
        assert [forward[j] for j in range(m)] == [forward_version(s, p, m, 0, j) for j in range(m)]
        assert [forward[j] for j in range(m)] == [pipedream_version(s, p, m, 0, j) for j in range(m)]
        assert [backward[j] for j in range(m)] == [backward_version(m, 0, j) for j in range(m)]
        delays = [backward[j] - forward[j] for j in range(m)]
        assert max(delays) == stage_delay(s, p, m) == min(m, p - s) - 1
    assert stage_delay(p - 1, p, m) == 0  # the last stage is synchronous


def test_learning_rate_factor_anneals_from_one_over_the_delay_to_one() -> None:
    rule = PipeMareRule(warmup=10, decay=None)
    assert rule.lr_factor(3, 0) == pytest.approx(1 / 3)
    assert rule.lr_factor(3, 5) == pytest.approx(3 ** -0.5)
    assert rule.lr_factor(3, 10) == rule.lr_factor(3, 99) == 1.0
    assert rule.lr_factor(0, 0) == rule.lr_factor(1, 0) == 1.0  # no delay, nothing to scale
    assert PipeMareRule(warmup=None).lr_factor(3, 0) == 1.0


def test_velocity_decay_spans_the_stage_delay() -> None:
    rule = PipeMareRule(decay=0.1)
    assert rule.gamma(1) == pytest.approx(0.1)
    assert rule.gamma(2) ** 2 == pytest.approx(0.1)  # D over tau_s updates
    assert rule.gamma(0) is None and PipeMareRule(decay=None).gamma(2) is None


@pytest.mark.parametrize(("options", "rule"), [
    ({}, PipeMareRule(DEFAULT_WARMUP, DEFAULT_DECAY)),
    ({"lr_reschedule": True, "discrepancy_correction": True}, PipeMareRule(DEFAULT_WARMUP, DEFAULT_DECAY)),
    ({"lr_reschedule": False, "discrepancy_correction": False}, PipeMareRule(None, None)),
    ({"lr_reschedule": 50, "discrepancy_correction": 0.5}, PipeMareRule(50, 0.5)),
    ({"discrepancy_correction": 0}, PipeMareRule(DEFAULT_WARMUP, 0.0)),
])
def test_options_choose_the_rule(options: dict, rule: PipeMareRule) -> None:
    assert rule_from_options(options) == rule
    assert plan(3, 4, schedule_options=options).microbatches == 4


@pytest.mark.parametrize(("options", "words"), [
    ({"lr_reschedule": 0}, ["lr_reschedule=0", "whole number of updates >= 1", "schedule.options"]),
    ({"lr_reschedule": 2.5}, ["lr_reschedule=2.5", "schedule.options"]),
    ({"discrepancy_correction": 1.0}, ["discrepancy_correction=1.0", "[0, 1)"]),
    ({"discrepancy_correction": "yes"}, ["discrepancy_correction='yes'"]),
    ({"warmup": 3}, ["takes only the options", "['warmup']"]),
])
def test_bad_options_are_refused_with_the_rule(options: dict, words: list[str]) -> None:
    with pytest.raises(PipelineConfigError) as err:
        plan(3, 4, schedule_options=options)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(("settings", "names"), [
    ({"microbatches": 2}, ["microbatches=2, pipeline size=4", "schedule.microbatches"]),
    ({"stages_per_rank": 2}, ["stages_per_rank=2", "schedule.stages_per_rank"]),
    ({"recompute": "all"}, ["recompute='all'", "strategy.recompute", "backward time"]),
    ({"offload": [1]}, ["offload=(1,)", "strategy.offload", "host memory"]),
])
def test_pipemare_refuses_what_cannot_hold(settings: dict, names: list[str]) -> None:
    with pytest.raises(PipelineConfigError) as err:
        plan_schedule(PipelineConfig(schedule="pipemare", **{"microbatches": 8, **settings}), 4)
    for name in names:
        assert name in str(err.value)
