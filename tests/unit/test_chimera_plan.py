"""Chimera as plain data: placement, the merged order (complete, in order per stage, accepted by the simulator's
deadlock check), its bubble, and the settings it refuses (no process group). Its numbers against one device:
tests/distributed/test_chimera.py."""

from __future__ import annotations

import pytest

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.schedules import available_schedules, compute_order, plan_schedule, simulate
from lightning_pipe.schedules.chimera.runtime import pipeline_of
from lightning_pipe.schedules.chimera.spec import PRIORITIES, bubble_chimera, chimera_order, list_schedule, stage_rank


def plan(p: int = 4, m: int | None = 8, **settings):
    return plan_schedule(PipelineConfig(schedule="chimera", microbatches=m, **settings), p)


def test_registered_with_mirror_placement() -> None:
    assert "chimera" in available_schedules()
    pl = plan(4)
    assert (pl.num_stages, pl.stages_per_rank, pl.microbatches) == (4, 1, 8)
    assert [pl.stages_of_rank(r) for r in range(4)] == [[0, 3], [1, 2], [1, 2], [0, 3]]
    assert [pl.ranks_of_stage(s) for s in range(4)] == [[0, 3], [1, 2], [1, 2], [0, 3]]
    assert pl.stage_to_rank(3) == 3  # the down pipeline's copy: where evaluation's last stage is
    assert plan(4, None).microbatches == 8
    assert plan(2).stages_of_rank(0) == plan(2).stages_of_rank(1) == [0, 1]


CONFIGS = [(p, m) for p in (2, 4, 6, 8) for m in (2, p, 2 * p, 4 * p)]


@pytest.mark.parametrize(("p", "m"), CONFIGS)
def test_merged_order_is_complete_in_order_and_deadlock_free(p: int, m: int) -> None:
    order = compute_order(plan(p, m))
    assert order == chimera_order(p, m)
    seen: dict[tuple[int, str, int], int] = {}
    per_stage: dict[tuple[int, int, str], list[int]] = {}
    for rank, actions in order.items():
        for a in actions:
            s, kind, mb = a.stage_index, a.computation_type.value, a.microbatch_index
            q = pipeline_of(mb, m)
            assert stage_rank(q, s, p) == rank, f"{a} on rank {rank}"
            assert (s, kind, mb) not in seen
            seen[(s, kind, mb)] = rank
            per_stage.setdefault((q, s, kind), []).append(mb)
    assert set(seen) == {(s, k, mb) for s in range(p) for k in "FB" for mb in range(m)}
    # each stage of each pipeline runs its micro-batches in order (untagged P2P: sends and receives must match)
    for (q, _, _), mbs in per_stage.items():
        assert mbs == sorted(mbs) == list(range(q * m // 2, (q + 1) * m // 2))
    # at most p - s micro-batches in flight on stage s of each pipeline (1F1B's activation bound)
    for actions in order.values():
        live: dict[tuple[int, int], int] = {}
        for a in actions:
            key = (pipeline_of(a.microbatch_index, m), a.stage_index)
            live[key] = live.get(key, 0) + (1 if a.computation_type.value == "F" else -1)
            assert live[key] <= p - a.stage_index
    simulate(order, p)  # raises ScheduleDeadlock otherwise
    # the best of the tie-break rules
    spans = [simulate(list_schedule(p, m, rule), p).makespan for rule in PRIORITIES]
    assert simulate(order, p).makespan == pytest.approx(min(spans))


@pytest.mark.parametrize(("p", "m"), [(4, 4), (4, 8), (4, 16), (6, 12), (8, 16)])
def test_bubble_between_the_paper_and_1f1b(p: int, m: int) -> None:
    chimera = simulate(compute_order(plan(p, m)), p).bubble
    one_f_one_b = simulate(compute_order(plan_schedule(PipelineConfig(schedule="1f1b", microbatches=m), p)), p)
    assert plan(p, m).theoretical_bubble() == pytest.approx((p - 2) / (2 * m + p - 2)) == bubble_chimera(p, 1, m)
    assert plan(p, m).theoretical_bubble() - 1e-9 <= chimera < one_f_one_b.bubble


def test_two_ranks_have_no_bubble() -> None:
    assert simulate(compute_order(plan(2, 4)), 2).bubble == pytest.approx(0.0)


@pytest.mark.parametrize(("p", "settings", "names"), [
    (3, {}, ["even pipeline size", "pipeline size=3", "trainer.devices"]),
    (4, {"microbatches": 5}, ["even micro-batch count", "microbatches=5", "schedule.microbatches"]),
    (4, {"stages_per_rank": 2}, ["one stage per rank", "stages_per_rank=2", "schedule.stages_per_rank"]),
])
def test_refuses_what_cannot_hold(p: int, settings: dict, names: list[str]) -> None:
    config = PipelineConfig(schedule="chimera", **{"microbatches": 8, **settings})
    with pytest.raises(PipelineConfigError) as err:
        plan_schedule(config, p)
    for name in names:
        assert name in str(err.value)


def test_refuses_non_cpu_devices_before_any_group() -> None:
    import torch

    from lightning_pipe.schedules.chimera.engine import ChimeraEngine

    with pytest.raises(PipelineConfigError) as err:  # raised before it touches the module, groups or stages
        ChimeraEngine(None, [], [], plan(4), None, torch.device("meta"))  # type: ignore[arg-type]
    assert "CPU (gloo) only" in str(err.value) and "device meta" in str(err.value)
