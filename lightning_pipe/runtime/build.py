"""Cut the user's module for a plan and assemble this rank's engine: the one entry point of the plain-torch core.

The Lightning strategy calls :func:`build_engine` at setup (collectively, on every rank) and keeps the returned
:class:`PipelineLayout` on the module, so a later Trainer in the same process reuses the cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.layers.partition import layer_param_counts, partition_layers
from lightning_pipe.layers.stages import (
    TiedParameter,
    check_no_stray_parameters,
    find_layers,
    find_tied_parameters,
    localize_layers,
    materialize,
    warn_batch_norm,
)
from lightning_pipe.parallel.experts import (
    ExpertGroups,
    RoutedExperts,
    check_expert_parallel,
    mark_experts,
    shard_experts,
)
from lightning_pipe.parallel.fsdp import ShardingOptions, check_schedule, check_ties, shard_stages
from lightning_pipe.parallel.tensor_parallel import (
    agree_after_split,
    parallelize_stages,
    split_layer,
    sync_random_state,
    tie_copies,
)
from lightning_pipe.parallel.tensor_parallel import check_module as check_tensor_parallel
from lightning_pipe.parallel.topology import TENSOR, ProcessGroups, Topology, build_mesh, data_parallel_mesh
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
    already cut in this process) the same cut is reused and nothing is broadcast again. With
    ``topology.fsdp_size > 1`` the stages are then sharded with ``sharding`` (lightning_pipe/parallel/fsdp.py); with
    ``topology.tensor_parallel_size > 1`` each layer is split by the module's ``parallelize_layer`` hook
    (lightning_pipe/parallel/tensor_parallel.py).
    """
    layers = find_layers(module, config.layers_attr)
    fresh = layout is None
    if layout is None:
        check_no_stray_parameters(module, config.layers_attr)
        ranges = partition_layers(len(layers), plan.num_stages, config.partition, layer_param_counts(layers))
        layout = PipelineLayout(tuple(ranges), tuple(find_tied_parameters(module, config.layers_attr)), plan)
        if topology.global_rank == 0:
            warn_batch_norm(layers, config.layers_attr, plan.microbatches)
    elif placement(layout.plan) != placement(plan):
        raise config_error(
            f"{type(module).__name__} was already split across the ranks by an earlier run in this process and its "
            "other layers are gone from this rank, so a later Trainer can reuse that split (any micro-batch count, "
            "or a schedule that places the stages alike) but not place the stages differently.",
            f"a split for {describe_placement(layout.plan)}, now {describe_placement(plan)}", "schedule",
            "back to the first run's, or build a new module (or load it from a checkpoint) for the new layout",
            also=("stages_per_rank",))
    local_ids = plan.stages_of_rank(topology.pp_rank)
    if topology.fsdp_size > 1:
        check_schedule(plan.spec.name, plan.spec.stage_class)
        check_ties(layout.tied, {i: plan.stage_to_rank(s) for s, r in enumerate(layout.ranges) for i in r})
    if topology.tensor_parallel_size > 1:
        check_tensor_parallel(module, topology.tensor_parallel_size)
    experts = config.expert_parallel_size
    check_expert_settings(plan, topology, experts)
    if fresh and experts > 1 and not any(isinstance(m, RoutedExperts) for layer in layers for m in layer.modules()):
        # every rank still holds every layer here (on meta when built in configure_model): one verdict everywhere
        raise config_error(
            "expert_parallel_size shards the experts of the model's RoutedExperts layers (lightning_pipe's MoE "
            "layer, docs/moe.md) over the replicas; this model has none, so every rank would keep every expert "
            "(transformers' own MoE layers are not sharded).",
            f"expert_parallel_size={experts} and no RoutedExperts in {type(module).__name__}.{config.layers_attr}",
            "expert_parallel_size", "to 1")
    # One mesh for every dimension: FSDP combines the tensor and data-parallel dimensions of a split parameter
    # into one DTensor, which needs both to be slices of the same root mesh.
    mesh = (build_mesh(topology, device.type)
            if topology.fsdp_size > 1 or topology.tensor_parallel_size > 1 else None)
    groups = ProcessGroups(topology, layout.tied, layout.ranges, plan.ranks_of_stage, mesh=mesh)
    stage_modules = localize_layers(module, config.layers_attr, layout.ranges, local_ids, plan.stage_to_rank,
                                    config.recompute_every, config.offload_layers, config.compile_options)
    if experts > 1:  # before allocation: a rank allocates only its own experts ([Note: expert parallelism])
        groups.experts = ExpertGroups(topology, experts, groups.dp)
        shard_experts(stage_modules, groups.experts)
    split: Callable[[int, torch.nn.Module], None] | None = None
    tensor_parallel = topology.tensor_parallel_size > 1
    if tensor_parallel:
        # split each local layer in place (identical over the tensor group first): [Note: tensor parallel stages];
        # with FSDP, shard_stages splits then shards, layer by layer
        assert mesh is not None
        split = partial(split_layer, module, tp_mesh=mesh[TENSOR], tensor_group=groups.tensor if fresh else None,
                        for_fsdp=topology.fsdp_size > 1)
    ties_before = tie_copies(module, layout.tied) if tensor_parallel and fresh else []
    failure: Exception | None = None
    try:
        if topology.fsdp_size > 1:
            assert mesh is not None
            # FSDP: allocated or moved, made identical over the data-parallel ranks, split over the tensor dimension
            # and sharded, layer by layer
            dp = groups.dp

            def broadcast(tensors: list[torch.Tensor]) -> None:
                for t in tensors if dp is not None else ():
                    dist.broadcast(t.data, group=dp, group_src=0)

            stage_modules = shard_stages(module, stage_modules, data_parallel_mesh(mesh, topology),
                                         sharding or ShardingOptions(), device, broadcast if fresh else None, split)
        else:
            # Layers built on the meta device (configure_model) are allocated now, on this rank only.
            materialize(module, config.layers_attr, stage_modules, layout.tied, device)
            if split is not None:
                module.to(device)
                parallelize_stages(stage_modules, split)
    except Exception as err:
        if not (tensor_parallel and fresh):
            raise
        failure = err  # the hooks are the module's code: every rank must learn that one failed (below)
        # ... and now: a peer whose hook failed later, or not at all, is still in the next layers' broadcasts and
        # its hook's own collectives, which this rank will not join; only the store reaches it there
        # ([Note: failure propagation]).
        report_now(err)
    if tensor_parallel:
        assert groups.tensor is not None
        if fresh:
            agree_after_split(module, layout.tied, ties_before, topology.tp_rank, failure)
        sync_random_state(groups.tensor, device)  # dropout draws alike on the tensor ranks (every fit: cheap)
    module.to(device)
    if experts > 1:
        mark_experts(stage_modules)  # allocation made new Parameter objects
    engine = engine_class(plan)(module, stage_modules, local_ids, plan, groups, device)
    if fresh:
        # Replicas start identical (FSDP: done per layer above), tied copies from their owner; the engine's own
        # sync knows every copy (Chimera: a stage's two pipelines, lightning_pipe/schedules/chimera/engine.py).
        engine.grads.broadcast_initial_state(
            [] if topology.fsdp_size > 1 else [t for sm in stage_modules for t in list(sm.parameters()) + list(sm.buffers())])
    return engine, layout
