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
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import PipelineConfig, Topology, config_error
from lightning_pipe.grads import GradientSync, ProcessGroups
from lightning_pipe.partition import layer_param_counts, partition_layers
from lightning_pipe.schedules import SchedulePlan, build_torch_schedule
from lightning_pipe.stages import (
    StageModule,
    TiedParameter,
    check_no_stray_parameters,
    find_layers,
    find_tied_parameters,
    localize_layers,
    materialize,
)


@dataclass(frozen=True)
class PipelineLayout:
    """How a module was cut: layer ranges per stage, the tied parameters, and the plan. Kept on the module so a
    later Trainer in the same process (validate after fit) reuses it: the other ranks' layers are gone."""

    ranges: tuple[range, ...]
    tied: tuple[TiedParameter, ...]
    plan: SchedulePlan


def _rows(inputs: Any) -> int:
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    if not isinstance(first, Tensor) or first.dim() == 0:
        raise TypeError(f"Pipeline inputs must be tensors with a batch dimension, got {type(first).__name__}")
    return first.shape[0]


def _pad_rows(x: Any, rows: int) -> Any:
    """Pad along dim 0 to ``rows`` by repeating the last row (values are discarded after the step)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_pad_rows(t, rows) for t in x)
    if not isinstance(x, Tensor) or x.shape[0] == rows:
        return x
    pad = x[-1:].expand(rows - x.shape[0], *x.shape[1:])
    return torch.cat([x, pad], dim=0)


def _trim_rows(x: Any, rows: int) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_trim_rows(t, rows) for t in x)
    return x[:rows] if isinstance(x, Tensor) else x


class PipelineEngine:
    """Owns this rank's stages and schedule; answers :class:`~lightning_pipe.PipelineModule`'s requests."""

    def __init__(self, module: nn.Module, stage_modules: list[StageModule], local_stage_ids: list[int],
                 plan: SchedulePlan, groups: ProcessGroups, device: torch.device) -> None:
        self.module = module
        self.plan = plan
        self.groups = groups
        self.device = device
        self.stage_modules = stage_modules
        self.stages = [
            PipelineStage(sm, s, plan.num_stages, device, group=groups.pp)
            for sm, s in zip(stage_modules, local_stage_ids)
        ]
        self.has_first = any(st.is_first for st in self.stages)
        self.has_last = any(st.is_last for st in self.stages)
        self.schedule = build_torch_schedule(plan, self.stages, self._schedule_loss)
        self.phase: str | None = None
        self.batch_idx: int | None = None
        self.accumulate_grad_batches = 1
        self._loss_scale = 1.0
        self._shape: tuple[str, int] | None = None  # (train|eval, micro-batch rows) torch last initialised for
        self._pending_grads: list[Tensor | None] | None = None
        # Deduplicated: a V schedule can put both ends of a tied weight on one rank (one object, two stages).
        self.parameters = list({id(p): p for sm in stage_modules for p in sm.parameters()}.values())
        self.grads = GradientSync(module, self.parameters, groups, device)
        # fp16 loss scaling, set by PipelinePrecision ([Note: fp16 loss scaling in a pipeline] in lightning/precision.py)
        self.loss_scaler: Callable[[Tensor], Tensor] | None = None
        self._raw_losses: list[Tensor] = []
        # Context managers entered around every training schedule step (see lightning_pipe.memory / trace).
        self.step_contexts: list[Callable[[], contextlib.AbstractContextManager]] = []

    # ------------------------------------------------------------------ phase plumbing
    @contextlib.contextmanager
    def running(self, phase: str, batch_idx: int | None = None) -> Iterator[None]:
        """Set by the strategy around each Lightning step so compute_loss knows what to run."""
        self.phase, self.batch_idx = phase, batch_idx
        try:
            yield
        finally:
            self.phase = None

    @property
    def last_pp_rank(self) -> int:
        return self.plan.stage_to_rank(self.plan.num_stages - 1)

    def _schedule_loss(self, output: Any, target: Any) -> Tensor:
        if self.phase != "train":
            # Forward-only passes still call the schedule's loss; we compute eval losses on merged outputs.
            return torch.zeros((), device=self.device)
        raw = self.module.loss_fn(output, target)
        self._raw_losses.append(raw.detach())
        scaled = raw * self._loss_scale  # [Note: loss scaling]
        return self.loss_scaler(scaled) if self.loss_scaler is not None else scaled

    # ------------------------------------------------------------------ requests from PipelineModule
    def loss(self, module: nn.Module, batch: Any) -> Tensor:
        if self.phase == "train":
            return self._train_step(module, batch)
        if self.phase in ("validate", "test", "predict"):
            return self._eval_loss(module, batch)
        raise RuntimeError(
            "compute_loss was called outside a Lightning step (training_step / validation_step / test_step). "
            "Under PipelineStrategy the model is split across ranks, so every rank must run the same step."
        )

    def output(self, module: nn.Module, batch: Any) -> Any:
        if self.phase == "train":
            raise RuntimeError("compute_output runs forward only; in training_step use compute_loss(batch).")
        inputs, _ = module.split_batch(batch)
        out = self._forward_only(inputs)
        return self._broadcast_object(out)

    # ------------------------------------------------------------------ training
    def _check_rows(self, rows: int, what: str) -> int:
        m = self.plan.microbatches
        if rows % m != 0:
            raise config_error(
                f"A {what} batch must split into equal micro-batches: its size must be divisible by the "
                "micro-batch count (and training needs every batch to be full: use drop_last=True).",
                f"batch size {rows} (batch_idx {self.batch_idx}), microbatches={m}", "batch_size",
                f"the batch size to a multiple of {m}", also=("microbatches",))
        return rows // m

    def _ensure_shape(self, mode: str, mb_rows: int) -> None:
        """Torch infers P2P buffer shapes once per train/eval switch; re-initialise when the row count changes."""
        if self._shape is not None and self._shape[0] == mode and self._shape[1] != mb_rows:
            _compat.reset_schedule_shapes(self.schedule)
        self._shape = (mode, mb_rows)

    def _step_args(self, inputs: Any) -> tuple:
        if not self.has_first:
            return ()
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    def _train_step(self, module: nn.Module, batch: Any) -> Tensor:
        inputs, target = module.split_batch(batch)
        if target is None:
            raise ValueError("Training under the pipeline needs a target: split_batch returned None for it.")
        self._ensure_shape("train", self._check_rows(_rows(inputs), "training"))
        self._loss_scale = 1.0 / (self.plan.microbatches * self.accumulate_grad_batches)
        # [Note: gradients across Lightning's zero_grad]: keep what earlier batches accumulated out of the way.
        saved = [p.grad for p in self.parameters]
        for p in self.parameters:
            p.grad = None
        self._raw_losses = []
        with contextlib.ExitStack() as stack:
            for make_context in self.step_contexts:  # measurement (memory meter, trace recorder), off by default
                stack.enter_context(make_context())
            self.schedule.step(*self._step_args(inputs), target=target if self.has_last else None)
        self._pending_grads = [p.grad for p in self.parameters]
        for p, g in zip(self.parameters, saved):
            p.grad = g
        if self.has_last:
            # The last m recorded losses are this step's (torch may call the loss once more while inferring shapes).
            m = self.plan.microbatches
            mean = torch.stack([loss.float() for loss in self._raw_losses[-m:]]).mean()
        else:
            mean = torch.zeros((), device=self.device)
        return self._broadcast_loss(mean)

    def apply_pending_grads(self) -> None:
        """Lightning's backward, in pipeline terms: add this batch's gradients to what survived zero_grad."""
        if self._pending_grads is None:
            raise RuntimeError(
                "training_step did not run the pipeline: under PipelineStrategy it must get its loss from "
                "`self.compute_loss(batch)` (the schedule's forward and backward run there)."
            )
        for p, fresh in zip(self.parameters, self._pending_grads):
            if fresh is None:
                continue
            if p.grad is None:
                p.grad = fresh
            else:
                p.grad.add_(fresh)
        self._pending_grads = None

    # ------------------------------------------------------------------ forward only
    def _forward_only(self, inputs: Any) -> Any:
        m = self.plan.microbatches
        rows = _rows(inputs)
        mb_rows = math.ceil(rows / m)
        if self._shape is not None and self._shape[0] == "eval" and self._shape[1] > mb_rows:
            mb_rows = self._shape[1]  # a short last batch: pad to the shape torch already knows
        padded = mb_rows * m
        self._ensure_shape("eval", mb_rows)
        # Lightning evaluates under inference_mode; torch's P2P buffers must stay ordinary tensors so that the
        # next training step can reuse them, so run under no_grad instead.
        with torch.inference_mode(False), torch.no_grad(), _compat.forward_only_actions(self.schedule):
            args = self._step_args(_pad_rows(inputs, padded))
            dummy_target = torch.zeros(padded, device=self.device) if self.has_last else None
            out = self.schedule.eval(*args, target=dummy_target)
        return _trim_rows(out, rows) if self.has_last else None

    def _eval_loss(self, module: nn.Module, batch: Any) -> Tensor:
        inputs, target = module.split_batch(batch)
        if target is None:
            raise ValueError("compute_loss needs a target, but split_batch returned None for it.")
        out = self._forward_only(inputs)
        if self.has_last:
            with torch.inference_mode(False), torch.no_grad():
                loss = module.loss_fn(out, target).detach().float()
        else:
            loss = torch.zeros((), device=self.device)
        return self._broadcast_loss(loss)

    # ------------------------------------------------------------------ communication helpers
    def _broadcast_loss(self, loss: Tensor) -> Tensor:
        """The loss exists on the last stage; loggers live on rank 0: give every rank the same value."""
        loss = loss.detach().to(self.device, torch.float32).reshape(())
        if self.plan.pipeline_size > 1:
            loss = loss.contiguous()
            dist.broadcast(loss, group=self.groups.pp, group_src=self.last_pp_rank)
        return loss

    def _broadcast_object(self, obj: Any) -> Any:
        if self.plan.pipeline_size == 1:
            return obj
        holder = [obj if self.has_last else None]
        if self.has_last and isinstance(obj, Tensor):
            holder = [obj.cpu()]
        dist.broadcast_object_list(holder, group=self.groups.pp, group_src=self.last_pp_rank,
                                   device=self.device if self.device.type == "cuda" else None)
        out = holder[0]
        return out.to(self.device) if isinstance(out, Tensor) else out


def build_engine(module: nn.Module, config: PipelineConfig, plan: SchedulePlan, topology: Topology,
                 device: torch.device, layout: PipelineLayout | None = None) -> tuple[PipelineEngine, PipelineLayout]:
    """Cut ``module``'s layer list for ``plan`` and build this rank's engine. Collective: every rank calls it.

    Other ranks' layers are replaced by placeholders (names kept); layers built on the meta device are allocated
    on ``device`` for this rank only; replicas and tied copies start identical. With ``layout`` (the module was
    already cut in this process) the same cut is reused and nothing is broadcast again.
    """
    layers = find_layers(module, config.layers_attr)
    fresh = layout is None
    if layout is None:
        check_no_stray_parameters(module, config.layers_attr)
        ranges = partition_layers(len(layers), plan.num_stages, config.partition, layer_param_counts(layers))
        layout = PipelineLayout(tuple(ranges), tuple(find_tied_parameters(module, config.layers_attr)), plan)
    elif layout.plan != plan:
        raise RuntimeError(
            f"{type(module).__name__} was already split for another pipeline ({layout.plan}); its other layers are "
            "gone from this rank. Build a new module (or load it from a checkpoint) to use a different layout."
        )
    local_ids = plan.stages_of_rank(topology.pp_rank)
    groups = ProcessGroups(topology, layout.tied, layout.ranges, plan)
    stage_modules = localize_layers(module, config.layers_attr, layout.ranges, local_ids, plan.stage_to_rank,
                                    config.recompute_every)
    # Layers built on the meta device (configure_model) are allocated now, on this rank only.
    materialize(module, config.layers_attr, stage_modules, layout.tied, device)
    module.to(device)
    engine = PipelineEngine(module, stage_modules, local_ids, plan, groups, device)
    if fresh:
        engine.grads.broadcast_initial_state(
            [t for sm in stage_modules for t in list(sm.parameters()) + list(sm.buffers())])
    return engine, layout
