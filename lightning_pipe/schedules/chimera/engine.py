"""Chimera's engine: two pipelines per rank, their process groups, and the gradient rules that make a step exact.

See [Note: Chimera placement and semantics] in ``schedules/chimera/spec.py`` for what is computed, and
[Note: driving two pipelines from one thread] in ``schedules/chimera/runtime.py`` for how it runs.

[Note: Chimera's process groups]
P2P messages carry no tag, so the up pipeline cannot share the down pipeline's group (two pipelines sharing one group
swap messages): it gets a group of its own over the same ranks. ``dist.new_group`` numbers a group's members in sorted
order, so in both groups pipeline rank q is group rank q; the down stage s is at group rank s (torch's default), the
up stage s at group rank p-1-s, which we tell the stage explicitly (``stage_index_to_group_rank``). Each stage pair
{i, p-1-i} gets its own group too, for the gradient sum and the initial broadcast (a pair group shared with other
traffic corrupted training in a prototype). All groups are created by every rank in the same order, per replica.

[Note: Chimera's gradient sync]
Before the optimizer step, in this order: (1) every parameter that is not tied sums its gradient over its stage
pair (the two copies hold the gradients of the two halves of the batch: the sum is the batch-mean gradient);
(2) data-parallel replicas average, as always; (3) tied parameters sum over every rank holding a copy in either
pipeline (the tie group already spans both copies of both stages, so they skip (1): summing twice would double them).
The global norm counts the down pipeline's stages (each stage once); a tied parameter is counted by its tie group's
first rank only, whichever pipeline's stage holds it there.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.config import config_error
from lightning_pipe.layers.batches import LossParts
from lightning_pipe.layers.stages import StageModule
from lightning_pipe.parallel.dtensor import local as local_part
from lightning_pipe.parallel.grads import GradientSync, all_reduce_coalesced
from lightning_pipe.parallel.group_cache import shared_group
from lightning_pipe.parallel.topology import ProcessGroups
from lightning_pipe.runtime.engine import PipelineEngine, PipelineModel
from lightning_pipe.runtime.spec import SchedulePlan
from lightning_pipe.runtime.stage import PipelineStage
from lightning_pipe.runtime.train_step import StepLoss, schedule_loss
from lightning_pipe.schedules.chimera.runtime import ChimeraRuntime
from lightning_pipe.schedules.registry import compute_order


class ChimeraGradientSync(GradientSync):
    """:class:`GradientSync` plus the stage-pair sum ([Note: Chimera's gradient sync])."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], groups: ProcessGroups, device: torch.device,
                 pair: dist.ProcessGroup | None, pair_stages: list[tuple[list[Tensor], int]],
                 up_only: set[int]) -> None:
        super().__init__(module, params, groups, device)
        self.pair = pair
        self.pair_stages = pair_stages
        """Per local stage, in stage order: its parameters and buffers, and the pair-group rank of its down copy."""
        self.up_only = up_only
        """Parameters only the up pipeline's stage holds on this rank (the down stage of another rank counts them)."""
        self.early_ties = False  # its ties sum after the pair sum, in sync (untested with the early sum of grads.py)

    def sync(self, replicas: bool = True) -> None:
        if self.pair is not None:
            tied = {id(param) for param, _ in self.ties}
            # (tensor parallel: each rank's part, summed with the same part of the other copy)
            grads = [local_part(p.grad) for p in self.params if p.grad is not None and id(p) not in tied]
            if grads:
                all_reduce_coalesced(grads, self.pair, average=False)
        super().sync(replicas)

    def norm_excluded(self) -> set[int]:
        tied = {id(param) for param, _ in self.ties}
        return super().norm_excluded() | (self.up_only - tied)

    def broadcast_initial_state(self, tensors: Any) -> None:
        """Replicas from data-parallel rank 0, then each stage's up copy from its down copy, then tied copies
        (tensor parallel: each rank's part, from the same tensor rank)."""
        if self.groups.dp is not None:
            for t in tensors:
                dist.broadcast(local_part(t.data), group=self.groups.dp, group_src=0)
        if self.pair is not None:
            for stage_tensors, src in self.pair_stages:
                for t in stage_tensors:
                    dist.broadcast(local_part(t.data), group=self.pair, group_src=src)
        for param, tie_group in self.ties:
            dist.broadcast(local_part(param.data), group=tie_group.group, group_src=0)


class ChimeraEngine(PipelineEngine):
    """A rank's engine under ``schedule=chimera``: a down and an up stage, one :class:`ChimeraRuntime`.

    Evaluation and prediction run the down pipeline only, so ``has_first`` / ``has_last`` (what the inherited
    forward-only path and the loss broadcast read) are the down stage's.
    """

    schedule: ChimeraRuntime

    def __init__(self, module: PipelineModel, stage_modules: list[StageModule], local_stage_ids: list[int],
                 plan: SchedulePlan, groups: ProcessGroups, device: torch.device) -> None:
        if device.type != "cpu":  # every rank has the same device type: all refuse together, before any group
            raise config_error(
                "Schedule 'chimera' runs on CPU (gloo) only for now: its runtime posts each send right after its "
                "compute and waits on it at the end of the step, which cannot block on gloo but can on NCCL, whose "
                "sends and receives between two ranks share one stream "
                "([Note: driving two pipelines from one thread] in lightning_pipe/schedules/chimera/runtime.py); "
                "that path is not built and tested yet.",
                f"device {device}", "schedule", "e.g. 1f1b, zbv or dualpipev on GPUs")
        if groups.topology.fsdp_size > 1:
            raise config_error(
                "Schedule 'chimera' keeps two replicas of each stage on two ranks and sums their gradients itself; "
                "FSDP-sharded stages are not built for it yet.", f"fsdp_size={groups.topology.fsdp_size}",
                "fsdp_size", "set it to 1 (or use data_parallel_size for replicas)", also=("schedule",))
        self.up_group: dist.ProcessGroup | None = None
        self.pair_group: dist.ProcessGroup | None = None
        super().__init__(module, stage_modules, local_stage_ids, plan, groups, device)
        down, up = self.stages
        self.has_first, self.has_last = down.is_first, down.is_last
        by_id = dict(zip(local_stage_ids, stage_modules))
        down_params = {id(p) for p in by_id[down.stage_index].parameters()}
        up_only = {id(p) for p in by_id[up.stage_index].parameters() if id(p) not in down_params}
        p = plan.pipeline_size
        low = min(groups.topology.pp_rank, p - 1 - groups.topology.pp_rank)
        pair_stages = [(list(sm.parameters()) + list(sm.buffers()), 0 if s == low else 1)
                       for s, sm in sorted(by_id.items())]
        self.grads = ChimeraGradientSync(module, self.parameters, groups, device, self.pair_group, pair_stages,
                                         up_only)
        # each pipeline runs half the batch (data-parallel overlap)
        self.dp_handoff.microbatches_per_stage = plan.microbatches // 2

    def _build_runtime(self, stage_modules: list[StageModule],
                       local_stage_ids: list[int]) -> tuple[list[PipelineStage], Any]:
        """[Note: Chimera's process groups]; collective (every rank creates every group, in the same order)."""
        topo, p = self.groups.topology, self.plan.pipeline_size
        # one up pipeline and one group per stage pair for each (replica, tensor rank), as the down pipelines
        # ([Note: rank order]): a tensor rank talks to the same tensor rank of the other stages and copies
        for dp_rank in range(topo.data_parallel_size):
            for t in range(topo.tensor_parallel_size):
                ranks = topo.pp_group_ranks(dp_rank, t)
                up_group = shared_group(ranks, "chimera_up")
                if dp_rank == topo.dp_rank and t == topo.tp_rank:
                    self.up_group = up_group
                for i in range(p // 2):
                    pair = shared_group([ranks[i], ranks[p - 1 - i]], "chimera_pair")
                    if topo.global_rank in (ranks[i], ranks[p - 1 - i]):
                        self.pair_group = pair
        r = topo.pp_rank
        by_id = dict(zip(local_stage_ids, stage_modules))
        down = PipelineStage(by_id[r], r, p, self.device, group=self.groups.pp, inference_guard=self._inference_guard)
        up = PipelineStage(by_id[p - 1 - r], p - 1 - r, p, self.device, group=self.up_group,
                           inference_guard=self._inference_guard)
        up.stage_index_to_group_rank = {s: p - 1 - s for s in range(p)}
        runtime = ChimeraRuntime(down, up, compute_order(self.plan)[r], self.plan.microbatches,
                                 partial(schedule_loss, self))
        return [down, up], runtime

    def _reset_shapes(self) -> None:
        self.schedule.reset_shapes()

    def run_schedule(self, args: tuple[Tensor, ...], target: Any) -> None:
        self.schedule.step(*args, target=target)

    def reduce_loss(self, tie_payload: Tensor | None) -> StepLoss:
        """This replica's batch loss from both last stages (rank p-1: down, rank 0: up), on every rank (its ties
        sum in the sync: ``tie_payload`` is always ``None``)."""
        # (sum of means, number of means, sum of (sum, count) sums, their counts, number of pairs)
        packed = torch.zeros(5, dtype=torch.float64, device=self.device)
        self.loss_kind.check(self.losses.records, self.owner)  # [Note: the loss kind is read once]
        for r in self.losses.records:
            if r.count is None:
                packed[0] += r.value.double()
                packed[1] += 1
            else:
                packed[2] += r.value.double()
                packed[3] += r.count.double()
                packed[4] += 1
        dist.all_reduce(packed, group=self.groups.pp)
        m = self.plan.microbatches
        if self.loss_kind.pair is None:  # the first step: the counts over both last stages, read once
            means, pairs = (int(v) for v in packed[[1, 4]].tolist())
            if means + pairs != m or (means > 0 and pairs > 0):
                raise TypeError(
                    f"{self.owner}.loss_fn must return the same kind of loss for every micro-batch (a mean, or a "
                    f"(sum, count) pair); got {means} means and {pairs} pairs for {m} micro-batches.")
        if not self.loss_kind.learn(packed[4] > 0, len(self.losses.records)):
            return StepLoss((packed[0] / m).float(), None)
        loss = LossParts(packed[2], packed[3]).reduced().float()
        count = packed[3].clone()
        if self.groups.dp is not None:
            dist.all_reduce(count, group=self.groups.dp)
        return StepLoss(loss, count)
