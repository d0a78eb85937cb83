"""Schedules as plain data (no process group): per-rank action orders, placement, simulated bubbles, and the
errors that refuse impossible settings before anything starts."""

from __future__ import annotations

import pytest

from lightning_pipe import PipelineStrategy
from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.layers.partition import partition_layers
from lightning_pipe.schedules import (
    ScheduleDeadlock,
    available_schedules,
    compute_order,
    plan_schedule,
    simulate,
)
from lightning_pipe.schedules.custom import load_actions, validate_actions

NAMED = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev"]


def plan(name: str, p: int = 2, v: int | None = None, m: int = 4, **options):
    return plan_schedule(PipelineConfig(schedule=name, stages_per_rank=v, microbatches=m, **options), p)


def rows(name: str, p: int = 2, v: int | None = None, m: int = 4) -> dict[int, str]:
    order = compute_order(plan(name, p, v, m))
    return {r: " ".join(str(a) if a is not None else "-" for a in acts) for r, acts in order.items()}


def test_every_schedule_is_registered() -> None:
    # the seed schedules (pipedream_2bw, ...) are tested in test_seed_schedules.py
    assert sorted(NAMED + ["custom", "pipedream", "pipedream_2bw", "pipemare", "chimera", "v_half", "v_min"]) \
        == available_schedules()


# ------------------------------------------------------------------------------------------ orders, p=2, v=2, m=4
# Read from torch 2.13 (single-stage ones: what Schedule*._step_microbatches runs) and checked by hand against
# each schedule's definition; comments say what to look for. "-" is a planned idle step.
EXPECTED = {
    # all forwards, then all backwards
    "gpipe": {0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
              1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"},
    # rank r warms up with p - r forwards, then alternates backward/forward, then drains
    "1f1b": {0: "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
             1: "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"},
    # depth first: rank 0 runs micro-batches 0,1 through stage 0 then stage 2 before the next round
    "interleaved_1f1b": {
        0: "0F0 0F1 2F0 2F1 - - 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 - 2B2 - 2B3 - 0B2 - 0B3",
        1: "- 1F0 1F1 - 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 - 1B2 - 1B3"},
    # breadth first: every micro-batch through stage r, then through stage r+p; backwards in reverse
    "looped_bfs": {
        0: "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 - - 2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0",
        1: "- 1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0"},
    # backward split into input (I) and weight (W) gradients; Ws fill what would be bubbles
    "zb_h1": {
        0: "0F0 0F1 2F0 - 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3",
        1: "- 1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3"},
    # V: rank 0 holds stages 0 and 3 (first and last), rank 1 holds 1 and 2
    "zbv": {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        1: "- 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"},
    # V with overlapped forward/backward pairs of the two chunks
    "dualpipev": {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 (3F3;0B1)OVERLAP_F_B 3B3 "
           "0I2 0W2 0I3 0W3",
        1: "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B (2F3;1B1)OVERLAP_F_B 2B2 1B2 "
           "2I3 1I3 2W3 1W3"},
}


@pytest.mark.parametrize("name", NAMED)
def test_action_order_p2_v2_m4(name: str) -> None:
    assert rows(name) == EXPECTED[name]


CONFIGS = [(name, p, v, m) for p in (2, 3, 4) for (name, v, m) in [
    ("gpipe", 1, 8), ("1f1b", 1, 8), ("interleaved_1f1b", 2, 8), ("interleaved_1f1b", 3, 2 * p),
    ("looped_bfs", 2, 8), ("looped_bfs", 3, 5), ("zb_h1", 1, 8), ("zb_h1", 2, 8), ("zbv", 2, 8), ("zbv", 2, p + 1),
    ("dualpipev", 2, 2 * p), ("dualpipev", 2, 8)]]


@pytest.mark.parametrize("name,p,v,m", CONFIGS, ids=[f"{n}-p{p}-v{v}-m{m}" for n, p, v, m in CONFIGS])
def test_orders_are_complete_placed_and_deadlock_free(name: str, p: int, v: int, m: int) -> None:
    pl = plan(name, p, v, m)
    order = compute_order(pl)
    # our validator (and torch's _validate_schedule / send-recv lowering inside it) accepts every built-in order,
    # and the stages each rank runs are exactly those the plan places there
    stage_ranks, micro = validate_actions([order[r] for r in range(p)], p, m)
    assert micro == m
    assert stage_ranks == tuple(pl.stage_to_rank(s) for s in range(pl.num_stages))
    for r in range(p):
        assert sorted({s for s, rr in enumerate(stage_ranks) if rr == r}) == pl.stages_of_rank(r)
        assert len(pl.stages_of_rank(r)) == v
    if pl.spec.placement == "v":
        assert all(pl.stages_of_rank(r) == [r, 2 * p - 1 - r] for r in range(p))
    else:
        assert all(pl.stages_of_rank(r) == list(range(r, p * v, p)) for r in range(p))
    kinds = {a.computation_type.value for acts in order.values() for a in acts if a is not None}
    if name in ("zb_h1", "zbv"):
        assert "B" not in kinds and {"I", "W"} <= kinds  # split backward everywhere
    if name in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
        assert kinds == {"F", "B"}


def test_looped_bfs_is_breadth_first_and_interleaved_depth_first() -> None:
    p, v, m = 2, 2, 8
    bfs = [a for a in compute_order(plan("looped_bfs", p, v, m))[0] if a is not None and a.computation_type == "F"]
    assert [a.stage_index for a in bfs] == [0] * m + [2] * m
    inter = [a for a in compute_order(plan("interleaved_1f1b", p, v, m))[0]
             if a is not None and a.computation_type == "F"]
    # rounds of p micro-batches per virtual stage: 0,0,2,2,0,0,2,2,...
    assert [a.stage_index for a in inter] == ([0] * p + [2] * p) * (m // p)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_simulated_bubbles(p: int, m: int) -> None:
    sim = {name: simulate(compute_order(pl), pl.num_stages).bubble
           for name in NAMED for pl in [plan(name, p, 1 if name in ("gpipe", "1f1b") else 2, m)]}
    flush = (p - 1) / (m + p - 1)
    assert sim["gpipe"] == pytest.approx(flush) and sim["1f1b"] == pytest.approx(flush)
    assert sim["interleaved_1f1b"] == pytest.approx(plan("interleaved_1f1b", p, 2, m).theoretical_bubble())
    assert sim["interleaved_1f1b"] < sim["1f1b"]
    for zb in ("zb_h1", "zbv", "dualpipev"):
        assert sim[zb] < sim["interleaved_1f1b"], (zb, sim)


# --------------------------------------------------------------------------------------------------------- errors
def _message(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("v", [1, 3])
def test_v_schedules_need_exactly_two_stages_per_rank(name: str, v: int) -> None:
    with pytest.raises(PipelineConfigError) as err:
        plan(name, 2, v, 8)
    msg = _message(err)
    assert f"Schedule '{name}' needs stages_per_rank in [2]" in msg
    assert f"Got stages_per_rank={v}" in msg and "schedule.stages_per_rank" in msg


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zb_h1"])
def test_interleaved_microbatches_must_divide_into_rounds(name: str) -> None:
    with pytest.raises(PipelineConfigError) as err:
        plan(name, 2, 2, 5)  # rounds = 5 // 2 = 2, 5 % 2 != 0
    msg = _message(err)
    assert "multiple of its number of rounds" in msg
    assert "microbatches=5, pipeline size=2, rounds=2" in msg and "schedule.microbatches" in msg
    assert plan(name, 2, 2, 6).microbatches == 6  # 3 rounds


def test_virtual_stages_times_ranks_cannot_exceed_layers() -> None:
    pl = plan("interleaved_1f1b", 4, 3, 8)  # 12 stages
    with pytest.raises(PipelineConfigError) as err:
        partition_layers(8, pl.num_stages, "uniform")
    msg = _message(err)
    assert "12 stages for 8 layers" in msg and "schedule.stages_per_rank" in msg


def test_unknown_schedule_lists_the_known_ones() -> None:
    with pytest.raises(PipelineConfigError) as err:
        plan("zero_bubble_magic")
    msg = _message(err)
    assert "zero_bubble_magic" in msg and "Change `schedule" in msg
    for name in NAMED + ["custom"]:
        assert f"'{name}'" in msg
    with pytest.raises(PipelineConfigError):
        PipelineStrategy(schedule="zero_bubble_magic")  # in the constructor, before any process starts


def test_dualpipev_needs_as_many_microbatches_as_stages() -> None:
    with pytest.raises(PipelineConfigError, match="at least as many micro-batches as stages"):
        plan("dualpipev", 2, 2, 3)


# --------------------------------------------------------------------------------------------------------- custom
ONE_F_ONE_B = [["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
               ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]]


def custom(actions=None, p: int = 2, m: int | None = None, v: int | None = None, **options):
    if actions is not None:
        options["actions"] = actions
    return plan_schedule(PipelineConfig(schedule="custom", microbatches=m, stages_per_rank=v,
                                        schedule_options=options), p)


def test_custom_matches_1f1b_order_and_placement() -> None:
    pl = custom(ONE_F_ONE_B)
    assert (pl.num_stages, pl.microbatches, pl.stage_ranks) == (2, 4, (0, 1))
    assert compute_order(pl) == compute_order(plan("1f1b"))
    assert simulate(compute_order(pl), 2).bubble == pytest.approx(0.2)


def test_custom_placement_is_as_given() -> None:
    contiguous = [["0F0", "1F0", "1B0", "0B0"], ["2F0", "3F0", "3B0", "2B0"]]
    pl = custom(contiguous)
    assert pl.stage_ranks == (0, 0, 1, 1) and pl.stages_of_rank(1) == [2, 3] and pl.microbatches == 1


def test_custom_from_csv_and_comma_strings(tmp_path) -> None:
    zbv = compute_order(plan("zbv", 2, 2, 4))
    path = tmp_path / "zbv.csv"
    path.write_text("\n".join(",".join(str(a) if a else "" for a in zbv[r]) for r in range(2)) + "\n")
    pl = custom(csv=str(path), placement="v")
    assert pl.stage_ranks == (0, 1, 1, 0) and pl.stages_of_rank(0) == [0, 3] and pl.num_stages == 4
    assert [list(row) for row in pl.actions] == [[a for a in zbv[r]] for r in range(2)]
    inline = custom([",".join(row) for row in ONE_F_ONE_B])
    assert inline.actions == custom(ONE_F_ONE_B).actions


BAD = {
    "missing backward": ([["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2"], ONE_F_ONE_B[1]], {},
                         ["Every forward needs its backward", "rank 0, step 5: action '0F3' has no '0B3'"]),
    "missing weight grad": ([["0F0", "0I0"], ["1F0", "1B0"]], {},
                            ["needs its weight-backward", "rank 0, step 1: action '0I0' has no '0W0'"]),
    "stage on two ranks": ([ONE_F_ONE_B[0], ["1F0", "1B0", "0F1"] + ONE_F_ONE_B[1][2:]], {},
                           ["stage 0 is already run by rank 0", "rank 1, step 2: action '0F1'"]),
    "stage not on rank (placement)": ([["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]],
                                      {"placement": "loop"},
                                      ["With placement 'loop' stage 3 lives on rank 1",
                                       "rank 0, step 1: action '3F0'"]),
    "deadlock": ([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]], {},
                 ["deadlock", "rank 0, step 1: '0B0' waits for '1B0'", "rank 1, step 0: '1F1' waits for '0F1'"]),
    "backward before forward": ([["0F0", "0B0"], ["1B0", "1F0"]], {},
                                ["after its forward", "rank 1, step 0: action '1B0' comes before '1F0'"]),
    "W before I": ([["0F0", "0B0"], ["1F0", "1W0", "1I0"]], {},
                   ["follows its input-backward", "rank 1, step 1: action '1W0'"]),
    "duplicate": ([["0F0", "0B0", "0F0"], ["1F0", "1B0"]], {}, ["runs once", "rank 0, step 2: action '0F0'"]),
    "unparsable": ([["0F0", "0X0"], ["1F0", "1B0"]], {}, ["rank 0, step 1: '0X0'"]),
    "communication action": ([["0F0", "0SEND_F0", "0B0"], ["1F0", "1B0"]], {},
                             ["compute-only", "rank 0, step 1: action '0SEND_F0'"]),
    "wrong rank count": ([["0F0", "0B0"]], {}, ["one action list per pipeline rank", "1 action lists"]),
    "missing stage": ([["0F0", "0B0"], ["2F0", "2B0"]], {}, ["stages [1] of 0..2 appear nowhere"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_malformed_custom_lists_are_refused(case: str) -> None:
    actions, options, expected = BAD[case]
    with pytest.raises(PipelineConfigError) as err:
        custom(actions, **options)
    msg = _message(err)
    for part in expected:
        assert part in msg, msg
    # Names the setting with its real Hydra path (`schedule.options`, not `schedule.schedule_options`).
    assert "Change `schedule_options` (PipelineStrategy(schedule_options=...); Hydra: schedule.options)" in msg, msg


def test_custom_microbatches_and_stages_per_rank_must_agree() -> None:
    with pytest.raises(PipelineConfigError, match="rank 0 has no action '0F4'"):
        custom(ONE_F_ONE_B, m=5)
    with pytest.raises(PipelineConfigError, match="Micro-batch indices run from 0 to microbatches - 1 = 2"):
        custom(ONE_F_ONE_B, m=3)
    with pytest.raises(PipelineConfigError, match=r"stages_per_rank=2, stages per rank in the lists \[1, 1\]"):
        custom(ONE_F_ONE_B, v=2)
    with pytest.raises(PipelineConfigError, match="exactly one of"):
        custom()
    with pytest.raises(PipelineConfigError, match="must exist"):
        custom(csv="/nonexistent/schedule.csv")


def test_a_null_option_is_absent(tmp_path) -> None:
    # What `schedule=custom schedule.options.csv=my.csv schedule.options.actions=null` hands the strategy.
    path = tmp_path / "s.csv"
    path.write_text("\n".join(",".join(row) for row in ONE_F_ONE_B) + "\n")
    from_csv = custom(csv=str(path), actions=None, placement=None)
    assert from_csv.actions == custom(ONE_F_ONE_B, csv=None).actions
    assert load_actions({"actions": None, "csv": str(path)}) == load_actions({"csv": str(path)})
    with pytest.raises(PipelineConfigError, match=r"exactly one of.*schedule.options.actions=null"):
        load_actions({"actions": None, "csv": None})
    with pytest.raises(PipelineConfigError, match=r"one list of actions per rank"):
        load_actions({"actions": "0F0,0B0"})


def test_default_stages_per_rank_is_what_the_docs_say() -> None:
    # PipelineConfig.stages_per_rank's docstring, the Schedules table (README, docs/schedules.md) and configs/schedule/*.yaml.
    defaults = {name: plan(name, 2, None, 4).stages_per_rank for name in NAMED}
    assert defaults == {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "zb_h1": 2, "zbv": 2,
                        "dualpipev": 2}
    assert plan("zb_h1", 2, 1, 4).stages_per_rank == 1  # v >= 1


def test_zb_h1_needs_as_many_microbatches_as_pipeline_ranks() -> None:
    with pytest.raises(PipelineConfigError, match="at least as many micro-batches as pipeline ranks"):
        plan("zb_h1", 4, 2, 2)


def test_deadlock_is_reported_by_the_simulator() -> None:
    actions = load_actions({"actions": BAD["deadlock"][0]})
    with pytest.raises(ScheduleDeadlock) as err:
        simulate({r: row for r, row in enumerate(actions)}, 2)
    assert set(err.value.stuck) == {0, 1}


def test_a_split_module_is_reused_by_any_plan_that_places_the_stages_alike() -> None:
    """A module split by one run keeps its cut: a later Trainer may change the micro-batch count or the order of
    the actions, not where the stages live (runtime/build.py refuses that naming both placements)."""
    from lightning_pipe.runtime.build import describe_placement, placement

    assert placement(plan("1f1b", m=4)) == placement(plan("1f1b", m=8)) == placement(plan("gpipe", m=2))
    assert placement(plan("interleaved_1f1b", v=2)) != placement(plan("zbv"))  # 0,1,0,1 against 0,1,1,0
    assert placement(plan("interleaved_1f1b", v=2)) != placement(plan("1f1b"))
    assert describe_placement(plan("zbv")) == ("schedule='zbv' with stages_per_rank=2 on 2 pipeline ranks "
                                               "(stage: rank 0: 0, 1: 1, 2: 1, 3: 0)")
