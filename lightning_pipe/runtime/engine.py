"""The runtime of one rank: its stages, torch's schedule, and the few rules that make the numbers exact.

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

[Note: shape inference has no side effects]
Torch's inference runs each stage for real, in the module's current mode: BatchNorm would update its running
statistics (later stages on stand-in inputs) and count a batch too many. The stages are
``_compat.GuardedPipelineStage``: each inference runs inside :meth:`PipelineEngine._inference_guard`, which restores
the stage module's buffers and the RNG state and keeps the inference's loss call out of the step's losses; stand-ins
are zeros, not ``torch.empty``. Parameters and gradients are untouched (torch computes input gradients only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe._compat import torch as _compat
from lightning_pipe._compat.stage_shapes import SplitOverride
from lightning_pipe.layers.aux import aux_loss_context
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
from lightning_pipe.layers.stages import StageModule
from lightning_pipe.parallel.dp_handoff import DataParallelHandoff, mean_count
from lightning_pipe.parallel.dp_overlap import DataParallelOverlap
from lightning_pipe.parallel.grads import GradientSync
from lightning_pipe.parallel.topology import ProcessGroups
from lightning_pipe.runtime.agreement import agree_step
from lightning_pipe.runtime.aux import AuxLossStep
from lightning_pipe.runtime.evaluation import broadcast_object, eval_loss, eval_loss_and_output, eval_output
from lightning_pipe.runtime.host_reads import LossKind
from lightning_pipe.runtime.microbatches import Microbatches, explicit_microbatches, target_count
from lightning_pipe.runtime.ragged import refusal, row_weights, split_ragged, why_ragged_cannot_run
from lightning_pipe.runtime.rng import RankStreams
from lightning_pipe.runtime.shape_book import ShapeBook
from lightning_pipe.runtime.shapes import first_inputs, shapes_of
from lightning_pipe.runtime.spec import SchedulePlan, build_torch_schedule
from lightning_pipe.runtime.stage import PipelineStage
from lightning_pipe.runtime.step_outputs import StepOutputs
from lightning_pipe.runtime.wire import named_p2p_failures

PipelineModel = Any
"""The user's module as the core sees it: an ``nn.Module`` with the layer-list contract of
:class:`~lightning_pipe.PipelineModule` (``loss_fn``, ``split_batch``, the layer list). The core cannot name the
Lightning class, and ``nn.Module``'s ``__getattr__`` would type the contract's methods as tensors."""


class PipelineEngine:
    """Owns this rank's stages and schedule; answers :class:`~lightning_pipe.PipelineModule`'s requests."""

    def __init__(self, module: PipelineModel, stage_modules: list[StageModule], local_stage_ids: list[int],
                 plan: SchedulePlan, groups: ProcessGroups, device: torch.device) -> None:
        self.module = module
        self.plan = plan
        self.groups = groups
        self.device = device
        self.stage_modules = stage_modules
        self.stages, self.schedule = self._build_runtime(stage_modules, local_stage_ids)
        self.streams = RankStreams(self.stages, device)  # [Note: random streams per stage] in rng.py
        # PipeDream: the optimizer steps inside the schedule, per micro-batch ([Note: PipeDream weight stashing])
        self.per_microbatch_updates = any(st.updates_per_microbatch for st in self.stages)
        self.has_first = any(st.is_first for st in self.stages)
        self.has_last = any(st.is_last for st in self.stages)
        self.phase: str | None = None
        self.batch_idx: int | None = None
        self.accumulate_grad_batches = 1
        self._loss_scale = 1.0  # of a mean loss ([Note: loss scaling])
        self._sum_scale: float | Tensor = 1.0  # of a (sum, count) loss ([Note: token-weighted loss] in batches.py)
        self.shape_inferences = 0  # forward shape inferences run by this rank's stages
        self._inferring = False
        self._pending_grads: list[Tensor | None] | None = None
        # Deduplicated: a V schedule can put both ends of a tied weight on one rank (one object, two stages).
        self.parameters = list({id(p): p for sm in stage_modules for p in sm.parameters()}.values())
        self.grads = GradientSync(module, self.parameters, groups, device)
        # [Note: what the overlapped sync averages] in dp_handoff.py; the strategy sets the two hints before each
        # training batch.
        # PipeDream averages each micro-batch's gradients in its own update (pipedream.stages.MicrobatchUpdate); FSDP
        # stages average in their own reduce-scatter ([Note: FSDP under the pipeline schedule] in fsdp.py).
        self.dp_handoff = DataParallelHandoff(
            DataParallelOverlap(self.stages, self.parameters, groups.dp)
            if groups.dp is not None and groups.shard is None and groups.tensor is None and groups.experts is None
            and not self.per_microbatch_updates else None,
            plan.microbatches)
        self._grad_factor: Tensor | None = None  # token-weighted loss: applied to the fresh gradients on hand-over
        # fp16 loss scaling, set by PipelinePrecision ([Note: fp16 loss scaling in a pipeline] in lightning/precision.py)
        self.loss_scaler: Callable[[Tensor], Tensor] | None = None
        self._records: list[LossParts] = []  # this step's micro-batch losses (last stage)
        self._record_weights: list[float] = []  # their weights in a mean loss ([Note: ragged batches])
        self._mb_weights: list[float] | None = None  # per explicit micro-batch (ragged.py)
        self.outputs = StepOutputs()  # [Note: a training step's outputs] in step_outputs.py
        self.step_outputs: Any = None
        self._loss_kind = LossKind()  # [Note: the loss kind is read once]
        self._structured_target: Any = None  # a dict / tuple target of this step: [Note: structured targets]
        self._owner = type(module).__name__
        self.aux = AuxLossStep(groups.pp, plan.pipeline_size, self._owner, plan.spec.name)  # [Note: auxiliary losses] in layers/aux.py
        # Context managers entered around every training schedule step (see lightning_pipe.trace.memory / trace).
        self.step_contexts: list[Callable[[], contextlib.AbstractContextManager]] = []
        # signatures whose evaluation output was checked ([Note: evaluation outputs are joined along dim 0])
        self.eval_checked: set[Any] = set()
        # [Note: re-inference on a new shape]; [Note: shapes without re-inference] in shapes.py
        self.shapes = ShapeBook(self.stages, self.schedule, plan.stage_to_rank, groups.pp, device, self._reset_shapes,
                                self._planning, self._owner, self._unplannable(plan), plan.spec.name,
                                together=groups.shard)
        for stage in self.stages:  # [Note: sends of the receiver's shape] in stage.py
            stage.expected_sends = self.shapes.expected_sends
        self._mb_targets: list[Any] | None = None  # explicit micro-batches' targets (trim_microbatch)
        # The adapter's flags, agreed over the world with the step's loss ([Note: one collective at the step's end]
        # in agreement.py); read once per step with take_agreed_flags.
        self.step_flags: Callable[[], Sequence[bool]] | None = None
        self.manual = False
        """The module optimizes manually: a training step may run several passes ([Note: manual optimization in a
        pipeline] in lightning/manual.py)."""
        self._agreed: Tensor | None = None

    @property
    def dp_overlap(self) -> DataParallelOverlap | None:
        """This rank's overlapped data-parallel sync, if it averages anything (``dp_handoff.overlap``)."""
        return self.dp_handoff.overlap

    @property
    def overlap_dp_sync(self) -> bool:
        """Average during the schedule; off: one all-reduce after it (bench/dp_overlap.py compares both)."""
        return self.dp_handoff.enabled

    @overlap_dp_sync.setter
    def overlap_dp_sync(self, on: bool) -> None:
        self.dp_handoff.enabled = on

    @property
    def dp_sync_counts(self) -> dict[str, int]:
        """Batches averaged during the schedule ("overlapped") and after it ("after_schedule")."""
        return self.dp_handoff.counts

    def _build_runtime(self, stage_modules: list[StageModule],
                       local_stage_ids: list[int]) -> tuple[list[PipelineStage], Any]:
        """This rank's torch stages and the schedule that drives them (a subclass may run several pipelines)."""
        stages = [
            (self.plan.spec.stage_class or PipelineStage)(
                sm, s, self.plan.num_stages, self.device, group=self.groups.pp, inference_guard=self._inference_guard)
            for sm, s in zip(stage_modules, local_stage_ids)
        ]
        schedule = build_torch_schedule(self.plan, stages, self._schedule_loss)
        if _compat.runs_split_backward(schedule):  # [Note: split backward detaches stage outputs] in stage.py
            for stage in stages:
                stage.keep_saved_outputs()
        return stages, schedule

    def _unplannable(self, plan: SchedulePlan) -> tuple[str, tuple[str, ...]] | None:
        """Why this layout cannot plan a batch's shapes on meta tensors, and the settings that decide it; None if it
        can ([Note: shapes without re-inference] in shapes.py)."""
        if self.groups.shard is not None:
            return "FSDP stages (fsdp_size > 1)", ("fsdp_size",)
        if self.groups.tensor is not None:
            return "tensor-parallel stages (tensor_parallel_size > 1)", ("tensor_parallel_size",)
        if self.per_microbatch_updates:
            return f"schedule {plan.spec.name!r}, which updates the weights per micro-batch", ("schedule",)
        return None

    # ------------------------------------------------------------------ phase plumbing
    @contextlib.contextmanager
    def running(self, phase: str, batch_idx: int | None = None) -> Iterator[None]:
        """Set by the strategy around each Lightning step so compute_loss knows what to run."""
        self.phase, self.batch_idx = phase, batch_idx
        self.step_loss = None
        try:
            yield
        finally:
            self.phase = None

    step_loss: Tensor | None = None
    """The loss this training step's ``compute_loss`` returned (``None`` until it ran): [Note: the loss a training
    step returns]."""

    @property
    def last_pp_rank(self) -> int:
        return self.plan.stage_to_rank(self.plan.num_stages - 1)

    def _schedule_loss(self, output: Any, target: Any) -> Tensor:
        if self.phase != "train":
            # Forward-only passes still call the schedule's loss; we compute eval losses on merged outputs.
            return torch.zeros((), device=self.device)
        position, weight = 0, 1.0  # its place in the batch (kept outputs), its weight in a mean ([Note: ragged ...])
        if self._structured_target is not None:  # target: this micro-batch's row indices ([Note: structured targets])
            position = int(target[0]) if self.outputs.keeping else 0
            target = select_rows(self._structured_target, target)
        elif self._mb_targets is not None:  # target: this micro-batch's index ([Note: micro-batches of ...])
            position = int(target.reshape(-1)[0])
            weight = self._mb_weights[position] if self._mb_weights is not None else 1.0
            target = self._mb_targets[position]
        loss_fn, stream = self.module.loss_fn, self.streams.loss  # stream: None where the held one is in force
        try:
            value = loss_fn(output, target) if stream is None else stream.run(loss_fn, output, target)
        except Exception as err:
            mismatch = rows_mismatch(self._owner, output, target, err, self.plan.microbatches, self.batch_idx)
            if mismatch is not None:  # (the loss's own error stays its context, with its traceback)
                raise mismatch  # noqa: B904  (not `from err`: peers name the innermost cause of a chain)
            raise
        parts = loss_parts(value, self._owner)
        if not self._inferring:  # torch's shape inference calls the loss too: not one of the step's micro-batches
            self._records.append(parts.detached())
            self._record_weights.append(weight)
            self.outputs.add(position, output)
        if self.per_microbatch_updates:  # each update takes its own micro-batch's mean loss (schedules/pipedream/)
            scaled = parts.value if parts.count is None else parts.value / parts.count.clamp_min(1)
        else:  # [Note: loss scaling]; a (sum, count) pair: [Note: token-weighted loss]; [Note: ragged batches]
            scaled = parts.value * (self._loss_scale * weight if parts.count is None else self._sum_scale)
        return self.loss_scaler(scaled) if self.loss_scaler is not None else scaled

    @contextlib.contextmanager
    def _inference_guard(self, stage_module: nn.Module, forward: bool) -> Iterator[None]:
        """Around each of torch's shape inferences: [Note: shape inference has no side effects]."""
        buffers = [(b, b.detach().clone()) for b in stage_module.buffers()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self._inferring = True
        aux = self.aux.context
        if aux is not None:
            aux.recording = False
        self.shape_inferences += forward
        # the stage's own stream, unchanged afterwards ([Note: random streams per stage] in rng.py)
        stream = next((st.random_stream for st in self.stages if st.submod is stage_module), None)
        try:
            with stream.peek() if stream is not None else contextlib.nullcontext():
                yield
        finally:
            self._inferring = False
            if aux is not None:
                aux.recording = True
            # Through .data: no autograd version bump, so the inference graph (BatchNorm saves its running
            # statistics) still serves the backward inference that follows (only its shapes are used).
            for buffer, saved in buffers:
                buffer.data.copy_(saved)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)

    # ------------------------------------------------------------------ requests from PipelineModule
    def loss(self, module: PipelineModel, batch: Any, return_outputs: bool = False) -> Any:
        """The batch loss; with ``return_outputs``, ``(loss, the last layer's outputs)`` on every rank ([Note: a
        training step's outputs] in step_outputs.py)."""
        if self.phase == "train":
            if self.step_loss is not None and self.manual and self._pending_grads is not None:
                raise RuntimeError(
                    f"{self._owner}.training_step called compute_loss again (batch_idx {self.batch_idx}) before "
                    "manual_backward of the loss the previous call returned. Rule: under PipelineStrategy each "
                    "compute_loss is a whole pass of the pipeline whose gradients wait for manual_backward; two "
                    "passes' gradients cannot be held at once. Call manual_backward(loss) after each compute_loss, "
                    "or compute both losses in one loss_fn.")
            if self.step_loss is not None and not self.manual:  # [Note: the loss a training step returns]
                raise RuntimeError(
                    f"{self._owner}.training_step called compute_loss a second time (batch_idx {self.batch_idx}). "
                    "Rule: under PipelineStrategy one training_step runs the schedule once, in its one compute_loss "
                    "call (the forward and backward of every micro-batch of that batch); a second call would replace "
                    "the first call's gradients. Call compute_loss once per training_step; to train on more rows, "
                    "make the batch larger (or use accumulate_grad_batches).")
            self.step_loss = self._train_step(module, batch, return_outputs)
            return (self.step_loss, self.step_outputs) if return_outputs else self.step_loss
        if self.phase in ("validate", "test", "predict"):
            return eval_loss_and_output(self, module, batch) if return_outputs else eval_loss(self, module, batch)
        raise RuntimeError(
            "compute_loss was called outside a Lightning step (training_step / validation_step / test_step). "
            "Under PipelineStrategy the model is split across ranks, so every rank must run the same step."
        )

    def output(self, module: PipelineModel, batch: Any) -> Any:
        if self.phase == "train":
            raise RuntimeError("compute_output runs forward only; in training_step use compute_loss(batch).")
        return eval_output(self, module, batch)

    # ------------------------------------------------------------------ training
    def _reset_shapes(self) -> None:
        _compat.reset_schedule_shapes(self.schedule)

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        """Around a meta forward (shapes.py): layer timers and trace hooks see an inference, not a step's forward."""
        self._inferring = True
        try:
            yield
        finally:
            self._inferring = False

    def _run_schedule(self, args: tuple[Tensor, ...], target: Tensor) -> None:
        """One training step of the schedule over this batch (inputs where a first stage is, target at a last)."""
        self.schedule.step(*(args if self.has_first else ()), target=target if self.has_last else None,
                           **_compat.train_step_kwargs(self.schedule))  # [Note: no outputs kept by a training step]

    def _microbatches(self, module: PipelineModel, inputs: Any, args: tuple[Tensor, ...],
                      target: Any) -> tuple[Any, Microbatches | None]:
        """The checked target, and the micro-batches the engine cuts itself (the module's own, or a ragged batch's:
        [Note: ragged batches] in ragged.py); ``None``: torch cuts the batch."""
        m, rows = self.plan.microbatches, args[0].shape[0]
        why = why_ragged_cannot_run(rows, m, self.shapes.why_not if self.shapes.planner is None else None)
        if why is not None:
            raise refusal(f"batch_idx {self.batch_idx}", rows, m, why)
        if rows % m == 0:
            target = check_target(target, m, self._owner, rows=rows)
        mbs = explicit_microbatches(module, inputs, args, target, m, self._owner)  # [Note: micro-batches of ...]
        if mbs is None and rows % m:
            mbs = split_ragged(args, target, m, self._owner)
        self._mb_weights = row_weights(mbs) if mbs is not None else None
        return target, mbs

    def _train_step(self, module: PipelineModel, batch: Any, keep_outputs: bool = False) -> Tensor:
        inputs, target = module.split_batch(batch)
        args = input_args(inputs, self._owner)
        m = self.plan.microbatches
        target, mbs = self._microbatches(module, inputs, args, target)
        mb_rows = args[0].shape[0] // m
        self.outputs.begin(keep_outputs and self.has_last)
        if mbs is None:
            sig = signature("train", args, mb_rows, target)
            self.shapes.use(sig, first_inputs(args, m), explicit=False)
        else:
            sig = signature("train", mbs.args[0], mbs.args[0][0].shape[0], mbs.targets[0])
            self.shapes.use(sig, shapes_of(mbs.args), explicit=True)
        self._loss_scale = 1.0 / (m * self.accumulate_grad_batches)
        targets = float(target_elements(target) if mbs is None else target_count(mbs.targets))
        self._structured_target = (target if (is_structured(target) or self.outputs.keeping) and mbs is None
                                   else None)
        self._mb_targets = mbs.targets if mbs is not None else None
        if self._structured_target is not None:  # torch cuts the row indices: [Note: structured targets]
            target = torch.arange(args[0].shape[0], device=self.device)
        elif mbs is not None:  # torch cuts the micro-batch indices
            target = torch.arange(m)
        # [Note: gradients across Lightning's zero_grad]: keep what earlier batches accumulated out of the way.
        saved = [p.grad for p in self.parameters]
        for p in self.parameters:
            p.grad = None
        self._records, self._record_weights = [], []
        self._agreed = None
        # N of [Note: token-weighted loss]: a device value under the overlapped DP sync (the replicas' mean)
        overlap, elements = self.dp_handoff.begin(saved, targets, self.groups.dp,
                                                  self.groups.topology.data_parallel_size, self.device)
        if overlap is None and self.groups.experts is not None:  # an expert gradient mixes replicas' losses:
            elements = self.groups.experts.mean_count(elements, self.device)  # one N for all ([Note: expert ...])
        elif overlap is None and self.groups.shard is not None and self.groups.dp is not None:
            # FSDP averages every data rank's gradients in the schedule, before the factor: one N for all
            elements = mean_count(elements, self.groups.dp, self.groups.topology.dp_degree, self.device)
        self._sum_scale = 1.0 / (self.accumulate_grad_batches * elements)
        count_targets = ([self._structured_target if self._structured_target is not None else target]
                         if mbs is None else mbs.targets)
        loss_count = getattr(module, "loss_count", None)
        aux_context = self.aux.begin(lambda: self.aux.grad_scale(
            per_microbatch=self.per_microbatch_updates, loss_scale=self._loss_scale, loss_scaler=self.loss_scaler,
            count=lambda: sum(loss_count(t) for t in count_targets) if loss_count is not None else None,
            elements=elements,
            dp_group=self.groups.dp, dp_degree=self.groups.topology.dp_degree, device=self.device))
        with contextlib.ExitStack() as stack:
            stack.enter_context(named_p2p_failures())  # [Note: naming a failed P2P op] in wire.py
            stack.enter_context(aux_loss_context(aux_context))
            for make_context in self.step_contexts:  # measurement (memory meter, trace recorder), off by default
                stack.enter_context(make_context())
            if mbs is not None:
                stack.enter_context(SplitOverride(self.schedule, mbs.args if self.has_first else None,
                                                                m, keep_chunks=True))
            base = self.streams.hold()  # [Note: random streams per stage] in rng.py
            try:
                self._run_schedule(() if mbs is not None else args, target)
            except BaseException:
                if overlap is not None:  # nothing waits on a failed step's collectives (the run stops)
                    self.dp_handoff.abandon(overlap)
                raise
            finally:
                self.streams.release(base)
            if overlap is not None:
                overlap.end_schedule()
            for stage in self.stages:  # PipeDream: the last backward's update ([Note: PipeDream weight stashing])
                stage.flush_update()
        self._mb_targets = self.shapes.planned = None
        self._pending_grads = [p.grad for p in self.parameters]
        tie_payload = None
        if (overlap is None and self.grads.early_ties and self.dp_handoff.optimizer_step_follows
                and not self.per_microbatch_updates):  # (PipeDream sums its ties in each micro-batch's update)
            if self.grads.fold_ties and self._agrees:  # [Note: tie sums in the agreement] in parallel/grads.py
                tie_payload = self.grads.fold_payload(self._fresh_ties())
            else:  # before the agreement, so both meet at once ([Note: tied copies summed at the schedule's end])
                self.grads.sum_ties_early({id(p): g for p, g in zip(self.parameters, self._pending_grads)})
        for p, g in zip(self.parameters, saved):
            p.grad = g
        loss, global_count = self._step_loss(tie_payload)
        if keep_outputs:  # every rank of the pipeline ([Note: a training step's outputs])
            self.step_outputs = broadcast_object(self, self.outputs.joined())
        self._grad_factor = None
        if global_count is not None:  # [Note: token-weighted loss]
            self._grad_factor = elements * self.groups.topology.dp_degree / global_count.clamp_min(1)
        return loss + self.aux.end(self.plan.microbatches, global_count, self.device)

    @property
    def _agrees(self) -> bool:
        """Whether a training step ends in the agreement's all-reduce (runtime/agreement.py), the same on every rank."""
        return self.step_flags is not None and self.groups.topology.world_size > 1

    def _fresh_ties(self) -> dict[int, Tensor]:
        """This batch's gradient of every tied parameter, by ``id``; zeros (then pending like any other) where this
        rank's copy got none, so every rank's payload has the same layout."""
        pending, fresh = self._pending_grads, {}
        assert pending is not None  # set by _train_step right before
        for i, p in enumerate(self.parameters):
            if id(p) in self.grads.tie_of:
                grad = pending[i]
                if grad is None:
                    grad = pending[i] = torch.zeros_like(p)
                fresh[id(p)] = grad
        return fresh

    def _step_loss(self, tie_payload: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """This replica's batch loss (on every rank) and, for a (sum, count) loss, the count over all replicas;
        ``tie_payload`` (:meth:`GradientSync.fold_payload`) rides the agreement."""
        packed = torch.zeros(2, dtype=torch.float64, device=self.device)  # (mean, -1) or (sum, count)
        if self.has_last:
            records, m = self._records, self.plan.microbatches
            if len(records) != m or len({r.count is None for r in records}) != 1:
                raise TypeError(
                    f"{self._owner}.loss_fn must return the same kind of loss for every micro-batch (a mean, or a "
                    f"(sum, count) pair); got {['mean' if r.count is None else 'pair' for r in records]} for {m}.")
            self._loss_kind.check(records, self._owner)
            if records[0].count is None:
                weights = self._record_weights  # 1.0 each unless the batch was ragged ([Note: ragged batches])
                packed[0] = torch.stack([r.value.float() * w for r, w in zip(records, weights)]).mean()
                packed[1] = -1.0
            else:
                packed[0] = torch.stack([r.value.double() for r in records]).sum()
                packed[1] = torch.stack([r.count for r in records]).sum()  # type: ignore[misc]
        count: Tensor | None = None
        if self._agrees:
            packed, count, self._agreed = agree_step(packed, self.has_last, self.step_flags(),  # type: ignore[misc]
                                                     self.groups.topology, extra=tie_payload)
            if tie_payload is not None:
                self.grads.unfold(tie_payload)
        elif self.plan.pipeline_size > 1:
            dist.broadcast(packed, group=self.groups.pp, group_src=self.last_pp_rank)
        if not self._loss_kind.learn(packed[1] >= 0, len(self._records)):  # no host read after the first step
            return packed[0].float(), None
        loss = LossParts(packed[0], packed[1]).reduced().float()
        if count is None:
            count = packed[1].clone()
            if self.groups.dp is not None:
                dist.all_reduce(count, group=self.groups.dp)
        return loss, count

    def take_agreed_flags(self) -> list[bool] | None:
        """The step flags agreed with this training step's loss (``None`` if none were: the adapter agrees them
        itself); each agreement is read once."""
        agreed, self._agreed = self._agreed, None
        return None if agreed is None else [bool(v) for v in agreed.tolist()]

    def apply_pending_grads(self) -> None:
        """Lightning's backward, in pipeline terms: add this batch's gradients to what survived zero_grad."""
        if self._pending_grads is None:
            raise RuntimeError(
                "training_step did not run the pipeline: under PipelineStrategy it must get its loss from "
                "`self.compute_loss(batch)` (the schedule's forward and backward run there)."
            )
        pending = self.dp_handoff.hand_over(self.parameters, self._pending_grads)
        factor = self._grad_factor
        summed, tie_of = self.grads.finish_early_ties(), self.grads.tie_of
        for p, fresh in zip(self.parameters, pending):
            if fresh is None:
                continue
            if factor is not None:
                fresh.mul_(factor.to(fresh.dtype))
            if id(p) in tie_of:  # [Note: tied copies summed at the schedule's end] in parallel/grads.py
                self.grads.add_tied(p, fresh, id(p) in summed)
            elif p.grad is None:
                p.grad = fresh
            else:
                p.grad.add_(fresh)
        self._pending_grads = self._grad_factor = None

    def sync_gradients(self) -> None:
        """Before the optimizer step: average over replicas what is not averaged yet, sum tied copies."""
        self.grads.sync(replicas=not self.dp_handoff.grads_averaged)
        self.dp_handoff.synced()

    def set_microbatch_update(self, updater: Any) -> None:
        """PipeDream: each stage's update after every micro-batch's backward (``pipedream.stages.MicrobatchUpdate``)."""
        for stage in self.stages:
            stage.updater = updater

    def before_optimizer_step(self) -> None:
        """Called by the strategy after the gradient sync, right before the optimizer updates the weights: stages
        that keep weight versions stash the current ones ([Note: weight versions in a stage] in schedules/pipedream/stages.py)."""
        for stage in self.stages:
            stage.stash_live()
