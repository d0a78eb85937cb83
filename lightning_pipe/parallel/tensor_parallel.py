"""Tensor parallelism per pipeline stage: the module's ``parallelize_layer`` hook over the mesh's ``tensor`` dimension.

[Note: tensor parallel stages]
With ``tensor_parallel_size = t > 1`` every stage runs on ``t`` ranks (innermost in [Note: rank order]). At setup each
rank calls the module's ``parallelize_layer(index, layer, tp_mesh)`` for each of its layers (after the layers are
allocated and made identical over the tensor group), which splits the layer in place with DTensor's
``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` plans). The contract: a
layer's inputs and outputs stay plain, whole tensors (``use_local_output=True``, the default of the styles; an output
``Shard`` of the sequence dimension must be gathered back before the layer returns), so the stages' P2P shapes and
the schedules are unchanged: each tensor rank sends and receives the whole activation to / from the same tensor rank
of the neighbouring stage (its pipeline group, topology.py), and every tensor rank of the last stage computes the same
loss.

Parameters a plan splits become DTensors (``Shard`` placements: each rank holds a part); the rest stay plain tensors
or ``Replicate`` DTensors (e.g. a row-wise layer's bias), identical on every tensor rank, with identical gradients
(DTensor all-reduces the partial input gradients of a column-wise layer in its backward). So:

- the global gradient norm counts a sharded gradient's local part on every tensor rank (summed over the tensor
  group) and a replicated one once (on tensor rank 0): [Note: counting sharded gradients] in grads.py;
  clipping by value clamps each rank's parts (:meth:`~lightning_pipe.parallel.grads.GradientSync.clip_grad_value_`): torch's
  own clipping functions refuse a list that mixes DTensor and plain gradients;
- replicas average each tensor rank's local parts with the same tensor rank of the other replicas (the
  data-parallel group is per tensor rank); the overlapped data-parallel sync is off (one all-reduce after the
  schedule);
- checkpoints gather whole tensors per stage (``full_values``), written by tensor rank 0 only; a load cuts them again.

With FSDP too (``fsdp_size > 1``: 2-D sharding per stage) each layer is split first, then ``fully_shard`` ed over the
data-parallel dimensions (lightning_pipe/parallel/fsdp.py, ``shard_stages``), one layer at a time: allocated, made identical
over the data-parallel group and then the tensor group, split by the hook, sharded. ``tp_mesh`` is the ``tensor``
dimension of the run's one ``DeviceMesh`` (``topology.build_mesh``) and FSDP's mesh is its ``dp_shard`` (or
``(dp_replicate, dp_shard)``) dimension: FSDP joins the two into one mesh for a split parameter, which only works
for slices of the same root. A split parameter becomes a DTensor over ``(dp_shard, tensor)`` (FSDP's placement is a
strided shard when the tensor split is along the same dimension); one the hook left plain (a LayerNorm's) is sharded
over ``dp_shard`` only: every tensor rank holds the same shards, replicated over ``tensor``. FSDP averages each
tensor rank's gradients over its data-parallel ranks (its reduce-scatter), the norm counts each element once
([Note: counting sharded gradients]), and checkpoints gather over both dimensions (``full_tensor``). A strided split
(:class:`FusedColwiseParallel`) is refused there: FSDP2 would shard it across its blocks (:func:`check_fsdp_can_shard`).

Tied parameters (GPT-2's embedding and head) stay tied as long as the hook leaves every copy alike: the usual plan
keeps the tied layers whole (replicated over the tensor group), and each tensor rank sums its copies with the same
tensor rank of the other holding stages (grads.py). A plan that splits one copy and not the other, or splits the two
ends of a tie on one rank into two ``Parameter`` s, would train them apart silently: :func:`agree_after_split`
compares every copy after the hooks (over the world, once at setup) and raises on every rank; a hook that fails on
some ranks is reported to all of them by the same gather (:func:`agree_after_split`).

A fused projection (q|k|v in one ``Linear``, as GPT-2's ``c_attn``) is split with :class:`FusedColwiseParallel`: each
rank holds its part of *each* block (its heads of q, of k and of v), so the layer computes whole heads locally.

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

Refused (plain-data errors, before any rank waits on another): a schedule registered by an extension that does not
declare ``ScheduleSpec.tensor_parallel`` (every built-in one does), the planner
(``schedule='auto'``, plan files, measured partitions, rebalancing), a module without the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from weakref import WeakSet

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_pipe._compat.torch import is_strided_shard, strided_shard
from lightning_pipe.config import PipelineConfigError, config_error
from lightning_pipe.layers.stages import StageModule, TiedParameter
from lightning_pipe.parallel.grads import split_dims

HOOK = "parallelize_layer"

# Layers already split in this process: a later Trainer on the same module (validate after fit) reuses them.
_PARALLELIZED: WeakSet[nn.Module] = WeakSet()


def check_module(module: nn.Module, tensor_parallel_size: int) -> None:
    """The module says how to split its layers. Plain data, the same on every rank."""
    if not callable(getattr(module, HOOK, None)):
        raise config_error(
            f"Tensor parallelism needs the module to say how to split a layer: {type(module).__name__} has no "
            f"`{HOOK}(index, layer, tp_mesh)` method.", f"tensor_parallel_size={tensor_parallel_size}",
            "tensor_parallel_size", "or set it to 1",
            fix=f"Implement `{HOOK}` (docs/parallelism.md: \"Tensor parallelism per stage\")")


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a ``Linear`` whose output is ``blocks`` projections side by side (q|k|v: 3; gate|up:
    2): each tensor rank holds its part of every block, so its local output is ``[q_t | k_t | v_t]`` (its own heads
    of each) rather than a contiguous slice that would cut across q and k. The weight and bias are DTensors with a
    strided placement, so gathering them (checkpoints) gives the original layout back; the output stays local.
    FSDP cannot shard such a parameter yet (:func:`check_fsdp_can_shard`).
    """

    def __init__(self, blocks: int, *, use_local_output: bool = True) -> None:
        if blocks < 1:
            raise ValueError(f"FusedColwiseParallel needs blocks >= 1, got {blocks}")
        super().__init__(use_local_output=use_local_output)
        self.blocks = blocks

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        parts = self.blocks * device_mesh.size()
        if not isinstance(module, nn.Linear) or module.out_features % parts:
            raise ValueError(
                f"FusedColwiseParallel({self.blocks}) splits each of {self.blocks} output blocks over "
                f"{device_mesh.size()} tensor ranks: out_features must be divisible by {parts}; got "
                f"{type(module).__name__} with out_features={getattr(module, 'out_features', None)}.")
        placement = [strided_shard(0, self.blocks)]
        for param_name, param in module.named_parameters():
            module.register_parameter(param_name, nn.Parameter(
                distribute_tensor(param, device_mesh, placement, src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor,
                           device_mesh: DeviceMesh) -> Any:
        # The output is strided like the weight (each rank: its part of every block); ColwiseParallel would
        # redistribute it to a contiguous Shard(-1), i.e. move data between ranks and cut across the blocks.
        return outputs.to_local() if use_local_output else outputs


Placer = Callable[[Callable[[int, nn.Module], None]], list[StageModule]]
"""``place(split)``: allocate or move this rank's layers (FSDP: and shard them), calling ``split(index, layer)`` on each
once it is placed; returns the stage modules to run."""


def apply_tensor_parallel(module: nn.Module, tied: Sequence[TiedParameter], tp_mesh: DeviceMesh,
                          tensor_group: dist.ProcessGroup, tp_rank: int, device: torch.device, fresh: bool,
                          for_fsdp: bool, place: Placer, report: Callable[[BaseException], None]) -> list[StageModule]:
    """Split this rank's layers with the module's hook while ``place`` puts them on ``device`` ([Note: tensor
    parallel stages]), then, for a module split for the first time (``fresh``), agree over the world that every rank
    split its layers and kept its ties (:func:`agree_after_split`); the tensor ranks' random states made equal.

    The hooks are the module's code: a failure on one rank is ``report`` ed at once (a peer whose hook failed later,
    or not at all, is still in the next layers' broadcasts and its hook's own collectives, which this rank will not
    join; only the store reaches it there: [Note: failure propagation]) and raised on every rank by the agreement.
    Collective."""
    split = partial(split_layer, module, tp_mesh=tp_mesh, tensor_group=tensor_group if fresh else None,
                    for_fsdp=for_fsdp)
    ties_before = tie_copies(module, tied) if fresh else []
    placed: list[StageModule] = []
    failure: Exception | None = None
    try:
        placed = place(split)
    except Exception as err:
        if not fresh:
            raise
        failure = err
        report(err)
    if fresh:
        agree_after_split(module, tied, ties_before, tp_rank, failure)
    sync_random_state(tensor_group, device)  # dropout draws alike on the tensor ranks (every fit: cheap)
    return placed


def parallelize_stages(stage_modules: Sequence[StageModule], split: Callable[[int, nn.Module], None]) -> None:
    """``split(index, layer)`` (:func:`split_layer` with its mesh and group bound) for each of this rank's layers.
    Collective over the tensor group."""
    for stage in stage_modules:
        for index, layer in zip(stage.layer_indices, stage.layers):
            split(index, layer)


def split_layer(module: nn.Module, index: int, layer: nn.Module, tp_mesh: DeviceMesh,
                tensor_group: dist.ProcessGroup | None, for_fsdp: bool = False) -> None:
    """Make one layer identical over the tensor group (from tensor rank 0), then split it with the module's hook.
    ``tensor_group=None``: the layer was made identical before (a reused layout). A layer split earlier in this
    process is left as it is. Collective over the tensor group.

    With FSDP the caller shards the layer right after (lightning_pipe/parallel/fsdp.py): the hook sees whole, plain
    parameters either way, and ``tp_mesh`` is the ``tensor`` dimension of the run's one mesh, so FSDP can combine
    it with the data-parallel dimensions into 2-D (3-D for HSDP) DTensors (``for_fsdp``: refuse what it cannot).
    """
    if layer in _PARALLELIZED:
        return
    if tensor_group is not None:
        for t in list(layer.parameters()) + list(layer.buffers()):
            if not isinstance(t, DTensor):
                dist.broadcast(t.data, group=tensor_group, group_src=0)
    getattr(module, HOOK)(index, layer, tp_mesh)
    _PARALLELIZED.add(layer)
    if for_fsdp:
        check_fsdp_can_shard(index, layer)


def check_fsdp_can_shard(index: int, layer: nn.Module) -> None:
    """Refuse a parameter split with a strided placement (:class:`FusedColwiseParallel`) before FSDP shards it.

    FSDP2 (torch 2.13) shards a tensor-parallel part by rows of the rank's local tensor and describes the result as
    if the part were a contiguous slice: for ``[q_t | k_t | v_t]`` its shards straddle the blocks, and gathering
    (checkpoints, ``full_tensor``) comes out scrambled — measured on the GPT recipe: a pipeline 2 x FSDP 2 x tensor 2
    run's gathered ``c_attn`` weight differed from one device's by up to 0.09 in 75 % of its elements.
    """
    strided = [f"{name} {tuple(p.placements)}" for name, p in layer.named_parameters()
               if isinstance(p, DTensor) and any(is_strided_shard(pl) for pl in p.placements)]
    if strided:
        raise config_error(
            "FSDP cannot shard a parameter that tensor parallelism split with a strided placement "
            "(FusedColwiseParallel: each tensor rank holds a part of every block, e.g. its heads of q, k and v); "
            "its shards would straddle the blocks and gathered checkpoints would be scrambled.",
            f"fsdp_size > 1 with layer {index} ({type(layer).__name__}): {', '.join(strided)}",
            "fsdp_size", "or tensor_parallel_size=1", also=("tensor_parallel_size",),
            fix="Use separate q / k / v projections (plain ColwiseParallel) for FSDP x tensor parallelism")


def agree_after_split(module: nn.Module, tied: Sequence[TiedParameter], before: list[dict[str, Tensor]],
                      tp_rank: int, failure: Exception | None) -> None:
    """After this rank's layers were split (``failure``: what stopped it, if anything): tell every rank what every
    rank saw, so all raise the same error, then check the copies of each tie are still alike. One gather over the
    world at setup. Collective: every rank calls it, failed or not.

    The tensor (and FSDP) ranks of a stage hold the same layers, so a hook fails alike on each, at the same point;
    the other stages must learn it here rather than wait for those ranks at their next transfer.
    """
    mine = _Setup(type(failure).__name__ if failure else None, str(failure) if failure else "",
                  [] if failure else _tie_layouts(module, tied, before, tp_rank))
    gathered: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, mine)
    except Exception:
        if failure is None:
            raise
        # a peer still in the collectives this rank skipped was stopped (by its failure watch): this rank's own
        # error is the one to raise, not the lost connection
        raise failure from None
    if failure is not None:
        raise failure
    failed = [(rank, setup) for rank, setup in enumerate(gathered) if setup.error_type is not None]
    if failed:
        rank, setup = failed[0]
        cls = PipelineConfigError if setup.error_type == PipelineConfigError.__name__ else RuntimeError
        raise cls(f"Splitting the layers failed on rank {rank} ({setup.error_type}): {setup.message}")
    _check_ties_kept([setup.tie_layouts for setup in gathered])


@dataclass(frozen=True)
class _Setup:
    """What one rank tells the others after its layers were split."""

    error_type: str | None
    message: str
    tie_layouts: list[tuple[str, str]]


def tie_copies(module: nn.Module, tied: Sequence[TiedParameter]) -> list[dict[str, Tensor]]:
    """Per tie, this rank's copies by name (other ranks' layers are placeholders without parameters)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    return [{n: named[n] for n in tie.names if n in named} for tie in tied]


def _layout(param: Tensor) -> str:
    """What must agree between the copies of a tie (with the same tensor rank): placements and local shape.
    Replicated or whole are the same thing for the tie's sum."""
    if split_dims(param):
        assert isinstance(param, DTensor)
        placements = ", ".join(map(str, param.placements))
        return f"split {placements}: local {tuple(param.to_local().shape)} of {tuple(param.shape)}"
    return f"whole {tuple(param.shape)}"


def _tie_layouts(module: nn.Module, tied: Sequence[TiedParameter], before: list[dict[str, Tensor]],
                 tp_rank: int) -> list[tuple[str, str]]:
    """(tie and tensor rank, layout) of each copy this rank holds after the split; a shared ``Parameter`` the hook
    replaced by several is reported as a layout of its own, so it can never agree."""
    out: list[tuple[str, str]] = []
    for tie, old, new in zip(tied, before, tie_copies(module, tied)):
        key = f"{list(tie.names)} (tensor rank {tp_rank})"
        if len({id(p) for p in new.values()}) > len({id(p) for p in old.values()}):
            out.append((key, f"one Parameter on rank {dist.get_rank()} became {len(new)} (the hook replaced a copy)"))
        out += [(key, _layout(p)) for p in new.values()]
    return out


def _check_ties_kept(per_rank: Sequence[Sequence[tuple[str, str]]]) -> None:
    """Raise (on every rank: each sees every rank's layouts) if the copies of a tie differ."""
    seen: dict[str, set[str]] = {}
    for items in per_rank:
        for key, layout in items:
            seen.setdefault(key, set()).add(layout)
    bad = {key: sorted(layouts) for key, layouts in seen.items() if len(layouts) > 1}
    if bad:
        raise config_error(
            "Under tensor parallelism the copies of a tied parameter must stay one parameter per rank and be split "
            "alike on every stage (or not at all): otherwise they would silently train apart.",
            f"after `{HOOK}`: " + "; ".join(f"{n}: " + " vs ".join(v) for n, v in bad.items()), "tensor_parallel_size",
            "or set it to 1", fix=f"Make `{HOOK}` leave the tied layers whole (or split every copy the same way), "
            "or untie the weights")


def sync_random_state(tensor_group: dist.ProcessGroup, device: torch.device) -> None:
    """Give every tensor rank tensor rank 0's random state (torch's CPU generator and ``device``'s). Collective over
    the tensor group.

    The tensor ranks of a stage run the same ops on the same data, so from equal states they draw equal random
    numbers ever after: dropout in the whole (replicated) parts of a layer — after a row-wise projection, on the
    embedding — masks the same elements on every rank, as one device would. From unequal states (an unseeded run,
    a per-rank seed) each rank would drop different elements of what must be one tensor, and the ranks' copies of
    the whole parameters would drift apart silently. (Inside a split region, e.g. attention dropout on each rank's
    own heads, equal states mean equal masks on different heads: still dropout, correlated across ranks.)
    """
    def from_rank0(state: Tensor) -> Tensor:
        buffer = state.to(device) if device.type == "cuda" else state.clone()  # (NCCL moves device tensors only)
        dist.broadcast(buffer, group=tensor_group, group_src=0)
        return buffer.cpu()

    torch.set_rng_state(from_rank0(torch.get_rng_state()))
    if device.type == "cuda":
        torch.cuda.set_rng_state(from_rank0(torch.cuda.get_rng_state(device)), device)
