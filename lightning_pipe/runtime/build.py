"""Cut the user's module for a plan and assemble this rank's engine: the one entry point of the plain-torch core.

The Lightning strategy calls :func:`build_engine` at setup (collectively, on every rank) and keeps the returned
:class:`PipelineLayout` on the module, so a later Trainer in the same process reuses the cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.layers.partition import layer_param_counts, partition_layers
from lightning_pipe.layers.stages import (
    LayerList,
    StageModule,
    TiedParameter,
    check_no_stray_parameters,
    find_layers,
    find_tied_parameters,
    localize_layers,
    materialize,
    warn_batch_norm,
)
from lightning_pipe.parallel.experts import apply_experts, check_expert_parallel, check_has_experts, mark_experts
from lightning_pipe.parallel.fsdp import ShardingOptions, apply_fsdp, check_fsdp
from lightning_pipe.parallel.tensor_parallel import apply_tensor_parallel, parallelize_stages
from lightning_pipe.parallel.tensor_parallel import check_module as check_tensor_parallel
from lightning_pipe.parallel.topology import TENSOR, ProcessGroups, Topology, build_mesh
from lightning_pipe.runtime.engine import PipelineEngine, PipelineModel
from lightning_pipe.runtime.spec import SchedulePlan
from lightning_pipe.runtime.watchdog import report_now


@dataclass(frozen=True)
class PipelineLayout:
    """How a module was cut: layer ranges per stage, the tied parameters, and the plan. Kept on the module so a
    later Trainer in the same process (validate after fit) reuses it: the other ranks' layers are gone."""

    ranges: tuple[range, ...]
    tied: tuple[TiedParameter, ...]
    plan: SchedulePlan


def engine_class(plan: SchedulePlan) -> type[PipelineEngine]:
    """``PipelineEngine``, or the subclass the schedule names (``ScheduleSpec.engine``)."""
    cls = plan.spec.engine or PipelineEngine
    if not issubclass(cls, PipelineEngine):
        raise TypeError(f"schedule {plan.spec.name!r}: engine {plan.spec.engine!r} is not a PipelineEngine subclass")
    return cls


def placement(plan: SchedulePlan) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """What a split depends on besides the partition: the stages and the pipeline ranks holding each. The
    micro-batch count and the order of the actions do not move a layer."""
    return plan.num_stages, tuple(tuple(plan.ranks_of_stage(s)) for s in range(plan.num_stages))


def describe_placement(plan: SchedulePlan) -> str:
    ranks = ", ".join(f"{s}: {'/'.join(map(str, plan.ranks_of_stage(s)))}" for s in range(plan.num_stages))
    return (f"schedule={plan.spec.name!r} with stages_per_rank={plan.stages_per_rank} on {plan.pipeline_size} "
            f"pipeline ranks (stage: rank {ranks})")


def check_expert_settings(plan: SchedulePlan, topology: Topology, size: int) -> None:
    """``expert_parallel_size`` against the world and the schedule, before any rank waits on another. Expert
    parallelism needs the engine's own gradient sync: schedules that update per micro-batch (PipeDream, PipeMare)
    or run an engine of their own (Chimera) average gradients their own way."""
    if size == 1:
        return
    check_expert_parallel(size, topology)
    if plan.spec.engine is not None or getattr(plan.spec.stage_class, "updates_per_microbatch", False):
        raise config_error(
            "Expert parallelism needs the engine's own gradient sync after the schedule; this schedule averages "
            "gradients its own way (per micro-batch, or per pipeline).",
            f"schedule={plan.spec.name!r}, expert_parallel_size={size}", "expert_parallel_size", also=("schedule",))


def build_engine(module: PipelineModel, config: PipelineConfig, plan: SchedulePlan, topology: Topology,
                 device: torch.device, layout: PipelineLayout | None = None,
                 sharding: ShardingOptions | None = None) -> tuple[PipelineEngine, PipelineLayout]:
    """Cut ``module``'s layer list for ``plan`` and build this rank's engine. Collective: every rank calls it.

    Other ranks' layers are replaced by placeholders (names kept); layers built on the meta device are allocated
    on ``device`` for this rank only; replicas and tied copies start identical. With ``layout`` (the module was
    already cut in this process) the same cut is reused and nothing is broadcast again. Then each parallel
    dimension in turn: expert parallelism (lightning_pipe/parallel/experts.py), FSDP with ``sharding`` when
    ``topology.fsdp_size > 1`` (parallel/fsdp.py), the module's ``parallelize_layer`` hook when
    ``topology.tensor_parallel_size > 1`` (parallel/tensor_parallel.py).
    """
    layers = find_layers(module, config.layers_attr)
    fresh = layout is None
    layout = cut_layout(module, layers, config, plan, topology) if layout is None else reuse_layout(module, layout, plan)
    check_parallel_settings(module, layers, config, plan, layout, topology, fresh)
    # One mesh for every dimension: FSDP combines the tensor and data-parallel dimensions of a split parameter
    # into one DTensor, which needs both to be slices of the same root mesh.
    mesh = (build_mesh(topology, device.type)
            if topology.fsdp_size > 1 or topology.tensor_parallel_size > 1 else None)
    groups = ProcessGroups(topology, layout.tied, layout.ranges, plan.ranks_of_stage, mesh=mesh)
    local_ids = plan.stages_of_rank(topology.pp_rank)
    stage_modules = localize_layers(module, config.layers_attr, layout.ranges, local_ids, plan.stage_to_rank,
                                    config.recompute_every, config.offload_layers, config.compile_options)
    if config.expert_parallel_size > 1:  # before allocation: a rank allocates only its own experts
        groups.experts = apply_experts(stage_modules, topology, config.expert_parallel_size, groups.dp)
    stage_modules = place_stages(module, layout, stage_modules, groups, device, fresh, sharding or ShardingOptions())
    module.to(device)
    if groups.experts is not None:
        mark_experts(stage_modules)  # allocation made new Parameter objects
    engine = engine_class(plan)(module, stage_modules, local_ids, plan, groups, device)
    if fresh:
        # Replicas start identical (FSDP: done per layer above), tied copies from their owner; the engine's own
        # sync knows every copy (Chimera: a stage's two pipelines, lightning_pipe/schedules/chimera/engine.py).
        engine.grads.broadcast_initial_state(
            [] if topology.fsdp_size > 1 else [t for sm in stage_modules for t in list(sm.parameters()) + list(sm.buffers())])
    return engine, layout


def cut_layout(module: PipelineModel, layers: LayerList, config: PipelineConfig, plan: SchedulePlan,
               topology: Topology) -> PipelineLayout:
    """A new cut of the module's layer list: its stage ranges and tied parameters (every rank computes the same)."""
    check_no_stray_parameters(module, config.layers_attr)
    ranges = partition_layers(len(layers), plan.num_stages, config.partition, layer_param_counts(layers))
    layout = PipelineLayout(tuple(ranges), tuple(find_tied_parameters(module, config.layers_attr)), plan)
    if topology.global_rank == 0:
        warn_batch_norm(layers, config.layers_attr, plan.microbatches)
    return layout


def reuse_layout(module: PipelineModel, layout: PipelineLayout, plan: SchedulePlan) -> PipelineLayout:
    """The cut an earlier run in this process made, refused where ``plan`` places the stages differently."""
    if placement(layout.plan) != placement(plan):
        raise config_error(
            f"{type(module).__name__} was already split across the ranks by an earlier run in this process and its "
            "other layers are gone from this rank, so a later Trainer can reuse that split (any micro-batch count, "
            "or a schedule that places the stages alike) but not place the stages differently.",
            f"a split for {describe_placement(layout.plan)}, now {describe_placement(plan)}", "schedule",
            "back to the first run's, or build a new module (or load it from a checkpoint) for the new layout",
            also=("stages_per_rank",))
    return layout


def check_parallel_settings(module: PipelineModel, layers: LayerList, config: PipelineConfig, plan: SchedulePlan,
                            layout: PipelineLayout, topology: Topology, fresh: bool) -> None:
    """Each parallel dimension's rules on ``plan`` and this cut: plain data, the same on every rank, before any rank
    waits on another."""
    if topology.fsdp_size > 1:
        check_fsdp(plan.spec.name, plan.spec.stage_class, layout.tied,
                   {i: plan.stage_to_rank(s) for s, r in enumerate(layout.ranges) for i in r})
    if topology.tensor_parallel_size > 1:
        check_tensor_parallel(module, topology.tensor_parallel_size)
    check_expert_settings(plan, topology, config.expert_parallel_size)
    if fresh:  # (a reused cut's other layers are gone)
        check_has_experts(layers, config.expert_parallel_size, f"{type(module).__name__}.{config.layers_attr}")


def place_stages(module: PipelineModel, layout: PipelineLayout, stage_modules: list[StageModule],
                 groups: ProcessGroups, device: torch.device, fresh: bool, sharding: ShardingOptions
                 ) -> list[StageModule]:
    """This rank's layers on ``device`` (allocated there if built on meta), sharded with FSDP and split with the
    tensor-parallel hook, one layer at a time where both apply; returns the stage modules to run. Collective."""
    topology, mesh = groups.topology, groups.mesh

    def place(split: Callable[[int, torch.nn.Module], None] | None) -> list[StageModule]:
        if topology.fsdp_size > 1:
            return apply_fsdp(module, stage_modules, mesh, topology, groups.dp, sharding, device, fresh, split)
        materialize(module, stage_modules, device)
        if split is not None:
            module.to(device)
            parallelize_stages(stage_modules, split)
        return stage_modules

    if topology.tensor_parallel_size == 1:
        return place(None)
    assert groups.tensor is not None and mesh is not None
    return apply_tensor_parallel(module, layout.tied, mesh[TENSOR], groups.tensor, topology.tp_rank, device, fresh,
                                 topology.fsdp_size > 1, place, report_now)
