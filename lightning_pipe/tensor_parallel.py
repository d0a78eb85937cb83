"""Tensor parallelism per pipeline stage: the module's ``parallelize_layer`` hook over the mesh's ``tensor`` dimension.

[Note: tensor parallel stages]
With ``tensor_parallel_size = t > 1`` every stage runs on ``t`` ranks (innermost in [Note: rank order]). At setup each
rank calls the module's ``parallelize_layer(index, layer, tp_mesh)`` for each of its layers (after the layers are
allocated and made identical over the tensor group), which splits the layer in place with DTensor's
``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` plans). The contract: a
layer's inputs and outputs stay plain, whole tensors (``use_local_output=True``, the default of the styles; an output
``Shard`` of the sequence dimension must be gathered back before the layer returns), so the stages' P2P shapes and
the schedules are unchanged: each tensor rank sends and receives the whole activation to / from the same tensor rank
of the neighbouring stage (its pipeline group, grads.py), and every tensor rank of the last stage computes the same
loss.

Parameters a plan splits become DTensors (``Shard`` placements: each rank holds a part); the rest stay plain tensors
or ``Replicate`` DTensors (e.g. a row-wise layer's bias), identical on every tensor rank, with identical gradients
(DTensor all-reduces the partial input gradients of a column-wise layer in its backward). So:

- the global gradient norm counts a sharded gradient's local part on every tensor rank (summed over the tensor
  group) and a replicated one once (on tensor rank 0): [Note: counting sharded gradients] in grads.py;
- replicas average each tensor rank's local parts with the same tensor rank of the other replicas (the
  data-parallel group is per tensor rank); the overlapped data-parallel sync is off (one all-reduce after the
  schedule);
- checkpoints gather whole tensors per stage (``full_values``), written by tensor rank 0 only; a load cuts them again.

With FSDP too (``fsdp_size > 1``: 2-D sharding per stage) each layer is split first, then ``fully_shard`` ed over the
data-parallel dimensions (lightning_pipe/fsdp.py, ``shard_stages``), one layer at a time: allocated, made identical
over the data-parallel group and then the tensor group, split by the hook, sharded. ``tp_mesh`` is the ``tensor``
dimension of the run's one ``DeviceMesh`` (``mesh.build_mesh``) and FSDP's mesh is its ``dp_shard`` (or
``(dp_replicate, dp_shard)``) dimension: FSDP joins the two into one mesh for a split parameter, which only works
for slices of the same root. A split parameter becomes a DTensor over ``(dp_shard, tensor)`` (FSDP's placement is a
strided shard when the tensor split is along the same dimension); one the hook left plain (a LayerNorm's) is sharded
over ``dp_shard`` only: every tensor rank holds the same shards, replicated over ``tensor``. FSDP averages each
tensor rank's gradients over its data-parallel ranks (its reduce-scatter), the norm counts each element once
([Note: counting sharded gradients]), and checkpoints gather over both dimensions (``full_tensor``).

Refused (plain-data errors, before any rank waits on another): tied parameters
(a plan would replace one of the tied copies' ``Parameter``), schedules other than
:data:`~lightning_pipe.config.TENSOR_PARALLEL_SCHEDULES`, the planner (``schedule='auto'``, plan files, measured
partitions, rebalancing), a module without the hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakSet

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_pipe.config import config_error
from lightning_pipe.stages import StageModule, TiedParameter

HOOK = "parallelize_layer"

# Layers already split in this process: a later Trainer on the same module (validate after fit) reuses them.
_PARALLELIZED: WeakSet[nn.Module] = WeakSet()


def check_module(module: nn.Module, tied: Sequence[TiedParameter], tensor_parallel_size: int) -> None:
    """The module says how to split its layers, and has no tied parameters. Plain data, the same on every rank."""
    if tied:
        raise config_error(
            "Tensor parallelism does not support tied parameters yet (a plan replaces one copy's Parameter, which "
            "would silently untie them).", f"tensor_parallel_size={tensor_parallel_size} and tied "
            f"{[list(t.names) for t in tied]}", "tensor_parallel_size", "or set it to 1", fix="Untie the weights")
    if not callable(getattr(module, HOOK, None)):
        raise config_error(
            f"Tensor parallelism needs the module to say how to split a layer: {type(module).__name__} has no "
            f"`{HOOK}(index, layer, tp_mesh)` method.", f"tensor_parallel_size={tensor_parallel_size}",
            "tensor_parallel_size", "or set it to 1",
            fix=f"Implement `{HOOK}` (README: \"Bigger than one device per stage\")")


def parallelize_stages(module: nn.Module, stage_modules: Sequence[StageModule], tp_mesh: DeviceMesh,
                       tensor_group: dist.ProcessGroup | None) -> None:
    """:func:`split_layer` for each of this rank's layers. Collective over the tensor group."""
    for stage in stage_modules:
        for index, layer in zip(stage.layer_indices, stage.layers):
            split_layer(module, index, layer, tp_mesh, tensor_group)


def split_layer(module: nn.Module, index: int, layer: nn.Module, tp_mesh: DeviceMesh,
                tensor_group: dist.ProcessGroup | None) -> None:
    """Make one layer identical over the tensor group (from tensor rank 0), then split it with the module's hook.
    ``tensor_group=None``: the layer was made identical before (a reused layout). A layer split earlier in this
    process is left as it is. Collective over the tensor group.

    With FSDP the caller shards the layer right after (lightning_pipe/fsdp.py): the hook sees whole, plain
    parameters either way, and ``tp_mesh`` is the ``tensor`` dimension of the run's one mesh, so FSDP can combine
    it with the data-parallel dimensions into 2-D (3-D for HSDP) DTensors.
    """
    if layer in _PARALLELIZED:
        return
    if tensor_group is not None:
        for t in list(layer.parameters()) + list(layer.buffers()):
            if not isinstance(t, DTensor):
                dist.broadcast(t.data, group=tensor_group, group_src=0)
    getattr(module, HOOK)(index, layer, tp_mesh)
    _PARALLELIZED.add(layer)
