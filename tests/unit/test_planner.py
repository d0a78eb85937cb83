"""The planner as plain data: the costed replay against torch's orders and the theory, the search against brute
force, memory budgets, slow ranks, plan files; and the profiler on a small model (also built on meta)."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from torch import nn

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.layers.partition import uniform_counts
from lightning_pipe.planner import LayerCost, ModelProfile, apply_plan, explain, profile_model, search, to_plan
from lightning_pipe.planner.__main__ import main as cli
from lightning_pipe.planner.model import CostModel, predict
from lightning_pipe.planner.search import combinations, compositions, parse_bytes
from lightning_pipe.schedules import compute_order, plan_schedule, simulate
from lightning_pipe.schedules.simulate import compile_order, peak_activations, replay
from tests.torch_tiers import needs

NAMED = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("zb_h1", 2), ("zbv", 2),
         ("dualpipev", 2)]


def plan(name: str, p: int, v: int, m: int):
    return plan_schedule(PipelineConfig(schedule=name, stages_per_rank=v, microbatches=m), p)


def unit_costs(stages: int) -> dict:
    return {(s, k): c for s in range(stages) for k, c in zip("FBIW", (1.0, 2.0, 1.0, 1.0))}


@pytest.mark.parametrize("name,v", NAMED)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_replay_runs_torchs_order_like_the_plain_simulator(name: str, v: int, p: int, m: int) -> None:
    pl = plan(name, p, v, m)
    order = compute_order(pl)  # torch's own schedule code (single-stage ones: what their loop runs)
    compiled = compile_order(order, pl.num_stages)
    run = replay(compiled, unit_costs(pl.num_stages))
    ref = simulate(order, pl.num_stages)
    assert run.makespan == pytest.approx(ref.makespan)
    # every action of every rank ran: F + (B or I + W) = 3 units per stage and micro-batch
    assert sum(run.busy) == pytest.approx(3.0 * pl.num_stages * m)
    assert compiled.stage_rank == tuple(pl.stage_to_rank(s) for s in range(pl.num_stages))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 12)])
def test_equal_costs_give_the_theoretical_bubble(name: str, p: int, m: int) -> None:
    pl = plan(name, p, 1, m)
    run = replay(compile_order(compute_order(pl), pl.num_stages), unit_costs(p))
    assert run.bubble == pytest.approx(pl.theoretical_bubble()) == pytest.approx((p - 1) / (m + p - 1))


def test_communication_delays_every_crossing() -> None:
    pl = plan("gpipe", 2, 1, 1)
    run = replay(compile_order(compute_order(pl), 2), unit_costs(2), comm=[0.5, 0.0])
    assert run.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_activation_peaks_follow_the_schedule() -> None:
    p, m = 4, 8
    gpipe = peak_activations(compile_order(compute_order(plan("gpipe", p, 1, m)), p), [1.0] * p)
    ofob = peak_activations(compile_order(compute_order(plan("1f1b", p, 1, m)), p), [1.0] * p)
    assert gpipe == [m] * p  # every micro-batch in flight before the first backward
    assert ofob == [p - r for r in range(p)]  # 1F1B: p - r warm-up forwards


def synthetic(n: int, seed: int = 0, sizes=(1, 2, 4, 8)) -> ModelProfile:
    rng = random.Random(seed)
    base = [rng.uniform(0.5, 3.0) for _ in range(n)]
    layers = {b: [LayerCost(1e-3 * t * b, 2e-3 * t * b, 1e-3 * t * b, 1e-3 * t * b, int(1e5 * t * b), 4096 * b,
                            int(1e6 * t)) for t in base] for b in sizes}
    return ModelProfile(layers, link_latency=1e-4, link_bandwidth=1e9)


@needs("split_backward")
@pytest.mark.parametrize("seed", [0, 1])
def test_search_finds_the_brute_force_optimum(seed: int) -> None:
    profile = synthetic(6, seed)
    result = search(profile, world_size=2, batch_size=8, schedules=["gpipe", "1f1b", "zbv", "interleaved_1f1b"])
    brute = min(
        predict(CostModel(profile, 8 / dp / pl.microbatches, [1.0] * pp), compile_order(compute_order(pl),
                                                                                       pl.num_stages), c, dp).step_time
        for pp, dp, pl in combinations(2, 8, 6, ["gpipe", "1f1b", "zbv", "interleaved_1f1b"])
        for c in compositions(6, pl.num_stages))
    assert result.best[1].step_time == pytest.approx(brute)
    # the beam search (used when splits are too many to enumerate) finds it here too
    beam = search(profile, world_size=2, batch_size=8, schedules=["gpipe", "1f1b", "zbv", "interleaved_1f1b"],
                  exhaustive_limit=0)
    assert beam.best[1].step_time <= 1.02 * brute
    assert [c.step_time for _, c in result.ranked] == sorted(c.step_time for _, c in result.ranked)


def test_search_weighs_pipeline_depth_against_replicas() -> None:
    result = search(synthetic(8), world_size=4, batch_size=16, schedules=["1f1b"])
    shapes = {(c.pipeline_size, c.data_parallel_size) for c, _ in result.ranked}
    assert shapes == {(2, 2), (4, 1)}


def test_memory_budget_drops_plans_and_refuses_with_the_peak() -> None:
    profile = synthetic(6)
    free = search(profile, 2, 8, schedules=["gpipe", "1f1b"])
    peaks = sorted(max(p.peak_memory) for _, p in free.ranked)
    budget = peaks[len(peaks) // 2]
    tight = search(profile, 2, 8, budget, schedules=["gpipe", "1f1b"])
    assert all(max(p.peak_memory) <= budget for _, p in tight.ranked)
    with pytest.raises(PipelineConfigError, match=r"smallest predicted peak is [\d,]+ bytes.*memory_budget"):
        search(profile, 2, 8, 1000, schedules=["gpipe", "1f1b"])
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MB") == 512 * 10**6


def test_a_slow_rank_gets_less_work() -> None:
    profile = synthetic(10, seed=3)
    even = search(profile, 2, 8, schedules=["1f1b"]).best[0].counts
    slow = search(profile, 2, 8, schedules=["1f1b"], speeds=[1.0, 2.0]).best[0].counts
    times = [c.forward + c.backward for c in profile.at(1)]
    assert sum(times[slow[0]:]) < sum(times[even[0]:])  # rank 1 (slowed 2x) holds less compute


def test_plan_file_round_trip_and_replay(tmp_path) -> None:
    result = search(synthetic(6), 2, 8)
    plan = to_plan(result, 8)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    kwargs = apply_plan(path, world_size=2, num_layers=6)
    best = result.best[0]
    assert kwargs["schedule"] == best.schedule and kwargs["microbatches"] == best.microbatches
    assert list(kwargs.get("partition", kwargs.get("split"))) == list(best.counts)
    assert plan["layout"].startswith(f"{best.schedule} m={best.microbatches}") and "rank 1:" in plan["layout"]
    assert len(plan["runners_up"]) == 2 and "runners-up" in explain(plan)
    with pytest.raises(PipelineConfigError, match="world of 4.*devices"):
        apply_plan(path, world_size=4)
    with pytest.raises(PipelineConfigError, match="cover the model's layers"):
        apply_plan(path, num_layers=7)
    assert cli(["validate", str(path), "--world", "2"]) == 0
    assert cli(["validate", str(path), "--world", "3"]) == 2


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 4))

    def split_batch(self, batch):
        return batch

    def loss_fn(self, out, target):
        return nn.functional.mse_loss(out, target)


def test_profile_measures_every_layer_and_frees_meta_layers() -> None:
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    prof = profile_model(Chain(), batch, [2, 8], repeats=1)
    first, tanh, mid, last = prof.layers[8]
    assert mid.forward > 0 and mid.backward > 0 and mid.input_grad > 0 and mid.weight_grad > 0
    assert mid.param_bytes == (64 * 64 + 64) * 4 and tanh.param_bytes == 0
    assert mid.output_bytes == 8 * 64 * 4 and prof.layers[2][2].output_bytes == 2 * 64 * 4
    assert mid.saved_bytes >= 8 * 64 * 4  # the linear keeps its input for the weight gradient
    with torch.device("meta"):
        meta = Chain()
    prof_meta = profile_model(meta, batch, [8], repeats=1)
    assert prof_meta.layers[8][2].output_bytes == mid.output_bytes
    assert all(p.is_meta for p in meta.parameters())  # profiled one layer at a time, then freed again
    assert ModelProfile.from_json(json.loads(json.dumps(prof.to_json()))).layers == prof.layers


@needs("split_backward")
def test_the_strategy_replays_a_plan_file(tmp_path) -> None:
    from lightning_pipe import PipelineStrategy

    best = search(synthetic(6), 2, 8, schedules=["zbv"]).best[0]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(to_plan(search(synthetic(6), 2, 8, schedules=["zbv"]), 8)))
    config = PipelineStrategy(plan=str(path)).pipeline_config
    assert (config.schedule, config.microbatches, config.stages_per_rank) == ("zbv", best.microbatches, 2)
    assert list(getattr(config, "partition", None) or config.split) == list(best.counts)
    with pytest.raises(PipelineConfigError, match="plan"):
        PipelineStrategy(plan=str(tmp_path / "missing.json"))


def test_replay_refuses_a_deadlocked_order() -> None:
    from lightning_pipe._compat.torch import parse_action
    from lightning_pipe.schedules import ScheduleDeadlock

    # rank 0 wants the backward of micro-batch 0 before sending its forward: nobody can move
    order = {0: [parse_action(a) for a in ("0B0", "0F0")], 1: [parse_action(a) for a in ("1F0", "1B0")]}
    with pytest.raises(ScheduleDeadlock, match="rank 0, step 0: .0B0. waits for .0F0."):
        replay(compile_order(order, 2), unit_costs(2))


# ------------------------------------------------------------------ partition="time"/"memory", validate, calibration
@pytest.mark.parametrize("name,refused", [("1f1b", []), ("pipedream", ["recompute"]), ("pipemare", ["recompute", "offload"])])
def test_a_budget_no_split_fits_suggests_only_what_the_schedule_accepts(name: str, refused: list[str]) -> None:
    from lightning_pipe.planner import balance_split

    with pytest.raises(PipelineConfigError, match="No split of this schedule fits") as err:
        balance_split(synthetic(6), plan(name, 2, 1, 4), 8, "time", memory_budget=1024)
    message = str(err.value)
    assert "over every split" in message and "partition='memory'" not in message  # 6 layers: every split was tried
    for lever in ("recompute", "offload"):
        assert (f"enable {lever}" in message) == (lever not in refused), message
    if len(refused) == 2:
        assert "choose a schedule" in message and "Change `memory_budget`" in message and "`schedule`" in message


def test_a_schedule_whose_rules_need_its_options_keeps_both_memory_levers() -> None:
    from lightning_pipe.planner.balance import _memory_levers

    custom = plan_schedule(PipelineConfig(schedule="custom", schedule_options={
        "actions": [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]}), 2)
    assert _memory_levers(custom, None) == ["recompute", "offload"]  # its rules refuse no lever, only missing lists


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zbv", 2)])
def test_balance_split_is_the_best_split_of_the_fixed_schedule(name: str, v: int) -> None:
    from lightning_pipe.planner import balance_split

    profile = synthetic(7, seed=2)
    pl = plan(name, 2, v, 4)
    compiled = compile_order(compute_order(pl), pl.num_stages)
    model = CostModel(profile, 2, [1.0, 1.0])
    preds = {c: predict(model, compiled, c, 1) for c in compositions(7, pl.num_stages)}
    fast = balance_split(profile, pl, 8, "time")
    cand, pred = fast.best
    assert (cand.schedule, cand.microbatches, cand.stages_per_rank) == (name, 4, v)  # nothing else changes
    assert pred.step_time == pytest.approx(min(p.step_time for p in preds.values()))
    small = balance_split(profile, pl, 8, "memory").best[1]
    assert max(small.peak_memory) == min(max(p.peak_memory) for p in preds.values())
    # the uniform split rides along for comparison (unless it is the best)
    assert fast.ranked[-1][0].counts == tuple(uniform_counts(7, pl.num_stages))
    plan_json = to_plan(fast, 8, 2)
    assert plan_json["partition"] == list(cand.counts)
    assert [r["partition"] for r in plan_json["runners_up"]] == [list(c.counts) for c, _ in fast.ranked[1:]]
    assert plan_json["predicted_schedule_ms"] <= plan_json["predicted_step_ms"]
    assert len(plan_json["predicted_action_ms"]) == pl.num_stages


def test_measured_partitions_are_settings_resolved_by_the_strategy() -> None:
    from lightning_pipe.layers.partition import partition_layers

    assert PipelineConfig(partition="Time").partition == "time"
    with pytest.raises(PipelineConfigError, match="measured at setup.*strategy.partition"):
        partition_layers(8, 2, "memory")


def test_action_cost_is_solved_from_a_step() -> None:
    from lightning_pipe.planner.calibrate import solve_action_cost

    pl = plan("gpipe", 2, 1, 8)
    x, latency = 3e-4, 5e-5
    step = replay(compile_order(compute_order(pl), 2), {(s, k): x for s in range(2) for k in "FBIW"},
                  [latency, latency]).makespan
    assert solve_action_cost(step, 2, 8, latency) == pytest.approx(x, rel=1e-6)
    assert solve_action_cost(1e-9, 2, 8, latency) == 0.0  # faster than the links alone: no cost per action


def test_fixed_and_per_microbatch_step_costs_are_solved_and_predicted() -> None:
    """[Note: fixed and per-micro-batch step costs]: steps built from known costs give them back, and the cost model
    adds them: the fixed cost once per step, the per-micro-batch cost m times, to the schedule's prediction too."""
    import dataclasses

    from lightning_pipe.planner.calibrate import solve_step_costs

    x, latency, fixed, per_mb = 3e-4, 5e-5, 2e-3, 1.5e-4

    def step(m: int, layer: dict | None = None) -> float:
        pl = plan("1f1b", 2, 1, m)
        costs = {(s, k): x + (layer or {}).get(k, 0.0) for s in range(2) for k in "FBIW"}
        return fixed + replay(compile_order(compute_order(pl), 2), costs, [latency, latency]).makespan + m * per_mb

    got = solve_step_costs("1f1b", 2, 1, {4: step(4), 8: step(8)}, x, latency)
    assert got == pytest.approx((fixed, per_mb), rel=1e-6)
    # the probe's own layers (their profiled time per micro-batch size) are not a host cost
    layers = {4: {"F": 2e-4, "B": 4e-4}, 8: {"F": 1e-4, "B": 2e-4}}
    measured = {m: step(m, layers[m]) for m in (4, 8)}
    assert solve_step_costs("1f1b", 2, 1, measured, x, latency, layers) == pytest.approx((fixed, per_mb), rel=1e-6)
    assert solve_step_costs("1f1b", 2, 1, {4: 1e-9, 8: 1e-9}, x, latency) == (0.0, 0.0)  # never negative
    with pytest.raises(ValueError, match="two micro-batch counts"):
        solve_step_costs("1f1b", 2, 1, {4: step(4)}, x, latency)

    prof = synthetic(6)
    timed = dataclasses.replace(prof, step_overhead=fixed, microbatch_overhead=per_mb)
    assert ModelProfile.from_json(json.loads(json.dumps(timed.to_json()))) == timed
    for name, v, m in (("1f1b", 1, 8), ("zbv", 2, 4)):
        pl = plan(name, 2, v, m)
        compiled = compile_order(compute_order(pl), pl.num_stages)
        assert compiled.microbatches == m
        counts = uniform_counts(6, pl.num_stages)
        bare, costed = (predict(CostModel(p, 2, [1.0, 1.0]), compiled, counts, 1) for p in (prof, timed))
        assert costed.schedule_time == pytest.approx(bare.schedule_time + m * per_mb)
        assert costed.step_time == pytest.approx(bare.step_time + m * per_mb + fixed)
        assert costed.costs == bare.costs and costed.bubble == bare.bubble


def _records_like(plan_json: dict, scale: float) -> list:
    """A timeline of one step in which every action took ``scale`` times its predicted duration."""
    from lightning_pipe.trace.records import Slice, StepRecord

    pl = plan(plan_json["schedule"], 2, plan_json["stages_per_rank"], plan_json["microbatches"])
    records = []
    for rank, actions in compute_order(pl).items():
        t, slices = 0, []
        for a in (a for a in actions if a is not None):
            s, k = a.stage_index, a.computation_type.value
            d = int(plan_json["predicted_action_ms"][s][k] * scale * 1e6)
            slices.append(Slice(k, s, a.microbatch_index, t, t + d))
            t += d + 1000
        records.append(StepRecord(rank, rank, 0, pl.stages_of_rank(rank), 1, 0, t, slices))
    return records


def test_drift_per_kind_and_calibration(tmp_path) -> None:
    from lightning_pipe.planner import balance_split, calibrate, drift_by_kind
    from lightning_pipe.trace.records import save_records

    profile = synthetic(6)
    plan_json = to_plan(balance_split(profile, plan("zbv", 2, 2, 4), 8, "time"), 8, 2)
    rows = {r.what: r for r in drift_by_kind(plan_json, _records_like(plan_json, 1.5))}
    for kind in "FIW":
        assert rows[kind].drift == pytest.approx(0.5, abs=1e-3) and rows[kind].count == 8 * 2
    assert {"idle", "step", "bubble"} <= set(rows)
    hotter = calibrate(profile, list(rows.values()))
    assert hotter.layers[2][3].forward == pytest.approx(1.5 * profile.layers[2][3].forward, rel=1e-3)
    assert hotter.meta["calibrated"]["I"] == pytest.approx(1.5, rel=1e-3)
    # the same from the shell, on files
    plan_path, rec_path, prof_path = tmp_path / "plan.json", tmp_path / "records.json", tmp_path / "profile.json"
    plan_path.write_text(json.dumps(plan_json))
    prof_path.write_text(json.dumps(profile.to_json()))
    save_records(_records_like(plan_json, 1.5), rec_path, {"schedule": "zbv", "m": 4, "v": 2})
    out = tmp_path / "calibrated.json"
    assert cli(["validate", str(plan_path), "--records", str(rec_path), "--profile", str(prof_path),
                "--calibrated-out", str(out)]) == 0
    assert ModelProfile.from_json(json.loads(out.read_text())).meta["calibrated"]["F"] == pytest.approx(1.5, rel=1e-3)


def test_a_plan_for_another_model_is_refused_naming_the_plan(tmp_path) -> None:
    """A plan searched for a 6-layer model, used on the 4-layer Chain (and one covering 5 of 7 layers): the error
    names the plan file and the `plan` setting, not the `partition` the plan replaced (the user never set it)."""
    from lightning_pipe import PipelineStrategy
    from lightning_pipe.lightning.preflight import check_plan_fits

    path = tmp_path / "plan_gpt6.json"
    path.write_text(json.dumps(to_plan(search(synthetic(6), 2, 8, schedules=["1f1b"]), 8)))
    strategy = PipelineStrategy(plan=str(path))
    with pytest.raises(PipelineConfigError) as err:
        check_plan_fits(strategy._plan_source, strategy._plan_name, Chain(), "layers")
    message = str(err.value)
    assert "plan_gpt6.json" in message and "a model of 4 layers" in message and "sum 6" in message, message
    assert "Change `plan`" in message and "partition`" not in message, message
    short = dict(json.loads(path.read_text()), partition=[3, 2])  # 5 of 7 layers
    with pytest.raises(PipelineConfigError, match=r"partition \[3, 2\] \(sum 5\) for a model of 7 layers"):
        apply_plan(short, num_layers=7)


def test_the_planner_refuses_bad_inputs_with_the_rule() -> None:
    """Inputs a user can get wrong: speeds that do not give one positive slowness per rank, a budget in unknown units,
    and a hand-written plan without predictions (explained as a layout, not a KeyError)."""
    profile = synthetic(6)
    for speeds in ([1.0], [1.0, 0.0], [1.0, -1.0, 1.0]):
        with pytest.raises(ValueError, match=r"speeds: one slowness per rank of the world, each > 0"):
            search(profile, 2, 8, schedules=["gpipe"], speeds=speeds)
    with pytest.raises(PipelineConfigError, match=r"Got memory_budget='10XB'"):
        parse_bytes("10XB")
    hand = {"format": "lightning_pipe.plan/1", "schedule": "gpipe", "microbatches": 2, "stages_per_rank": 1,
            "pipeline_size": 2, "data_parallel_size": 1, "partition": [3, 3]}
    assert explain(hand).splitlines() == ["plan: pp 2 x dp 1, gpipe, v=1, m=2, partition [3, 3]",
                                          "  (no prediction: not written by `python -m lightning_pipe.planner "
                                          "search`)"]


def test_validate_refuses_records_of_another_split(tmp_path) -> None:
    """`planner validate --records` compares a run with its plan: records of another split, or of a run that
    rebalanced between two splits, are refused (their drift would be read as the model's)."""
    from lightning_pipe.trace.records import Slice, StepRecord, save_records

    plan = to_plan(search(synthetic(6), 2, 8, schedules=["1f1b"], microbatches=[2]), 8)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    rec = [StepRecord(r, r, 0, [r], 0, 0, 1_000_000, [Slice("F", r, 0, 0, 1000)]) for r in (0, 1)]
    meta = {"schedule": "1f1b", "p": 2, "v": 1, "m": 2}
    other = [plan["partition"][0] + 1, plan["partition"][1] - 1]
    save_records(rec, tmp_path / "other.json", {**meta, "counts": other})
    with pytest.raises(SystemExit, match=re.escape(f"the records are of the split {other}, the plan's is")):
        cli(["validate", str(plan_path), "--world", "2", "--records", str(tmp_path / "other.json")])
    save_records(rec, tmp_path / "moved.json", {**meta, "counts": plan["partition"], "counts_at_end": other})
    with pytest.raises(SystemExit, match=r"the records span a rebalance"):
        cli(["validate", str(plan_path), "--world", "2", "--records", str(tmp_path / "moved.json")])
