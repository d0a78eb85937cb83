"""The seed schedules as plain data: their plans, orders, bubbles and the settings they refuse (no process group).
Their numbers against one-process references: tests/distributed/test_seed_schedules.py."""

from __future__ import annotations

import pytest

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.schedules import available_schedules, compute_order, get_schedule_spec, plan_schedule, simulate
from lightning_pipe.schedules.pipedream.stages import (
    StashingPipelineStage,
    VersionedPipelineStage,
    pipedream_max_stashes,
    pipedream_version,
)


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


# ------------------------------------------------------------------------------------------------ PipeDream
def versions_from_order(actions: list, m: int) -> tuple[list[int], int]:
    """Replay one rank's executed order: the updates (one per backward) before each forward, and the most distinct
    versions held by micro-batches in flight at once (the stashes)."""
    updates, version, in_flight, most = 0, [0] * m, {}, 0
    for action in actions:
        kind, mb = str(action.computation_type), action.microbatch_index
        if kind.endswith("FORWARD"):
            version[mb] = in_flight[mb] = updates
            most = max(most, len(set(in_flight.values())))
        else:
            del in_flight[mb]
            updates += 1
    return version, most


def test_pipedream_is_registered_with_a_stashing_stage() -> None:
    spec = get_schedule_spec("PipeDream")
    assert spec.stage_class is StashingPipelineStage and spec.stage_class.updates_per_microbatch


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 5), (4, 6)])
def test_pipedream_versions_follow_the_formula_of_its_executed_order(p: int, m: int) -> None:
    """[Note: PipeDream version formula]: the updates before forward j on stage s in the executed 1F1B order,
    and the stashes alive at once; the order and the bubble are 1F1B's."""
    pipedream = plan("pipedream", p, m)
    order = compute_order(pipedream)
    assert order == compute_order(plan("1f1b", p, m))
    assert pipedream.theoretical_bubble() == pytest.approx((p - 1) / (m + p - 1))
    assert simulate(order, p).bubble == pytest.approx(pipedream.theoretical_bubble())
    for s in range(p):
        versions, stashes = versions_from_order(order[s], m)
        assert versions == [pipedream_version(s, p, m, 0, j) for j in range(m)]
        assert stashes == pipedream_max_stashes(s, p, m) <= p - s
        # the next batch starts after all m updates of this one
        assert pipedream_version(s, p, m, 1, 0) == m
    # the paper's steady state: stage 0 trains micro-batch j on the weights before the last p - 1 updates
    assert pipedream_version(0, p, m, 0, m - 1) == m - 1 - (p - 1)
    assert pipedream_version(p - 1, p, m, 0, m - 1) == m - 1  # no staleness on the last stage


@pytest.mark.parametrize(("settings", "names"), [
    ({"microbatches": 2}, ["microbatches=2, pipeline size=4", "schedule.microbatches"]),
    ({"stages_per_rank": 2}, ["stages_per_rank=2", "schedule.stages_per_rank"]),
    ({"recompute": "all"}, ["recompute='all'", "strategy.recompute", "functional_call"]),
])
def test_pipedream_refuses_what_cannot_hold(settings: dict, names: list[str]) -> None:
    with pytest.raises(PipelineConfigError) as err:
        plan_schedule(PipelineConfig(schedule="pipedream", **{"microbatches": 8, **settings}), 4)
    for name in names:
        assert name in str(err.value)


def test_each_seed_schedule_lives_in_its_folder() -> None:
    """A seed schedule's spec names its own classes, all in its folder of schedules/; every stage the engine builds
    derives from the one base that declares the engine's hooks (runtime/stage.py)."""
    from lightning_pipe.runtime.stage import PipelineStage

    folders = {"pipedream": "pipedream", "pipedream_2bw": "pipedream", "pipemare": "pipemare", "chimera": "chimera"}
    for name, folder in folders.items():
        spec = get_schedule_spec(name)
        own = [cls for cls in (spec.stage_class, spec.engine) if cls is not None]
        assert own, name
        for cls in own:
            assert cls.__module__.startswith(f"lightning_pipe.schedules.{folder}."), (name, cls)
        if spec.stage_class is not None:
            assert issubclass(spec.stage_class, PipelineStage)


def test_a_resume_says_what_the_checkpoint_could_not_hold() -> None:
    """PipeDream-2BW's stash and PipeMare's correction velocity are not checkpointed: resuming warns (the strategy
    says the spec's caveat); PipeDream (stashes drained at each batch's end) and PipeMare without correction resume
    exactly and say nothing."""
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.schedules.registry import get_schedule_spec

    def caveat(name: str, **options: object) -> str | None:
        spec = get_schedule_spec(name)
        config = PipelineConfig(schedule=name, schedule_options=dict(options))
        return spec.resume_caveat(config) if spec.resume_caveat is not None else None

    assert "stash" in (caveat("pipedream_2bw") or "")
    assert "delta" in (caveat("pipemare") or "")
    assert caveat("pipemare", discrepancy_correction=False) is None
    assert caveat("pipedream") is None and caveat("1f1b") is None
