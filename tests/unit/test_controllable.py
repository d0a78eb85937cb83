"""V-Half and V-Min ([Note: memory-capped V schedules] in lightning_pipe/schedules/controllable.py) as plain data:
complete, V-placed, deadlock-free orders whose activation peak stays under the cap; their bubble; the planner
choosing them under a memory budget."""

from __future__ import annotations

import pytest

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.planner import LayerCost, ModelProfile, search
from lightning_pipe.schedules import compute_order, plan_schedule, simulate
from lightning_pipe.schedules.controllable import capped_v_order, memory_cap, repeated_block_order
from lightning_pipe.schedules.custom import validate_actions
from lightning_pipe.schedules.simulate import compile_order, peak_activations
from tests.torch_tiers import needs

NAMES = ("v_half", "v_min")


def plan(name: str, p: int, m: int):
    return plan_schedule(PipelineConfig(schedule=name, microbatches=m), p)


def units(name: str, p: int, m: int) -> list[float]:
    """Per rank, the most stage-micro-batches of activations held at once (F until W)."""
    pl = plan(name, p, m)
    return peak_activations(compile_order(compute_order(pl), pl.num_stages), [1.0] * pl.num_stages)


CASES = [(name, p, m) for name in NAMES for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


@pytest.mark.parametrize("name,p,m", CASES, ids=[f"{n}-p{p}-m{m}" for n, p, m in CASES])
def test_orders_are_complete_v_placed_deadlock_free_and_capped(name: str, p: int, m: int) -> None:
    pl = plan(name, p, m)
    order = compute_order(pl)
    stage_ranks, micro = validate_actions([order[r] for r in range(p)], p, m, "v", 2)  # + torch's own checks
    assert micro == m and stage_ranks == tuple(pl.stage_to_rank(s) for s in range(2 * p))
    assert all(pl.stages_of_rank(r) == [r, 2 * p - 1 - r] for r in range(p))
    assert {a.computation_type.value for acts in order.values() for a in acts} == {"F", "I", "W"}
    simulate(order, 2 * p)  # raises ScheduleDeadlock otherwise
    assert max(units(name, p, m)) <= memory_cap(name, p)


def test_caps_are_half_and_a_third_of_1f1b() -> None:
    # 1F1B's first rank holds p micro-batches = 2p units (a unit: one of the 2p half-size stages, one micro-batch)
    for p in (2, 4, 8):
        assert memory_cap("v_half", p) / (2 * p) == 0.5
    assert [memory_cap("v_min", p) / (2 * p) for p in (2, 3, 4, 6, 8)] == [0.5, 1 / 3, 0.375, 1 / 3, 0.375]
    # at p = 4, m = 8 the caps are reached, and no rank goes beyond them
    assert units("v_half", 4, 8) == [4.0] * 4 and max(units("v_min", 4, 8)) == 3.0
    with pytest.raises(ValueError, match="two units"):
        capped_v_order(4, 8, 1)


def test_without_a_cap_the_rule_gives_zbv_bubble() -> None:
    from lightning_pipe._compat.torch import parse_action

    uncapped = {r: [parse_action(a) for a in row] for r, row in enumerate(capped_v_order(4, 8, 16))}
    zbv = plan_schedule(PipelineConfig(schedule="zbv", stages_per_rank=2, microbatches=8), 4)
    assert simulate(uncapped, 8).bubble == pytest.approx(simulate(compute_order(zbv), 8).bubble)


@pytest.mark.parametrize("p,m,half,low", [(2, 8, 0.262, 0.262), (4, 8, 0.186, 0.489), (4, 16, 0.103, 0.473),
                                          (8, 16, 0.220, 0.381)])
def test_bubble_grows_as_the_cap_shrinks(p: int, m: int, half: float, low: float) -> None:
    """F = I = W (simulate's default): the values quoted in docs/schedules.md. From p = 4 on V-Half idles less than
    1F1B at half its memory (the paper's claim); ZB-V, at 1F1B's memory, least."""
    sim = {name: simulate(compute_order(plan(name, p, m)), 2 * p).bubble for name in NAMES}
    assert sim == pytest.approx({"v_half": half, "v_min": low}, abs=1e-3)
    assert plan("v_half", p, m).theoretical_bubble() == pytest.approx(sim["v_half"])
    zbv = plan_schedule(PipelineConfig(schedule="zbv", stages_per_rank=2, microbatches=m), p)
    assert simulate(compute_order(zbv), 2 * p).bubble < sim["v_half"] <= sim["v_min"]
    if p >= 4:
        assert sim["v_half"] < (p - 1) / (m + p - 1)  # 1F1B's


def test_the_repeated_block_fills_the_steady_state() -> None:
    """Period 6: every rank busy between fill and drain, peak p units (V-Half's cap); a longer period idles."""
    from lightning_pipe._compat.torch import parse_action

    for p, m in ((4, 32), (8, 32)):
        rows = repeated_block_order(p, m, 6)
        order = {r: [parse_action(a) for a in row] for r, row in enumerate(rows)}
        assert max(peak_activations(compile_order(order, 2 * p), [1.0] * (2 * p))) == p
        step = simulate(order, 2 * p)
        assert step.makespan - 6 * m <= 6 * p  # fill + drain only
    with pytest.raises(ValueError, match="period must be >= 6"):
        repeated_block_order(4, 8, 5)


@pytest.mark.parametrize("name", NAMES)
def test_settings_are_checked(name: str) -> None:
    with pytest.raises(PipelineConfigError, match=rf"'{name}' needs stages_per_rank in \[2\].*stages_per_rank=3"):
        plan_schedule(PipelineConfig(schedule=name, stages_per_rank=3, microbatches=8), 2)
    with pytest.raises(PipelineConfigError, match=rf"'{name}' takes only the options \['last_stage_weight'\]"):
        plan_schedule(PipelineConfig(schedule=name, schedule_options={"cap": 2}), 2)
    for bad in ("heavy", 0, -1.0, True):
        with pytest.raises(PipelineConfigError, match="last_stage_weight as a positive number"):
            plan_schedule(PipelineConfig(schedule=name, schedule_options={"last_stage_weight": bad}), 4)
    # rank 0 must fit one micro-batch of stage 0 and of the last stage: 1 + 1.5 > v_min's 2 units at p = 2
    if name == "v_min":
        with pytest.raises(PipelineConfigError, match=r"caps a rank at 2 units.*last_stage_weight=1.5, cap=2"):
            plan_schedule(PipelineConfig(schedule=name, schedule_options={"last_stage_weight": 1.5}), 2)
    assert plan_schedule(PipelineConfig(schedule=name), 4).microbatches == 16


def activation_heavy(n: int) -> ModelProfile:
    """Equal layers whose saved activations outweigh their parameters: the budget is decided by the schedule."""
    layers = {b: [LayerCost(1e-3 * b, 2e-3 * b, 1e-3 * b, 1e-3 * b, 10**6 * b, 4096 * b, 10**3)] * n for b in (1, 2)}
    return ModelProfile(layers, link_latency=1e-4, link_bandwidth=1e9)


@needs("split_backward")
def test_the_planner_picks_them_under_a_memory_budget() -> None:
    kw = {"schedules": ["1f1b", "zbv", "v_half", "v_min"], "pipeline_sizes": [4], "microbatches": [8]}
    free = search(activation_heavy(8), 4, 16, **kw)
    peak = {c.schedule: max(p.peak_memory) for c, p in free.ranked}
    assert peak["v_min"] < peak["v_half"] < min(peak["1f1b"], peak["zbv"])
    assert free.best[0].schedule == "zbv"  # the fastest when memory is free
    tight = search(activation_heavy(8), 4, 16, peak["v_half"], **kw)
    # 1F1B fits too, but only with fewer layers on its first rank: slower
    assert tight.best[0].schedule == "v_half" and "v_min" in {c.schedule for c, _ in tight.ranked}
    assert "zbv" in {r.candidate.schedule for r in tight.refused}
    tighter = search(activation_heavy(8), 4, 16, peak["v_min"], **kw)
    assert tighter.best[0].schedule == "v_min" and "v_half" in {r.candidate.schedule for r in tighter.refused}


def weighted_peaks(name: str, p: int, m: int, last: float, options: dict | None = None) -> list[float]:
    pl = plan_schedule(PipelineConfig(schedule=name, microbatches=m, schedule_options=options or {}), p)
    return peak_activations(compile_order(compute_order(pl), pl.num_stages), [1.0] * (2 * p - 1) + [last])


def test_a_heavier_last_stage_breaks_ties_then_weighs_in_when_given() -> None:
    """bench/memory.py's GPT: the last stage (a block, the norm, the head, the logits and the loss) holds 1.376 units
    per micro-batch. Between orders of equal bubble, V-Min takes the one whose rank 0 never holds the last stage's
    unit next to two first-stage units: 2.376 units, 0.297 of 1F1B's 8 (it was 3.376, 0.422), the bubble unchanged.
    ``last_stage_weight`` counts it in the cap itself: V-Half's rank 0 then stays within p = 4 units too, at the
    price of bubble (18.6 % -> 36.0 %)."""
    w = 1.376
    assert max(weighted_peaks("v_min", 4, 8, w)) == pytest.approx(3.0)  # rank 3; rank 0: 2.376
    assert weighted_peaks("v_min", 4, 8, w)[0] == pytest.approx(2.376)
    assert simulate(compute_order(plan("v_min", 4, 8)), 8).bubble == pytest.approx(0.489, abs=1e-3)
    assert weighted_peaks("v_half", 4, 8, w)[0] == pytest.approx(4.376)  # the default: units, not bytes
    weighted = plan_schedule(PipelineConfig(schedule="v_half", microbatches=8,
                                            schedule_options={"last_stage_weight": w}), 4)
    assert max(weighted_peaks("v_half", 4, 8, w, {"last_stage_weight": w})) <= memory_cap("v_half", 4)
    assert simulate(compute_order(weighted), 8).bubble == pytest.approx(0.360, abs=1e-3)
    for m in (1, 3, 8):  # still complete, V-placed and deadlock-free
        pl = plan_schedule(PipelineConfig(schedule="v_min", microbatches=m,
                                          schedule_options={"last_stage_weight": 2.0}), 4)
        validate_actions([compute_order(pl)[r] for r in range(4)], 4, m, "v", 2)
        assert max(weighted_peaks("v_min", 4, m, 2.0, {"last_stage_weight": 2.0})) <= 3
