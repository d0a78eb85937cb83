"""One training step on this rank: :func:`prepare` the batch, :func:`run` the schedule over it, :func:`finish` with
the loss every rank agrees on. ``PipelineEngine`` calls the three inside the module's ``compute_loss``; Lightning's
``backward`` then hands the step's gradients over (``PipelineEngine.apply_pending_grads``).

[Note: loss scaling]
Torch's ``scale_grads=True`` divides every ``.grad`` by the micro-batch count after each ``step()``, including
gradients accumulated by earlier batches, which breaks ``accumulate_grad_batches``. We build schedules with
``scale_grads=False`` and scale the loss instead: each micro-batch loss is multiplied by
``1 / (microbatches * accumulate_grad_batches)``, so the summed gradient is the gradient of the batch-mean loss,
averaged over the accumulated batches — exactly what Lightning does on one device. Averaging over data-parallel
replicas is a separate all-reduce (mean) before the optimizer step.

[Note: gradients across Lightning's zero_grad]
In automatic optimization Lightning runs ``training_step``, *then* ``zero_grad`` (on accumulation boundaries),
*then* ``backward``. The schedule does forward and backward inside ``training_step``, so its fresh gradients would
be wiped by the zero_grad that follows. Instead of skipping Lightning's zero_grad (which would also skip the user's
``on_before_zero_grad`` / ``optimizer_zero_grad`` hooks), the engine moves the fresh gradients aside right after the
schedule (a pointer swap, no copy) and the strategy's ``backward`` puts them back, adding to what survived
zero_grad. Every hook fires where it fires on one device, and accumulation stays exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.layers.aux import AuxLossContext, aux_loss_context
from lightning_pipe.layers.batches import (
    LossParts,
    check_target,
    input_args,
    is_structured,
    loss_parts,
    rows_mismatch,
    select_rows,
    signature,
    target_elements,
)
from lightning_pipe.parallel.dp_handoff import DataParallelHandoff, OverlapStart, global_mean_count
from lightning_pipe.parallel.grads import GradientSync
from lightning_pipe.parallel.topology import ProcessGroups
from lightning_pipe.runtime.agreement import agree_step
from lightning_pipe.runtime.aux_step import AuxLossStep
from lightning_pipe.runtime.host_reads import LossKind
from lightning_pipe.runtime.microbatches import Microbatches, SplitOverride, explicit_microbatches, target_count
from lightning_pipe.runtime.ragged import refusal, row_weights, split_ragged, why_ragged_cannot_run
from lightning_pipe.runtime.rng import RankStreams
from lightning_pipe.runtime.shape_book import ShapeBook
from lightning_pipe.runtime.shapes import first_inputs, shapes_of
from lightning_pipe.runtime.spec import SchedulePlan
from lightning_pipe.runtime.stage import PipelineStage
from lightning_pipe.runtime.step_outputs import StepOutputs
from lightning_pipe.runtime.wire import named_p2p_failures


@dataclass(frozen=True)
class StepHints:
    """What the adapter knows of one training batch from Lightning's loop, handed to the engine with the batch
    (``PipelineEngine.running``). The defaults are a batch that ends in an optimizer step; hints that turn out wrong
    cost speed, never exactness ([Note: what the overlapped sync averages] in parallel/dp_handoff.py)."""

    optimizer_step_follows: bool = True
    """This batch ends in an optimizer step (no accumulation batch)."""
    zero_grad_follows: bool = True
    """Lightning's ``zero_grad`` runs after this batch's ``training_step`` (the first batch of a window)."""
    accumulate_grad_batches: int = 1
    flags: Callable[[], Sequence[bool]] | None = None
    """The adapter's step flags, agreed with the step's loss ([Note: one collective at the step's end] in
    agreement.py); ``None``: the adapter agrees them itself."""


@dataclass
class MicrobatchLosses:
    """What the schedule's loss (:func:`schedule_loss`) reads and records during one step, set by :func:`prepare`."""

    mean_scale: float = 1.0
    """Of a mean loss ([Note: loss scaling])."""
    sum_scale: float | Tensor = 1.0
    """Of a ``(sum, count)`` loss: ``1 / (accumulate_grad_batches * N)`` ([Note: token-weighted loss])."""
    structured_target: Any = None
    """A dict / tuple target: torch cuts its row indices instead ([Note: structured targets] in batches.py)."""
    targets: list[Any] | None = None
    """The module's own micro-batches' targets: torch cuts their indices ([Note: micro-batches of their own length])."""
    records: list[LossParts] = field(default_factory=list)
    """This step's micro-batch losses (last stage), detached."""
    weights: list[float] | None = None
    """Each of the module's own micro-batches' weight in a mean loss ([Note: ragged batches] in ragged.py)."""
    record_weights: list[float] = field(default_factory=list)
    """The weight of each record (1.0 but for a ragged batch)."""
    outputs: StepOutputs = field(default_factory=StepOutputs)
    """The last stage's outputs, kept on request ([Note: a training step's outputs] in step_outputs.py)."""


@dataclass
class StepInputs:
    """A training batch ready for the schedule (:func:`prepare`), read by :func:`run` and :func:`finish`."""

    args: tuple[Tensor, ...]
    """The first stage's arguments (empty where the module cut its own micro-batches)."""
    target: Any
    """What torch cuts into micro-batches for the last stage: the target, or row / micro-batch indices."""
    microbatches: Microbatches | None
    elements: float | Tensor
    """``N`` of [Note: token-weighted loss] (:func:`~lightning_pipe.parallel.dp_handoff.global_mean_count`)."""
    saved: list[Tensor | None]
    """The gradients earlier batches accumulated, set aside during the schedule."""
    overlap: OverlapStart | None
    """This batch's gradients averaged during the schedule, or ``None``."""
    aux: AuxLossContext


@dataclass(frozen=True)
class StepLoss:
    """The step's reduced loss (``PipelineEngine.reduce_loss``)."""

    loss: Tensor
    """This replica's batch loss, the same on every rank of its pipeline (0-d float32)."""
    global_count: Tensor | None
    """A ``(sum, count)`` loss's count over every replica; ``None`` for a mean loss."""
    agreed_flags: Tensor | None = None
    """The adapter's flags, where they rode the step's one all-reduce."""


@dataclass(frozen=True)
class StepResult:
    """What a training step leaves for Lightning: its loss, and what the backward's hand-over needs."""

    loss: Tensor
    grad_factor: Tensor | None
    """Multiplies the fresh gradients at the hand-over (a ``(sum, count)`` loss: [Note: token-weighted loss])."""
    agreed_flags: Tensor | None


class StepEngine(Protocol):
    """What a training step reads and writes of its engine (``PipelineEngine``, runtime/engine.py)."""

    module: Any
    plan: SchedulePlan
    groups: ProcessGroups
    device: torch.device
    owner: str
    phase: str | None
    batch_idx: int | None
    hints: StepHints
    losses: MicrobatchLosses
    loss_kind: LossKind
    parameters: list[nn.Parameter]
    stages: list[PipelineStage]
    schedule: Any
    shapes: ShapeBook
    streams: RankStreams
    dp_handoff: DataParallelHandoff
    grads: GradientSync
    aux: AuxLossStep
    per_microbatch_updates: bool
    has_first: bool
    has_last: bool
    inferring: bool
    loss_scaler: Callable[[Tensor], Tensor] | None
    step_contexts: list[Callable[[], contextlib.AbstractContextManager]]
    _pending_grads: list[Tensor | None] | None

    @property
    def last_pp_rank(self) -> int: ...

    def run_schedule(self, args: tuple[Tensor, ...], target: Any) -> None: ...

    def reduce_loss(self, tie_payload: Tensor | None) -> StepLoss: ...

    def _fresh_ties(self) -> dict[int, Tensor]: ...


# ---------------------------------------------------------------------------------------------- prepare
def prepare(engine: StepEngine, module: Any, batch: Any, keep_outputs: bool = False) -> StepInputs:
    """Before the schedule: the batch rules, the micro-batches and their shapes, ``N``, the loss scales and the
    data-parallel hand-off. This batch's gradients start from ``None``, earlier batches' are set aside ([Note:
    gradients across Lightning's zero_grad]). ``keep_outputs``: the last stage keeps its outputs ([Note: a training
    step's outputs] in step_outputs.py), each under its place in the batch (so torch cuts the row indices)."""
    hints, m = engine.hints, engine.plan.microbatches
    args, target, mbs = _split(engine, module, batch)
    elements = float(target_elements(target) if mbs is None else target_count(mbs.targets))
    counted = [target] if mbs is None else mbs.targets  # what the module's loss_count(target) is asked about
    keep = keep_outputs and engine.has_last
    structured = target if (is_structured(target) or keep) and mbs is None else None
    if structured is not None:  # torch cuts the row indices: [Note: structured targets]
        target = torch.arange(args[0].shape[0], device=engine.device)
    elif mbs is not None:  # torch cuts the micro-batch indices
        target = torch.arange(m)
    saved = [p.grad for p in engine.parameters]
    for p in engine.parameters:
        p.grad = None
    handoff = engine.dp_handoff
    overlap = handoff.begin(saved, optimizer_step_follows=hints.optimizer_step_follows,
                            zero_grad_follows=hints.zero_grad_follows)
    n = global_mean_count(elements, engine.groups, overlap is not None, engine.device)
    if overlap is not None:
        handoff.launch(overlap)
    engine.losses = MicrobatchLosses(mean_scale=1.0 / (m * hints.accumulate_grad_batches),
                                     sum_scale=1.0 / (hints.accumulate_grad_batches * n),
                                     structured_target=structured, targets=None if mbs is None else mbs.targets,
                                     weights=row_weights(mbs) if mbs is not None else None)
    engine.losses.outputs.begin(keep)
    return StepInputs(args=args if mbs is None else (), target=target, microbatches=mbs, elements=n, saved=saved,
                      overlap=overlap, aux=_aux_context(engine, module, counted, n))


def _split(engine: StepEngine, module: Any, batch: Any) -> tuple[tuple[Tensor, ...], Any, Microbatches | None]:
    """The batch rules, and the batch as the schedule takes it: the first stage's arguments and the target, and the
    module's own micro-batches if it cuts them ([Note: micro-batches of their own length]); their shapes planned."""
    inputs, target = module.split_batch(batch)
    args = input_args(inputs, engine.owner)
    m, rows = engine.plan.microbatches, args[0].shape[0]
    shapes = engine.shapes
    why = why_ragged_cannot_run(rows, m, shapes.why_not if shapes.planner is None else None)
    if why is not None:  # [Note: ragged batches] in ragged.py
        raise refusal(f"batch_idx {engine.batch_idx}", rows, m, why)
    if rows % m == 0:
        target = check_target(target, m, engine.owner, rows=rows)
    mbs = explicit_microbatches(module, inputs, args, target, m, engine.owner)
    if mbs is None and rows % m:
        mbs = split_ragged(args, target, m, engine.owner)
    if mbs is None:
        engine.shapes.use(signature("train", args, rows // m, target), first_inputs(args, m), explicit=False)
    else:
        sig = signature("train", mbs.args[0], mbs.args[0][0].shape[0], mbs.targets[0])
        engine.shapes.use(sig, shapes_of(mbs.args), explicit=True)
    return args, target, mbs


def _aux_context(engine: StepEngine, module: Any, counted: list[Any], n: float | Tensor) -> AuxLossContext:
    """This step's [Note: auxiliary losses] context; its gradient scale is computed at the first term."""
    loss_count = getattr(module, "loss_count", None)
    losses, aux = engine.losses, engine.aux
    return aux.begin(lambda: aux.grad_scale(
        per_microbatch=engine.per_microbatch_updates, loss_scale=losses.mean_scale, loss_scaler=engine.loss_scaler,
        count=lambda: sum(loss_count(t) for t in counted) if loss_count is not None else None,
        elements=n, dp_group=engine.groups.dp, dp_degree=engine.groups.topology.dp_degree, device=engine.device))


# ---------------------------------------------------------------------------------------------- run
def run(engine: StepEngine, inputs: StepInputs) -> None:
    """The schedule over the batch: every micro-batch's forward and backward, in the stages' random streams ([Note:
    random streams per stage] in rng.py), inside the step's contexts (failed transfers named, aux losses recorded,
    measurement when attached), the module's own micro-batches in place of torch's cut."""
    overlap, mbs = inputs.overlap, inputs.microbatches
    with contextlib.ExitStack() as stack:
        stack.enter_context(named_p2p_failures())  # [Note: naming a failed P2P op] in wire.py
        stack.enter_context(aux_loss_context(inputs.aux))
        for make_context in engine.step_contexts:  # measurement (memory meter, trace recorder), off by default
            stack.enter_context(make_context())
        if mbs is not None:
            stack.enter_context(SplitOverride(engine.schedule, mbs.args if engine.has_first else None,
                                              engine.plan.microbatches, keep_chunks=True))
        base = engine.streams.hold()
        try:
            engine.run_schedule(inputs.args, inputs.target)
        except BaseException:
            if overlap is not None:  # nothing waits on a failed step's collectives (the run stops)
                engine.dp_handoff.abandon(overlap.overlap)
            raise
        finally:
            engine.streams.release(base)
        if overlap is not None:
            overlap.overlap.end_schedule()
        for stage in engine.stages:  # PipeDream: the last backward's update ([Note: PipeDream weight stashing])
            stage.flush_update()
    engine.losses.targets = engine.shapes.planned = None


def schedule_loss(engine: StepEngine, output: Any, target: Any) -> Tensor:
    """The loss torch's schedule calls on a last stage for each micro-batch: recorded for the step's loss, scaled
    for the backward ([Note: loss scaling]). Zeros outside training (evaluation reduces the merged outputs)."""
    if engine.phase != "train":
        return torch.zeros((), device=engine.device)
    losses = engine.losses
    position, weight = 0, 1.0  # its place in the batch (kept outputs), its weight in a mean ([Note: ragged batches])
    if losses.structured_target is not None:  # target: this micro-batch's row indices ([Note: structured targets])
        position = int(target[0]) if losses.outputs.keeping else 0
        target = select_rows(losses.structured_target, target)
    elif losses.targets is not None:  # target: this micro-batch's index ([Note: micro-batches of their own length])
        position = int(target.reshape(-1)[0])
        weight = losses.weights[position] if losses.weights is not None else 1.0
        target = losses.targets[position]
    loss_fn, stream = engine.module.loss_fn, engine.streams.loss  # stream: None where the held one is in force
    try:
        value = loss_fn(output, target) if stream is None else stream.run(loss_fn, output, target)
    except Exception as err:
        mismatch = rows_mismatch(engine.owner, output, target, err, engine.plan.microbatches, engine.batch_idx)
        if mismatch is not None:  # (the loss's own error stays its context, with its traceback)
            raise mismatch  # noqa: B904  (not `from err`: peers name the innermost cause of a chain)
        raise
    parts = loss_parts(value, engine.owner)
    if not engine.inferring:  # torch's shape inference calls the loss too: not one of the step's micro-batches
        losses.records.append(parts.detached())
        losses.record_weights.append(weight)
        losses.outputs.add(position, output)
    if engine.per_microbatch_updates:  # each update takes its own micro-batch's mean loss (schedules/pipedream/)
        scaled = parts.value if parts.count is None else parts.value / parts.count.clamp_min(1)
    else:  # [Note: loss scaling]; a (sum, count) pair: [Note: token-weighted loss]; [Note: ragged batches]
        scaled = parts.value * (losses.mean_scale * weight if parts.count is None else losses.sum_scale)
    return engine.loss_scaler(scaled) if engine.loss_scaler is not None else scaled


# ---------------------------------------------------------------------------------------------- finish
def finish(engine: StepEngine, inputs: StepInputs) -> StepResult:
    """After the schedule: this batch's gradients wait in ``engine._pending_grads`` for Lightning's backward, the
    earlier batches' are back in ``.grad``; tied copies summed; the batch loss every rank agrees on (the step's one
    collective) and the token-weighted factor."""
    engine._pending_grads = [p.grad for p in engine.parameters]
    tie_payload = _sum_ties(engine, inputs)
    for p, g in zip(engine.parameters, inputs.saved):
        p.grad = g
    reduced = engine.reduce_loss(tie_payload)
    factor = None
    if reduced.global_count is not None:  # [Note: token-weighted loss]
        factor = inputs.elements * engine.groups.topology.dp_degree / reduced.global_count.clamp_min(1)
    loss = reduced.loss + engine.aux.end(engine.plan.microbatches, reduced.global_count, engine.device)
    return StepResult(loss, factor, reduced.agreed_flags)


def _sum_ties(engine: StepEngine, inputs: StepInputs) -> Tensor | None:
    """On a batch the optimizer step follows, tied copies are summed now ([Note: tied copies summed at the
    schedule's end] in parallel/grads.py): launched before the agreement, or riding it where every tie group is the
    world (the payload returned: [Note: tie sums in the agreement]). PipeDream sums them in each micro-batch's
    update; under the overlapped sync, FSDP or tensor parallelism they are summed in the sync."""
    grads = engine.grads
    if (inputs.overlap is not None or not grads.early_ties or not engine.hints.optimizer_step_follows
            or engine.per_microbatch_updates):
        return None
    if grads.fold_ties and agrees(engine):
        return grads.fold_payload(engine._fresh_ties())
    pending = engine._pending_grads or []
    grads.sum_ties_early({id(p): g for p, g in zip(engine.parameters, pending)})
    return None


def agrees(engine: StepEngine) -> bool:
    """Whether a training step ends in the agreement's all-reduce (runtime/agreement.py), the same on every rank."""
    return engine.hints.flags is not None and engine.groups.topology.world_size > 1


def agree_loss(engine: StepEngine, tie_payload: Tensor | None) -> StepLoss:
    """This replica's batch loss on every rank and, for a ``(sum, count)`` loss, the count over every replica: one
    all-reduce with the adapter's flags and ``tie_payload`` (:meth:`GradientSync.fold_payload`) where the flags are
    agreed with the step ([Note: one collective at the step's end]), else a broadcast from the last stage."""
    packed = _packed_loss(engine)
    count: Tensor | None = None
    agreed: Tensor | None = None
    flags = engine.hints.flags
    if flags is not None and agrees(engine):
        agreement = agree_step(packed, engine.has_last, flags(), engine.groups.topology, extra=tie_payload)
        packed, count, agreed = agreement.pipeline, agreement.replicas_count, agreement.flags
        if tie_payload is not None:
            engine.grads.unfold(tie_payload)
    elif engine.plan.pipeline_size > 1:
        dist.broadcast(packed, group=engine.groups.pp, group_src=engine.last_pp_rank)
    if not engine.loss_kind.learn(packed[1] >= 0, len(engine.losses.records)):  # no host read after the first step
        return StepLoss(packed[0].float(), None, agreed)
    loss = LossParts(packed[0], packed[1]).reduced().float()
    if count is None:
        count = packed[1].clone()
        if engine.groups.dp is not None:
            dist.all_reduce(count, group=engine.groups.dp)
    return StepLoss(loss, count, agreed)


def _packed_loss(engine: StepEngine) -> Tensor:
    """This rank's ``(mean, -1)`` or ``(sum, count)`` of the batch (float64); zeros without a last stage."""
    packed = torch.zeros(2, dtype=torch.float64, device=engine.device)
    if not engine.has_last:
        return packed
    records, m = engine.losses.records, engine.plan.microbatches
    if len(records) != m or len({r.count is None for r in records}) != 1:
        raise TypeError(
            f"{engine.owner}.loss_fn must return the same kind of loss for every micro-batch (a mean, or a "
            f"(sum, count) pair); got {['mean' if r.count is None else 'pair' for r in records]} for {m}.")
    engine.loss_kind.check(records, engine.owner)
    if records[0].count is None:  # the weights: 1.0 each but for a ragged batch ([Note: ragged batches])
        weights = engine.losses.record_weights
        packed[0] = torch.stack([r.value.float() * w for r, w in zip(records, weights)]).mean()
        packed[1] = -1.0
    else:
        packed[0] = torch.stack([r.value.double() for r in records]).sum()
        packed[1] = torch.stack([r.count for r in records]).sum()  # type: ignore[misc]
    return packed
