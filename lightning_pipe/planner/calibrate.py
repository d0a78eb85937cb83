"""The runtime's cost per schedule action, measured on the running ranks.

Each action torch's schedule runs (a stage's forward, backward, input- or weight-gradient) costs more than its
layers' compute: Python dispatch in the stage and the schedule, and posting / waiting on the P2P operations of the
neighbouring stages. The layer profile cannot see it (it times bare layers), yet on CPU it is comparable to a small
layer's compute and it grows with the number of actions (more micro-batches, more stages per rank). Measured here by
running torch's real GPipe schedule over the real process group on stages of one tiny layer each, whose compute is
negligible: the step time, solved against the schedule's own list-scheduled order (with the measured link latency
between ranks), gives the cost of one action.
"""

from __future__ import annotations

# [Note: fixed and per-micro-batch step costs]
# A training step costs more than its schedule's actions (layers + the per-action cost above) and its optimizer: once
# per step, the trainer's loop, data loading, the strategy's pre- and post-step work (batch checks, the loss
# broadcast, the step-boundary agreement, the gradient hand-over); per micro-batch, host work that is not one more
# action (torch splits the batch, the loss is recorded, the strategy's own stages add work per chunk that torch's
# bare stages, which the per-action cost is measured on, do not). Both are measured in the real run: the strategy
# trains a model of near-zero compute (one tiny layer per stage) at two micro-batch counts m1 < m2 under one
# schedule; with every action costing the measured per-action cost, T(m) = fixed + makespan(m) + m x per_mb, so
# two measured steps give both (:func:`solve_step_costs`). The cost model adds ``fixed`` to every step and
# ``m x per_mb`` to the schedule (``ModelProfile.step_overhead`` / ``microbatch_overhead``). Not separated: a cost
# per micro-batch that only some ranks pay (it is charged to the step, as if on its critical path).
import statistics
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from lightning_pipe.config import PipelineConfig
from lightning_pipe.schedules import compute_order, plan_schedule
from lightning_pipe.schedules.simulate import compile_order, replay
from lightning_pipe.trace.records import COMPUTE_KINDS, StepRecord


def solve_action_cost(step_time: float, pipeline_size: int, microbatches: int, latency: float) -> float:
    """The per-action cost x at which GPipe's order, list-scheduled with every action costing x and every
    crossing ``latency``, takes ``step_time`` (bisection: the makespan grows with x)."""
    plan = plan_schedule(PipelineConfig(schedule="gpipe", microbatches=microbatches), pipeline_size)
    compiled = compile_order(compute_order(plan), plan.num_stages)
    comm = [latency] * plan.num_stages

    def makespan(x: float) -> float:
        return replay(compiled, {(s, k): x for s in range(plan.num_stages) for k in "FBIW"}, comm).makespan

    lo, hi = 0.0, max(step_time, 1e-9)
    if makespan(lo) >= step_time:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if makespan(mid) < step_time else (lo, mid)
    return (lo + hi) / 2


def measure_action_overhead(microbatches: int = 8, repeats: int = 4, latency: float = 0.0,
                            device: torch.device | str = "cpu") -> float:
    """Seconds one schedule action costs beyond its layers, on this world (one stage per rank, the default
    group). Collective: every rank calls it; all get the same value (the slowest rank's view)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = nn.Linear(4, 4).to(device)
    stage = PipelineStage(layer, rank, world, device)
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches,
                             loss_fn=lambda out, target: nn.functional.mse_loss(out, target), scale_grads=False)
    x = torch.zeros(microbatches, 4, device=device)
    times = []
    for rep in range(repeats + 1):  # the first step infers shapes
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
        if rep:
            times.append(time.perf_counter() - start)
    # the step as the slowest rank saw it, in its least-disturbed repetition
    slowest = torch.tensor([min(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return solve_action_cost(float(slowest), world, microbatches, latency)


def solve_step_costs(schedule: str, pipeline_size: int, stages_per_rank: int, measured: Mapping[int, float],
                     action_cost: float, latency: float,
                     layer_time: Mapping[int, Mapping[str, float]] | None = None) -> tuple[float, float]:
    """(fixed seconds per step, seconds per micro-batch) from full training steps of a near-zero-compute model
    measured at two micro-batch counts (``measured``: m -> seconds) under ``schedule``: what each step took beyond
    the replay of its actions at ``action_cost`` each (plus, per m, one stage's layer time per kind: ``layer_time``),
    split into a constant and a slope in m (least squares over the points given; both floored at 0)
    ([Note: fixed and per-micro-batch step costs])."""
    if len(measured) < 2:
        raise ValueError(f"solve_step_costs needs steps measured at two micro-batch counts or more; got {measured}")
    points = []
    for m, step in sorted(measured.items()):
        plan = plan_schedule(PipelineConfig(schedule=schedule, microbatches=m, stages_per_rank=stages_per_rank),
                             pipeline_size)
        compiled = compile_order(compute_order(plan), plan.num_stages)
        layers = (layer_time or {}).get(m, {})
        costs = {(s, k): action_cost + layers.get(k, 0.0) for s in range(plan.num_stages) for k in "FBIW"}
        points.append((float(m), step - replay(compiled, costs, [latency] * plan.num_stages).makespan))
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


# [Note: the strategy's cost per action, from its own timeline]
# ``measure_action_overhead`` times torch's bare stages on a 4-float layer. The strategy's actions cost more, and
# by how much depends on the model: inside each compute slice beyond its layers' profiled time (the stage wrapper,
# the random streams, the timeline's marks, the loss record, allocating the real activations, caches refilled when
# the rank switches stage or micro-batch), and around it (posting the P2P batches of real tensors, bookkeeping).
# The layers themselves also run at an in-run speed that differs from their isolated profile (hot caches there).
# Both are read from recorded timelines, each action and each rank at its least-disturbed recorded step (contention
# only adds time; give the fastest whole step alone where slow phases change within a step, or the fastest of each
# action sums to a step no run takes: bench/planner.py does): the real model's probe runs (stages of different sizes, so a per-kind scale of the profiled layer
# time and a constant per action can be told apart: :func:`fit_action_costs`), and the near-zero-compute runs
# that solve the fixed and per-micro-batch step costs (:func:`action_cost_from_records`: the constant per action
# at tiny sizes, so those runs' own actions are not mistaken for step costs). Around an action: the schedule's
# wall time minus its compute slices and its blocking P2P waits (waiting is the replay's business: it follows
# from the order, the costs and the link). The cost model charges the sum (in + around) per action, on the rank.
def action_cost_from_records(records: Sequence[StepRecord],
                             layer_time: Mapping[int, Mapping[str, float]]) -> tuple[float, float]:
    """(seconds per action inside its compute slice, seconds per action around it) of the strategy's runtime, from
    the recorded timelines of near-zero-compute runs ([Note: the strategy's cost per action, from its own
    timeline]). ``records``: every rank's :class:`StepRecord` of runs at one or more micro-batch counts (``m`` is
    read from the records: the forwards of a stage); ``layer_time``: m -> the per-kind (F, B, I, W) profiled time of
    one probe layer at that micro-batch size, taken out of the slices. The host time around the slices is regressed
    on each rank's number of actions across micro-batch counts (a per-step constant is no cost per action; with one
    count it is shared out per action). Both results are floored at 0."""
    inside: dict[tuple[int, int, int, str, int | None], float] = {}  # (m, rank, stage, kind, mb) -> least seconds
    host: dict[tuple[int, int], tuple[int, float]] = {}  # (m, rank) -> (actions, least host seconds)
    for rec in records:
        forwards = {(sl.stage, sl.mb) for sl in rec.slices if sl.kind == "F"}
        stages = {st for st, _ in forwards}
        m = len(forwards) // max(len(stages), 1)
        layers = layer_time.get(m, {})
        actions, compute, waited = 0, 0, 0
        spent: dict[tuple[int, int, int, str, int | None], float] = {}
        for sl in rec.slices:
            ns = sl.end_ns - sl.start_ns
            if sl.kind in COMPUTE_KINDS:
                compute += ns
                actions += sl.kind != "L"
                # the loss counts as part of its forward (the last layer is profiled with its loss)
                key = (m, rec.rank, -1 if sl.stage is None else sl.stage, "F" if sl.kind == "L" else sl.kind, sl.mb)
                spent[key] = spent.get(key, -layers.get(key[3], 0.0)) + ns / 1e9
            elif sl.kind == "wait":
                waited += ns
        for key, seconds in spent.items():
            inside[key] = min(inside.get(key, seconds), seconds)
        if actions:
            around = (rec.wall_ns - compute - waited) / 1e9
            old = host.get((m, rec.rank))
            host[(m, rec.rank)] = (actions, around if old is None else min(old[1], around))
    if not inside:
        raise ValueError("action_cost_from_records needs records with compute slices")
    points = list(host.values())
    xs = [float(n) for n, _ in points]
    mx = statistics.fmean(xs)
    var = sum((x - mx) ** 2 for x in xs)
    if var > 0:  # the slope of host time over actions: a per-step constant is not a cost per action
        my = statistics.fmean(y for _, y in points)
        per_action = sum((x - mx) * (y - my) for x, (_, y) in zip(xs, points)) / var
    else:
        per_action = statistics.fmean(y / n for n, y in points)
    return max(statistics.median(inside.values()), 0.0), max(per_action, 0.0)


def split_step(rec: StepRecord) -> tuple[dict[tuple[int, str, int | None], float], float | None, int]:
    """One rank's recorded step, as [Note: the strategy's cost per action, from its own timeline] reads it: seconds
    per (stage, kind, micro-batch) of its compute slices (a loss slice counts in its forward: the last layer is
    profiled with its loss), the host time around an action — the wall time minus the compute slices and the
    blocking P2P waits, per action (``None`` without actions) — and the number of actions."""
    spent: dict[tuple[int, str, int | None], float] = {}
    compute = waited = actions = 0
    for sl in rec.slices:
        ns = sl.end_ns - sl.start_ns
        if sl.kind in COMPUTE_KINDS and sl.stage is not None:
            compute += ns
            actions += sl.kind != "L"
            key = (sl.stage, "F" if sl.kind == "L" else sl.kind, sl.mb)
            spent[key] = spent.get(key, 0.0) + ns / 1e9
        elif sl.kind == "wait":
            waited += ns
    return spent, (rec.wall_ns - compute - waited) / 1e9 / actions if actions else None, actions


# [Note: host cost per transfer]
# Most of the host time around an action is its P2P traffic: every send or receive it posts costs the rank host work
# (posting it, the transport's copy on CPU, the runtime's tags and bookkeeping), a fused send + receive about two.
# So that time follows the transfers, not the actions, and layouts differ in transfers per action: 1F1B posts one,
# ZB-V fewer (its middle boundary stays on one rank), interleaved 1F1B 1.5 on 2 ranks (every boundary crosses).
# A model charging a cost per action fitted on 1F1B / ZB-V probes under-predicts interleaved layouts
# by 9-24 % (docs/measurements.md). :func:`fit_action_costs` regresses each rank's host time on its actions and its
# transfers (both coefficients >= 0), and the cost model charges ``transfer_overhead`` per transfer an action posts.
def transfers_posted(rec: StepRecord) -> int:
    """The P2P operations (sends and receives) one rank's recorded step posted: the ops of its "post" slices, whose
    label joins one tag per op with " + "."""
    return sum(len(sl.label.split(" + ")) for sl in rec.slices if sl.kind == "post")


def fit_action_costs(runs: Sequence[tuple[Sequence[StepRecord], Mapping[tuple[int, str], float]]],
                     ) -> tuple[dict[str, float], float, float, float]:
    """From recorded runs of the real model ([Note: the strategy's cost per action, from its own timeline]):
    (per kind F / B / I / W, the in-run scale of the profiled layer time; seconds per action inside its compute
    slice; then :func:`fit_host_costs`' seconds per action around it and per transfer posted). ``runs``: each
    run's records (every rank) with, per (stage, kind), the profiled layer time of one action of that stage. Each
    action is read at its least-disturbed step and fitted as ``slice = scale[kind] x layer + inside`` (least squares
    over every action of every run: one run's actions alone cannot tell a scale from a constant, stages of
    different sizes can); ``inside`` is floored at 0 (then the scales alone are fitted)."""
    xs: list[tuple[str, float]] = []
    ys: list[float] = []
    for records, layer in runs:
        least: dict[tuple[int, int, str, int | None], float] = {}
        for rec in records:
            for (stage, kind, mb), seconds in split_step(rec)[0].items():
                key = (rec.rank, stage, kind, mb)
                least[key] = min(least.get(key, seconds), seconds)
        for (_, stage, kind, _), seconds in least.items():
            if (stage, kind) in layer:
                xs.append((kind, layer[(stage, kind)]))
                ys.append(seconds)
    if not ys:
        raise ValueError("fit_action_costs needs records with compute slices of profiled stages")
    kinds = sorted({k for k, _ in xs})
    rows = [[x if k == kind else 0.0 for kind in kinds] for k, x in xs]
    coef = _least_squares([r + [1.0] for r in rows], ys)
    if coef[-1] < 0:
        coef = _least_squares(rows, ys) + [0.0]
    scales = {kind: max(c, 0.0) for kind, c in zip(kinds, coef)}
    return scales, coef[-1], *fit_host_costs([records for records, _ in runs])


def fit_host_costs(runs: Sequence[Sequence[StepRecord]]) -> tuple[float, float]:
    """(seconds of host work per action, per transfer posted) around the compute slices, from recorded runs (each
    run: every rank's records). Per rank and run, the schedule's wall time minus its compute slices and blocking
    P2P waits at its least-disturbed step, fitted as ``per_action x actions + per_transfer x transfers`` over every
    rank and run ([Note: host cost per transfer]): both >= 0 (where one comes out negative, the other alone; where
    the runs cannot tell them apart, least squares' smallest solution). A per-step constant inside the schedule is
    charged per action here (small beside 16 or more actions)."""
    points: list[tuple[float, float, float]] = []  # (actions, transfers, host seconds) per rank and run
    for records in runs:
        host: dict[int, tuple[float, float, float]] = {}
        for rec in records:
            _, per, actions = split_step(rec)
            if per is None:
                continue
            point = (float(actions), float(transfers_posted(rec)), per * actions)
            if rec.rank not in host or point[2] < host[rec.rank][2]:
                host[rec.rank] = point
        points += host.values()
    if not points:
        return 0.0, 0.0
    ys = [y for _, _, y in points]
    if any(t for _, t, _ in points):
        per_action, per_transfer = _least_squares([[a, t] for a, t, _ in points], ys)
        if per_action >= 0 and per_transfer >= 0:
            return per_action, per_transfer
        if per_action < 0:  # the transfers alone
            return 0.0, max(_least_squares([[t] for _, t, _ in points], ys)[0], 0.0)
    return max(_least_squares([[a] for a, _, _ in points], ys)[0], 0.0), 0.0


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    a = torch.tensor(rows, dtype=torch.float64)
    solution = torch.linalg.lstsq(a, torch.tensor(ys, dtype=torch.float64).unsqueeze(1), driver="gelsd").solution
    return [float(c) for c in solution.flatten()]
