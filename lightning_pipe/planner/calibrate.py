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

import time

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
