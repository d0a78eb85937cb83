"""``schedule="auto"`` and ``partition="time"/"memory"``: profile on every rank of the running job, decide on rank
0, adopt one plan everywhere.

Collective: every rank calls :func:`plan_on_ranks` with the same batch shape. Every rank profiles the whole model
(one layer at a time, so a model built on meta never needs to fit) at the micro-batch sizes the search considers;
the profiles are gathered, so a slower rank shows up as a speed factor and gets less work; the link between ranks
0 and 1 is measured on the real process group. Rank 0 searches and broadcasts the plan, or the error, so every rank
returns the same plan or raises the same error: nothing is left waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.config import PipelineConfigError
from lightning_pipe.planner.balance import balance_split
from lightning_pipe.planner.calibrate import measure_action_overhead
from lightning_pipe.planner.model import ActivationPolicy
from lightning_pipe.planner.plan import to_plan
from lightning_pipe.planner.profile import ModelProfile, measure_link, profile_model, rank_speeds
from lightning_pipe.planner.search import divisors, search
from lightning_pipe.schedules import SchedulePlan


def batch_rows(module: nn.Module, batch: Any) -> int:
    """Samples in a batch, read from the first tensor of the module's inputs (``split_batch``)."""
    inputs, _ = module.split_batch(batch)  # type: ignore[operator]
    stack = [inputs]
    while stack:
        value = stack.pop(0)
        if isinstance(value, torch.Tensor):
            return int(value.size(0))
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    raise ValueError("schedule='auto' needs a batch whose inputs hold a tensor (its first dimension is the batch)")


def _decide_on_ranks(module: nn.Module, batch: Any, sizes: Sequence[int], layers_attr: str,
                     device: torch.device | str, repeats: int,
                     decide: Callable[[ModelProfile, list[float]], dict[str, Any]]) -> dict[str, Any]:
    """Every rank profiles the model at ``sizes`` (and the link and the runtime's per-action cost are measured on
    the real process group); rank 0 calls ``decide(profile, per-rank slowness)`` and broadcasts its plan or its
    error, so every rank returns the same plan or raises the same error. Collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine: tuple[dict[str, Any] | None, str | None]
    try:
        mine = (profile_model(module, batch, sizes, layers_attr, device, repeats).to_json(), None)
    except Exception as err:
        mine = (None, f"rank {rank}: {type(err).__name__}: {err}")
    latency, bandwidth = measure_link(0, 1, device=device) if world > 1 else (0.0, float("inf"))
    overhead = measure_action_overhead(latency=latency, device=device) if world > 1 else 0.0
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    payload: list[Any] = [None]
    if rank == 0:
        errors = [e for _, e in gathered if e]
        if errors:
            payload[0] = ("error", "the planner could not profile the model: " + "; ".join(errors))
        else:
            profiles = [ModelProfile.from_json(p) for p, _ in gathered]
            base = profiles[0]
            base.link_latency, base.link_bandwidth, base.action_overhead = latency, bandwidth, overhead
            speeds = rank_speeds(profiles, sizes[-1])
            try:
                payload[0] = ("plan", decide(base, speeds))
            except PipelineConfigError as err:
                payload[0] = ("error", str(err))
            except Exception as err:  # any failure here must reach the waiting ranks, not leave them hanging
                payload[0] = ("error", f"the planner failed on rank 0: {type(err).__name__}: {err}")
    dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "error":
        raise PipelineConfigError(value)
    return value


def plan_on_ranks(module: nn.Module, batch: Any, data_parallel_size: int = 1,
                  memory_budget: int | str | None = None, layers_attr: str = "layers",
                  device: torch.device | str = "cpu", schedules: Sequence[str] | None = None,
                  max_microbatches: int = 32, repeats: int = 2, top_k: int = 3,
                  activations: ActivationPolicy | None = None) -> dict[str, Any]:
    """The plan (as :func:`~lightning_pipe.planner.plan.to_plan` writes it) for this world, the same on every rank.

    ``batch`` is one training batch of one replica (its size stays what the data loader gives); replicas stay
    ``data_parallel_size``; the search picks schedule, stages per rank, micro-batches and the partition."""
    world = dist.get_world_size()
    pipeline_size = world // data_parallel_size
    rows = batch_rows(module, batch)
    sizes = sorted({rows // m for m in divisors(rows) if m <= max_microbatches})

    def decide(base: ModelProfile, speeds: list[float]) -> dict[str, Any]:
        result = search(base, world, rows * data_parallel_size, memory_budget, schedules=schedules,
                        pipeline_sizes=[pipeline_size], speeds=speeds, activations=activations)
        return to_plan(result, rows * data_parallel_size, top_k, rank_speeds=speeds)

    return _decide_on_ranks(module, batch, sizes, layers_attr, device, repeats, decide)


def balance_on_ranks(module: nn.Module, batch: Any, plan: SchedulePlan, by: str, data_parallel_size: int = 1,
                     memory_budget: int | str | None = None, layers_attr: str = "layers",
                     device: torch.device | str = "cpu", repeats: int = 2,
                     activations: ActivationPolicy | None = None) -> dict[str, Any]:
    """``partition="time"`` / ``"memory"``: the plan of the best split of ``plan`` (schedule, v, m and replicas
    fixed) by measured time or memory, the same on every rank; the uniform split rides along as the runner-up.
    Collective."""
    rows = batch_rows(module, batch)
    size = max(1, rows // plan.microbatches)

    def decide(base: ModelProfile, speeds: list[float]) -> dict[str, Any]:
        result = balance_split(base, plan, rows, by, data_parallel_size, speeds, memory_budget,
                               activations=activations)
        return to_plan(result, rows * data_parallel_size, 2, rank_speeds=speeds, partition_by=by)

    return _decide_on_ranks(module, batch, [size], layers_attr, device, repeats, decide)
