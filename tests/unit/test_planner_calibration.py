"""The planner's in-run calibration on plain data (no process group): the strategy's cost per action and the
layers' in-run scale, read from recorded timelines ([Note: the strategy's cost per action, from its own timeline])."""

from __future__ import annotations

import pytest

from lightning_pipe.planner.calibrate import (
    action_cost_from_records,
    fit_action_costs,
    fit_host_costs,
    transfers_posted,
)
from lightning_pipe.planner.model import CostModel, transfers
from lightning_pipe.planner.profile import LayerCost, ModelProfile
from lightning_pipe.trace.records import Slice, StepRecord

MS = 1_000_000  # ns


def _record(rank: int, m: int, step: int, inside: float, around: float, per_step: float, slow: float = 1.0,
            layer: float = 2.0, loss: float = 0.25, wait: float = 3.0) -> StepRecord:
    """One rank's step of m forwards then m backwards (times in ms, all stretched by ``slow``): each compute slice
    is its layer time + ``inside``; before each action ``around`` ms of host work and a P2P wait of ``wait`` ms;
    ``per_step`` ms of host work once at the start; on the last rank a loss slice follows each forward (the layer
    time, as profiled, includes it)."""
    t, slices = per_step * slow, []
    for kind in "FB":
        for mb in range(m):
            t += around * slow
            slices.append(Slice("wait", None, None, int(t * MS), int((t + wait * slow) * MS)))
            t += wait * slow
            body = (layer - (loss if kind == "F" and rank == 1 else 0.0) + inside) * slow
            slices.append(Slice(kind, rank, mb, int(t * MS), int((t + body) * MS)))
            t += body
            if kind == "F" and rank == 1:
                slices.append(Slice("L", rank, mb, int(t * MS), int((t + loss * slow) * MS)))
                t += loss * slow
    return StepRecord(rank, rank, 0, [rank], step, 0, int(t * MS), slices)


def test_the_strategys_action_cost_is_read_from_its_timeline() -> None:
    """[Note: the strategy's cost per action, from its own timeline]: the part inside each compute slice (its
    layer's time taken out, the loss counted with its forward) and the host work around it, as a slope over the
    number of actions (a per-step constant is not a per-action cost), each at its least-disturbed step."""
    inside, around, per_step = 0.4, 0.3, 5.0
    layer_time = {4: {"F": 2e-3, "B": 2e-3}, 8: {"F": 2e-3, "B": 2e-3}}
    records = [_record(rank, m, step, inside, around, per_step, slow=3.0 if step == 1 else 1.0)
               for rank in (0, 1) for m in (4, 8) for step in (0, 1, 2)]
    got_inside, got_around = action_cost_from_records(records, layer_time)
    assert got_inside == pytest.approx(inside * 1e-3, rel=1e-3)
    assert got_around == pytest.approx(around * 1e-3, rel=1e-3)
    # one micro-batch count: no slope to read, the host time is shared out per action (the constant included)
    one = [r for r in records if len(r.slices) < 8 * 4]
    _, shared = action_cost_from_records(one, layer_time)
    assert shared == pytest.approx((around * 8 + per_step) / 8 * 1e-3, rel=1e-3)
    # layers slower than their profile never read as a negative cost
    assert action_cost_from_records(records, {4: {"F": 1.0, "B": 1.0}, 8: {"F": 1.0, "B": 1.0}})[0] == 0.0
    with pytest.raises(ValueError, match="compute slices"):
        action_cost_from_records([StepRecord(0, 0, 0, [0], 0, 0, 1)], layer_time)


def test_layer_scales_and_the_cost_per_action_are_fitted_from_real_model_runs() -> None:
    """Two runs whose stages differ in size: each slice = scale[kind] x its stage's profiled layer time + a constant
    per action, around each action a fixed host time; a disturbed step (everything 3x) is ignored."""
    scale, inside, around = {"F": 0.9, "B": 1.2}, 0.5e-3, 0.3e-3
    runs = []
    for layer_f, layer_b in ((2e-3, 4e-3), (5e-3, 9e-3)):
        layer = {(r, k): (layer_f if k == "F" else layer_b) * (1 + r) for r in (0, 1) for k in "FB"}
        records = []
        for step, slow in enumerate((1.0, 3.0, 1.0)):
            for rank in (0, 1):
                t, slices = 0.0, []
                for kind in "FB":
                    for mb in range(4):
                        t += around * slow
                        body = (scale[kind] * layer[(rank, kind)] + inside) * slow
                        slices.append(Slice(kind, rank, mb, int(t * 1e9), int((t + body) * 1e9)))
                        t += body
                records.append(StepRecord(rank, rank, 0, [rank], step, 0, int(t * 1e9), slices))
        runs.append((records, layer))
    scales, got_inside, got_around, per_transfer = fit_action_costs(runs)
    assert scales == pytest.approx(scale, rel=1e-4)
    assert got_inside == pytest.approx(inside, rel=1e-3) and got_around == pytest.approx(around, rel=1e-3)
    assert per_transfer == 0.0  # these records post nothing
    # every slice 1 ms shorter (a constant below 0): none is charged, the scales alone take the slices
    short = [([StepRecord(r.rank, r.pp_rank, 0, r.stages, r.step, 0, r.end_ns,
                          [Slice(sl.kind, sl.stage, sl.mb, sl.start_ns, sl.end_ns - 1_000_000)
                           for sl in r.slices]) for r in recs], layer) for recs, layer in runs]
    assert fit_action_costs(short)[1] == 0.0
    with pytest.raises(ValueError, match="compute slices"):
        fit_action_costs([([StepRecord(0, 0, 0, [0], 0, 0, 1)], {})])


def _host_record(rank: int, step: int, actions: int, posts: list[str], per_action: float, per_transfer: float,
                 slow: float = 1.0) -> StepRecord:
    """One rank's step: ``actions`` 1-ms forwards, each followed by ``per_action`` ms of host work; then one "post"
    slice per label (its ops joined with " + "), each op costing ``per_transfer`` ms; everything stretched by
    ``slow``."""
    t, slices = 0.0, []
    for mb in range(actions):
        slices.append(Slice("F", rank, mb, int(t * MS), int((t + slow) * MS)))
        t += slow + per_action * slow
    for label in posts:
        cost = per_transfer * len(label.split(" + ")) * slow
        slices.append(Slice("post", None, None, int(t * MS), int((t + cost) * MS), label))
        t += cost
    return StepRecord(rank, rank, 0, [rank], step, 0, int(t * MS), slices)


def test_host_time_is_fitted_per_action_and_per_transfer() -> None:
    """[Note: host cost per transfer]: runs whose ranks post different numbers of transfers per action (fused
    send + receive posts count two) give both costs; a disturbed step (everything 3x) is ignored."""
    per_action, per_transfer = 0.05, 0.3
    mixes = [(8, ["send F0"] + ["send F1 + recv B0"] * 3 + ["recv B3"]),  # 1F1B-like: 8 transfers, 5 posts
             (24, ["send F0", "recv F1"] * 8),  # ZB-V-like: 16 transfers
             (16, ["send F0", "recv F1", "send B0"] * 8)]  # interleaved-like: 24 transfers
    runs = [[_host_record(rank, step, n, posts, per_action, per_transfer, slow)
             for rank in (0, 1) for step, slow in enumerate((1.0, 3.0))] for n, posts in mixes]
    assert transfers_posted(runs[0][0]) == 8
    got_action, got_transfer = fit_host_costs(runs)
    assert got_action == pytest.approx(per_action * 1e-3, rel=1e-3)
    assert got_transfer == pytest.approx(per_transfer * 1e-3, rel=1e-3)
    # no transfers recorded (one rank): all of it per action
    alone = [[_host_record(0, 0, n, [], 0.2, 0.0)] for n in (4, 8)]
    assert fit_host_costs(alone) == pytest.approx((0.2e-3, 0.0), rel=1e-3)
    assert fit_host_costs([]) == (0.0, 0.0)


def test_the_cost_model_charges_each_transfer_to_the_action_that_posts_it() -> None:
    """A forward / backward posts a receive and a send per neighbouring stage on another rank, a weight gradient
    none: with 4 stages interleaved over 2 ranks every boundary crosses; in a V (0, 1, 1, 0) the middle one does
    not."""
    assert [transfers(s, [0, 1, 0, 1]) for s in range(4)] == [1, 2, 2, 1]
    assert [transfers(s, [0, 1, 1, 0]) for s in range(4)] == [1, 1, 1, 1]
    assert [transfers(s, [0, 0]) for s in range(2)] == [0, 0]
    layer = LayerCost(1e-3, 2e-3, 1e-3, 1e-3, 0, 0, 0)
    profile = ModelProfile({4: [layer] * 4}, action_overhead=1e-4, transfer_overhead=5e-4)
    cost = CostModel(profile, 4, [1.0, 1.0]).stage_costs([(s, s + 1) for s in range(4)], [0, 1, 0, 1])
    assert cost[(1, "F")] == pytest.approx(1e-3 + 1e-4 + 2 * 5e-4)
    assert cost[(3, "B")] == pytest.approx(2e-3 + 1e-4 + 5e-4)
    assert cost[(1, "W")] == pytest.approx(1e-3 + 1e-4)
    assert ModelProfile.from_json(profile.to_json()).transfer_overhead == 5e-4
