"""The runtime of one rank: its stages, torch's schedule, and the requests of the module's ``compute_loss`` /
``compute_output``. A training step's life (prepare, run, finish) is in train_step.py; evaluation in evaluation.py.

[Note: shape inference has no side effects]
Torch's inference runs each stage for real, in the module's current mode: BatchNorm would update its running
statistics (later stages on stand-in inputs) and count a batch too many. The stages are
``_compat.GuardedPipelineStage``: each inference runs inside :meth:`PipelineEngine._inference_guard`, which restores
the stage module's buffers and the RNG state and keeps the inference's loss call out of the step's losses; stand-ins
are zeros, not ``torch.empty``. Parameters and gradients are untouched (torch computes input gradients only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe._compat import torch as _compat
from lightning_pipe.layers.stages import StageModule
from lightning_pipe.parallel.dp_handoff import DataParallelHandoff
from lightning_pipe.parallel.dp_overlap import DataParallelOverlap
from lightning_pipe.parallel.grads import GradientSync
from lightning_pipe.parallel.topology import ProcessGroups
from lightning_pipe.runtime.aux_step import AuxLossStep
from lightning_pipe.runtime.evaluation import broadcast_object, eval_loss, eval_loss_and_output, eval_output
from lightning_pipe.runtime.host_reads import LossKind
from lightning_pipe.runtime.rng import RankStreams
from lightning_pipe.runtime.shape_book import ShapeBook
from lightning_pipe.runtime.spec import SchedulePlan, build_torch_schedule
from lightning_pipe.runtime.stage import PipelineStage
from lightning_pipe.runtime.train_step import (
    MicrobatchLosses,
    StepHints,
    StepLoss,
    agree_loss,
    finish,
    prepare,
    run,
    schedule_loss,
)

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
        self.hints = StepHints()  # this training batch's, from the adapter (running)
        self.losses = MicrobatchLosses()  # what the schedule's loss reads and records in this step (train_step.py)
        self.loss_kind = LossKind()  # [Note: the loss kind is read once]
        self.shape_inferences = 0  # forward shape inferences run by this rank's stages
        self.inferring = False  # a shape inference or a meta forward runs: not one of the step's micro-batches
        self._pending_grads: list[Tensor | None] | None = None  # this batch's, until Lightning's backward
        self._grad_factor: Tensor | None = None  # token-weighted loss: applied to the fresh gradients on hand-over
        self._agreed: Tensor | None = None  # the step flags agreed with the loss; read once (take_agreed_flags)
        self.manual = False
        """The module optimizes manually: a training step may run several passes ([Note: manual optimization in a
        pipeline] in lightning/manual.py)."""
        self.step_outputs: Any = None  # compute_loss(return_outputs=True): [Note: a training step's outputs]
        # Deduplicated: a V schedule can put both ends of a tied weight on one rank (one object, two stages).
        self.parameters = list({id(p): p for sm in stage_modules for p in sm.parameters()}.values())
        self.grads = GradientSync(module, self.parameters, groups, device)
        self.dp_handoff = DataParallelHandoff(self._overlap(), plan.microbatches)
        # fp16 loss scaling, set by PipelinePrecision ([Note: fp16 loss scaling in a pipeline] in lightning/precision.py)
        self.loss_scaler: Callable[[Tensor], Tensor] | None = None
        self.owner = type(module).__name__
        self.aux = AuxLossStep(groups.pp, plan.pipeline_size, self.owner, plan.spec.name)  # [Note: auxiliary losses]
        # Context managers entered around every training schedule step (see lightning_pipe.trace.memory / trace).
        self.step_contexts: list[Callable[[], contextlib.AbstractContextManager]] = []
        # signatures whose evaluation output was checked ([Note: evaluation outputs are joined along dim 0])
        self.eval_checked: set[Any] = set()
        # [Note: re-inference on a new shape]; [Note: shapes without re-inference] in shapes.py
        self.shapes = ShapeBook(self.stages, self.schedule, plan.stage_to_rank, groups.pp, device, self._reset_shapes,
                                self._planning, self.owner, self._unplannable(plan), plan.spec.name,
                                together=groups.shard)
        for stage in self.stages:  # [Note: sends of the receiver's shape] in stage.py
            stage.expected_sends = self.shapes.expected_sends

    def _overlap(self) -> DataParallelOverlap | None:
        """The overlapped data-parallel sync ([Note: what the overlapped sync averages] in dp_handoff.py), where the
        engine averages replicas itself: PipeDream averages each micro-batch's gradients in its own update
        (pipedream.stages.MicrobatchUpdate), FSDP stages in their reduce-scatter ([Note: FSDP under the pipeline
        schedule] in fsdp.py), tensor-parallel and expert stages in the sync after the schedule."""
        groups = self.groups
        if (groups.dp is None or groups.shard is not None or groups.tensor is not None or groups.experts is not None
                or self.per_microbatch_updates):
            return None
        return DataParallelOverlap(self.stages, self.parameters, groups.dp)

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
        schedule = build_torch_schedule(self.plan, stages, partial(schedule_loss, self))
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
    def running(self, phase: str, batch_idx: int | None = None, hints: StepHints | None = None) -> Iterator[None]:
        """Set by the strategy around each Lightning step so compute_loss knows what to run; ``hints``: what
        Lightning's loop knows of a training batch (defaults: a batch that steps the optimizer, no flags)."""
        self.phase, self.batch_idx = phase, batch_idx
        self.hints = hints if hints is not None else StepHints()
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

    @contextlib.contextmanager
    def _inference_guard(self, stage_module: nn.Module, forward: bool) -> Iterator[None]:
        """Around each of torch's shape inferences: [Note: shape inference has no side effects]."""
        buffers = [(b, b.detach().clone()) for b in stage_module.buffers()]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.inferring = True
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
            self.inferring = False
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
                    f"{self.owner}.training_step called compute_loss again (batch_idx {self.batch_idx}) before "
                    "manual_backward of the loss the previous call returned. Rule: under PipelineStrategy each "
                    "compute_loss is a whole pass of the pipeline whose gradients wait for manual_backward; two "
                    "passes' gradients cannot be held at once. Call manual_backward(loss) after each compute_loss, "
                    "or compute both losses in one loss_fn.")
            if self.step_loss is not None and not self.manual:  # [Note: the loss a training step returns]
                raise RuntimeError(
                    f"{self.owner}.training_step called compute_loss a second time (batch_idx {self.batch_idx}). "
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

    # ------------------------------------------------------------------ training (train_step.py)
    def _train_step(self, module: PipelineModel, batch: Any, keep_outputs: bool = False) -> Tensor:
        """One training step: prepare, run, finish (runtime/train_step.py). Its gradients wait for Lightning's
        backward (:meth:`apply_pending_grads`), its agreed flags for the adapter (:meth:`take_agreed_flags`), its
        kept outputs (``keep_outputs``) reach every rank of the pipeline."""
        self._agreed = None
        inputs = prepare(self, module, batch, keep_outputs)
        run(self, inputs)
        result = finish(self, inputs)
        self._grad_factor, self._agreed = result.grad_factor, result.agreed_flags
        if keep_outputs:  # [Note: a training step's outputs] in step_outputs.py
            self.step_outputs = broadcast_object(self, self.losses.outputs.joined())
        return result.loss

    def run_schedule(self, args: tuple[Tensor, ...], target: Any) -> None:
        """One training step of the schedule over this batch (inputs where a first stage is, target at a last)."""
        self.schedule.step(*(args if self.has_first else ()), target=target if self.has_last else None,
                           **_compat.train_step_kwargs(self.schedule))  # [Note: no outputs kept by a training step]

    def reduce_loss(self, tie_payload: Tensor | None) -> StepLoss:
        """The step's loss on every rank (:func:`agree_loss`; a subclass with several pipelines reduces its own)."""
        return agree_loss(self, tie_payload)

    def _fresh_ties(self) -> dict[int, Tensor]:
        """This batch's gradient of every tied parameter, by ``id``; zeros (then pending like any other) where this
        rank's copy got none, so every rank's payload has the same layout."""
        pending, fresh = self._pending_grads, {}
        assert pending is not None  # set by train_step.finish right before
        for i, p in enumerate(self.parameters):
            if id(p) in self.grads.tie_of:
                grad = pending[i]
                if grad is None:
                    grad = pending[i] = torch.zeros_like(p)
                fresh[id(p)] = grad
        return fresh

    def _reset_shapes(self) -> None:
        _compat.reset_schedule_shapes(self.schedule)

    @contextlib.contextmanager
    def _planning(self) -> Iterator[None]:
        """Around a meta forward (shapes.py): layer timers and trace hooks see an inference, not a step's forward."""
        self.inferring = True
        try:
            yield
        finally:
            self.inferring = False

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
