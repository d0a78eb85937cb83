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
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from lightning_pipe.config import PipelineConfig
from lightning_pipe.schedules import compute_order, plan_schedule
from lightning_pipe.schedules.simulate import compile_order, replay


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
