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
  group) and a replicated one once (on tensor rank 0): :meth:`lightning_pipe.grads.GradientSync.clip_grad_norm_`;
  clipping by value clamps each rank's parts (:meth:`~lightning_pipe.grads.GradientSync.clip_grad_value_`): torch's
  own clipping functions refuse a list that mixes DTensor and plain gradients;
- replicas average each tensor rank's local parts with the same tensor rank of the other replicas (the
  data-parallel group is per tensor rank); the overlapped data-parallel sync is off (one all-reduce after the
  schedule);
- checkpoints gather whole tensors per stage (``full_values``), written by tensor rank 0 only; a load cuts them again.

Schedules: the tensor ranks of a stage share its pipeline rank, so they run the same action list in the same
order, and inside one action autograd walks the same graph in the same order on each of them: every DTensor
collective (the all-reduce of a row-wise output in the forward, of a column-wise layer's input gradient in the
backward) meets its partners on the other tensor ranks whatever the schedule. That holds for the split backward of
the zero-bubble schedules (``zb_h1``, ``zbv``, ``dualpipev``, ``custom`` lists with I / W actions) too: torch's I
action differentiates the stage inputs (graph retained) and runs the input-gradient all-reduces; its W action
differentiates the parameters from the gradients I saved at the intermediates and needs no collective (a split
weight's gradient is its local shard's activations times the local output gradient; checked by logging every
collective of a column-wise / row-wise MLP under ``stage_backward_input`` / ``stage_backward_weight``: all in I,
none in W). On the first stage, whose inputs need no gradient, W runs the whole backward, collectives included,
alike on every tensor rank.

The weight-version schedules run the stage on stashed copies of its parameters (``torch.func.functional_call``):
a stashed copy of a split parameter is a DTensor with the same placements, and the styles' hooks still turn the
layer's inputs and outputs into whole tensors, so the same collectives run in the same order. PipeDream's per-stage
clipping inside the schedule takes this stage's norm only (``clip_grad_norm_(over_pipeline=False)``); Chimera builds
its up pipeline and stage-pair groups per (replica, tensor rank), and sums / broadcasts each rank's parts with the
same tensor rank of the other copy.

``bf16-mixed`` runs (fp32 weights, bf16 autocast) but is not bit-equal to one device in ``bf16-mixed``: a row-wise
layer all-reduces bf16 partial sums (each rank's share of every dot product rounded to bf16, then the sum rounded
again) where one device rounds each whole dot product once (tested within 2 bf16 ulps, measured 5e-4). ``16-mixed``
likewise (2 fp16 ulps); its scaler unscales and checks each rank's parts (torch's one foreach call per dtype refuses
a mix of DTensor and plain gradients: ``LocalPartsGradScaler`` in lightning/precision.py), and the found-inf flag is
all-reduced over the world, so an overflow in one tensor rank's part skips the step everywhere (tested).

Refused (plain-data errors, before any rank waits on another): FSDP and tensor parallelism together, tied parameters
(a plan would replace one of the tied copies' ``Parameter``), a schedule registered by an extension (not in
:data:`~lightning_pipe.config.TENSOR_PARALLEL_SCHEDULES`, which holds every built-in one), the planner
(``schedule='auto'``, plan files, measured partitions, rebalancing), a module without the hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakSet

import torch.distributed as dist
from torch import Tensor, nn
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
    """Make this rank's layers identical over the tensor group (from tensor rank 0), then split each with the
    module's hook. ``tensor_group=None``: the layers were made identical before (a reused layout). Collective over
    the tensor group."""
    hook = getattr(module, HOOK)
    for stage in stage_modules:
        for index, layer in zip(stage.layer_indices, stage.layers):
            if layer in _PARALLELIZED:
                continue
            if tensor_group is not None:
                for t in list(layer.parameters()) + list(layer.buffers()):
                    if not isinstance(t, DTensor):
                        dist.broadcast(t.data, group=tensor_group, group_src=0)
            hook(index, layer, tp_mesh)
            _PARALLELIZED.add(layer)


def is_sharded(tensor: Tensor) -> bool:
    """A DTensor split over some mesh dimension (each rank holds a different part)."""
    return isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)
