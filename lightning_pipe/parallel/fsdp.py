"""FSDP2 per pipeline stage: ``fully_shard`` each local layer and the stage root over the data-parallel mesh.

[Note: FSDP under the pipeline schedule]
Torch's ``PipelineStage`` drives an ``FSDPModule`` stage itself: every micro-batch's backward runs with
``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)`` and ``set_is_last_backward(False)``, so
gradients accumulate unsharded; after the last micro-batch, ``perform_reduce_grad`` (the single-stage schedules' end,
the ``REDUCE_GRAD`` action of the action-list runtime) turns the flags on and runs FSDP's post-backward once: one
reduce-scatter (and, for HSDP, one all-reduce over replicas) per stage per batch, then a reshard. FSDP averages over
every data-parallel rank, so the engine's data-parallel all-reduce is skipped (``GradientSync``), and our
``scale_grads=False`` loss scaling ([Note: loss scaling] in engine.py) is untouched: FSDP divides by the
data-parallel size only. The fresh gradients are sharded DTensors; the engine's pointer swap around Lightning's
zero_grad moves those objects like any other ``.grad`` (FSDP adds into an existing sharded ``.grad``, and the swap
leaves it ``None`` for the step).

``reshard_after_forward=False`` (default) keeps each stage gathered from its first forward to its reduce: one
all-gather per stage per batch; ``True`` gathers again for every micro-batch's backward. A forward-only pass leaves
the parameters gathered, which would go stale after the next optimizer step: :func:`reshard` runs after each.

Tensor parallelism (``tensor_parallel_size > 1``): ``shard_stages`` calls ``split`` (the module's
``parallelize_layer`` hook over the mesh's ``tensor`` dimension) on each layer before ``fully_shard``, so FSDP sees
the split parameters as DTensors over ``tensor`` and shards their local parts over the data-parallel dimensions:
all-gathers and reduce-scatters run per tensor rank, between the same tensor rank of each shard, and the flags above
are unchanged. [Note: tensor parallel stages] in tensor_parallel.py says why the two meshes must share a root.

Mixed precision: under ``bf16-mixed`` FSDP gathers parameters in bf16 (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: half the all-gather traffic, gradients reduced in fp32) while autocast still keeps the ops it
keeps in fp32; the sharded master weights and the optimizer stay fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_pipe.config import config_error
from lightning_pipe.layers.stages import StageModule, TiedParameter, place_layer
from lightning_pipe.parallel.topology import Topology, data_parallel_mesh


@dataclass(frozen=True)
class ShardingOptions:
    """How the stages are sharded (from ``PipelineConfig`` and the precision)."""

    reshard_after_forward: bool = False
    param_dtype: torch.dtype | None = None
    """Dtype FSDP gathers parameters in and runs the forward with (``None``: theirs)."""
    reduce_dtype: torch.dtype | None = None


def check_fsdp(schedule: str, stage_class: type | None, tied: Sequence[TiedParameter],
               layer_rank: Mapping[int, int]) -> None:
    """FSDP's rules on a plan and a cut (:func:`check_schedule`, :func:`check_ties`): plain data, before any rank
    waits on another."""
    check_schedule(schedule, stage_class)
    check_ties(tied, layer_rank)


def check_schedule(schedule: str, stage_class: type | None) -> None:
    """Refuse schedules whose stages run other weights than the module's (weight versions: PipeDream-2BW), which
    would bypass FSDP's gathered parameters."""
    if stage_class is not None:
        raise config_error(
            f"Schedule {schedule!r} runs its stages on stashed weight versions ({stage_class.__name__}), which "
            "FSDP's sharded parameters do not support.", f"schedule={schedule!r} with fsdp_size > 1", "fsdp_size",
            also=("schedule",))


def check_ties(tied: Sequence[TiedParameter], layer_rank: Mapping[int, int]) -> None:
    """Refuse a tied parameter used by two layers of one pipeline rank: FSDP cannot shard one parameter in two units.

    Ties across ranks are supported (each rank shards its own copy; the copies' local shards are summed like any
    tie's gradients). Plain data, the same on every rank: raised before any rank waits on another.
    """
    for tie in tied:
        ranks = [layer_rank[i] for i in tie.layer_indices]
        shared = sorted({r for r in ranks if ranks.count(r) > 1})
        if shared:
            raise config_error(
                "With FSDP (fsdp_size > 1) a tied parameter must be used by layers on different pipeline ranks: "
                "FSDP cannot shard one parameter in two layers of one rank.",
                f"fsdp_size > 1 and {list(tie.names)} on pipeline rank(s) {shared}", "fsdp_size",
                "or pick a schedule / partition that puts those layers on different ranks (V schedules put the first "
                "and the last stage on rank 0)", fix="Untie the weights")


# Sharded stage roots by their first layer. A later Trainer on the same module (validate after fit) cuts the same
# stages again: FSDP's root is fixed at its first forward, so that Trainer must run the root it already has.
_SHARDED: WeakKeyDictionary[nn.Module, StageModule] = WeakKeyDictionary()


def shard_stages(module: nn.Module, stage_modules: Sequence[StageModule], mesh: DeviceMesh, options: ShardingOptions,
                 device: torch.device, broadcast: Callable[[list[Tensor]], None] | None,
                 split: Callable[[int, nn.Module], None] | None = None) -> list[StageModule]:
    """Place and shard this rank's stages one layer at a time, so no more than one whole layer is resident besides
    the shards: allocate a layer built on the meta device (and initialise it like ``stages.materialize``: the
    module's ``reset_layer``) or move it to ``device`` (``stages.place_layer``); ``broadcast`` its tensors (the data-parallel ranks start
    identical; ``None`` when the module was placed before); ``split(index, layer)`` it over the tensor dimension
    (tensor parallelism: [Note: FSDP under the pipeline schedule]); ``fully_shard`` it. Then each stage root. The
    stage modules become ``FSDPModule`` s, their parameters sharded DTensors under the same names. Collective.

    Returns the stage modules to run: these, or the ones sharded earlier in this process over the same layers.
    """
    mp = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype)
    out = []
    for stage in stage_modules:
        earlier = _SHARDED.get(stage.layers[0])
        if earlier is not None and list(earlier.layers) == list(stage.layers):
            out.append(earlier)
            continue
        for index, layer in zip(stage.layer_indices, stage.layers):
            place_layer(module, index, layer, device)
            if broadcast is not None:
                broadcast(list(layer.parameters()) + list(layer.buffers()))
            if split is not None:
                split(index, layer)
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=mp)
        fully_shard(stage, mesh=mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=mp)
        _SHARDED[stage.layers[0]] = stage
        out.append(stage)
    return out


def apply_fsdp(module: nn.Module, stage_modules: Sequence[StageModule], mesh: DeviceMesh, topology: Topology,
               dp_group: dist.ProcessGroup | None, options: ShardingOptions, device: torch.device, fresh: bool,
               split: Callable[[int, nn.Module], None] | None = None) -> list[StageModule]:
    """FSDP over the data-parallel dimensions of the run's ``mesh``: :func:`shard_stages`, each layer made
    identical over ``dp_group`` first where the module is placed for the first time (``fresh``). Collective."""

    def broadcast(tensors: list[Tensor]) -> None:
        for t in tensors if dp_group is not None else ():
            dist.broadcast(t.data, group=dp_group, group_src=0)

    return shard_stages(module, stage_modules, data_parallel_mesh(mesh, topology), options, device,
                        broadcast if fresh else None, split)


def reshard(stage_modules: Iterable[nn.Module]) -> None:
    """Free gathered parameters (no-op for sharded or non-FSDP stages): see [Note: FSDP under the pipeline schedule]."""
    for stage in stage_modules:
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
