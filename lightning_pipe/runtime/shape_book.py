"""What this rank's torch stages are shaped for, and how a batch of another shape gets there: the signature torch
inferred, the inferred states of the other structures seen (train / eval), and this step's planned shapes.

The engine's one entry is :meth:`ShapeBook.use` before each schedule call ([Note: re-inference on a new shape]
below, [Note: shapes without re-inference] in shapes.py).

[Note: re-inference on a new shape]
Torch sizes its P2P receive buffers by shape inference on the first step and again only on a train/eval switch; a
batch of another shape would land in the old buffers (wrong outputs in evaluation, a crash in training). The engine
keys what torch last inferred by the batch's :class:`Signature` and makes torch infer again when it changes; the
ranks of a pipeline read the same batch, so they agree. With a shape planner ([Note: shapes without re-inference]
in shapes.py) the key is the signature's *structure* (mode, each tensor's rank, dtype and requires_grad): a new
length costs no inference, only planned shapes. Without one (torch 2.11, FSDP / tensor-parallel stages, a forward
that does not run on meta tensors) the key holds every shape, and a new shape costs about one micro-batch's forward
and backward per stage (docs/module-contract.md).

FSDP shards read different batches, so their signatures change at different steps, but an inference forward
gathers the stage's parameters over the shards (a collective): a shard that infers alone waits forever in that
gather while its peers run their step. So with FSDP stages the shards agree whether any of them re-infers (one MAX
all-reduce of a flag and its host read before each schedule call), and then all do, each with its own shapes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe._compat import stage_shapes as _stage_shapes
from lightning_pipe.config import PipelineConfigError, config_error
from lightning_pipe.layers.batches import Signature
from lightning_pipe.runtime.shapes import PlanFailed, ShapePlanner, StageShapes, TensorsAt

_MAX_STATES = 8  # inferred states kept for other structures (train and eval of a few input layouts)


class ShapeBook:
    """Keys torch's inferred state by signature and plans each step's shapes where it can."""

    def __init__(self, stages: list[Any], schedule: Any, stage_to_rank: Callable[[int], int], group: Any,
                 device: torch.device, reset: Callable[[], None],
                 guard: Callable[[], contextlib.AbstractContextManager], owner: str,
                 unplannable: tuple[str, tuple[str, ...]] | None, schedule_name: str = "",
                 together: Any = None) -> None:
        """``unplannable``: why this layout cannot plan shapes and the settings that decide it (None: it can).
        ``together``: the group whose ranks re-infer together (FSDP shards: [Note: re-inference on a new shape])."""
        self.stages, self.schedule, self.device, self._reset, self._owner = stages, schedule, device, reset, owner
        self._together = together
        self.signature: Signature | None = None  # what torch last inferred shapes for
        self.planner: ShapePlanner | None = None  # None: every new shape re-infers
        self.planned: dict[int, StageShapes] | None = None  # this step's shapes, applied after torch's init
        self._states: dict[Signature, Any] = {}
        self.why_not, self.settings = unplannable or ("", ())
        if unplannable is None and _stage_shapes.after_initialize(schedule, self.apply):
            self.planner = ShapePlanner(stages, stage_to_rank, group, device, guard)
        elif unplannable is None and not _stage_shapes.SUPPORTED:
            self.why_not, self.settings = (f"torch {torch.__version__} (planned shapes need torch >= 2.12)", ())
        elif unplannable is None:
            self.why_not = f"schedule {schedule_name!r}, which runs its own schedule class"
            self.settings = ("schedule",)

    def use(self, sig: Signature, inputs: list[TensorsAt], explicit: bool) -> None:
        """Before a schedule call: plan this batch's shapes (``inputs``: each micro-batch's first-stage inputs) and
        key torch's state by the structure, or, without a planner, by the whole signature. ``explicit``: the
        micro-batches differ in shape (trim_microbatch), which only a planner can run."""
        self.planned = None
        key = sig
        if self.planner is not None:
            try:
                self.planned = self.planner.plan(sig.structure(), inputs)
                key = sig.structure()
            except PlanFailed as err:  # the same on every rank of the pipeline (shapes.py)
                self.planner, self.why_not = None, str(err)
                if not explicit:
                    warnings.warn(f"lightning_pipe: shapes cannot be planned ({err}); from now on every new batch "
                                  "shape re-runs torch's shape inference ([Note: shapes without re-inference]).",
                                  stacklevel=3)
        if explicit and self.planner is None:
            rule = (f"{self._owner}.trim_microbatch gave micro-batches of different shapes, which needs planned "
                    "shapes ([Note: shapes without re-inference]): torch >= 2.12, no FSDP or tensor-parallel stages, "
                    "a schedule on torch's runtime without per-micro-batch updates, and stage forwards that run on "
                    "meta tensors.")
            fix = "Return the micro-batches unchanged from trim_microbatch (one shape per batch), or remove the hook"
            if self.settings:
                raise config_error(rule, self.why_not, self.settings[0], also=self.settings[1:], fix=fix)
            raise PipelineConfigError(f"{rule} Not here: {self.why_not}. {fix}.")
        self._switch(key)

    def _switch(self, key: Signature) -> None:
        """[Note: re-inference on a new shape]: torch infers again when the key changes, unless the planner kept
        torch's state for this key (a train <-> eval switch)."""
        changed = key != self.signature
        if self._together is not None and self.signature is not None and self.planner is None:
            flag = torch.tensor([1.0 if changed else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._together)
            changed = bool(flag.item() > 0)  # before the schedule: the shards' steps must match
        if not changed:
            return
        if self.signature is not None:
            if self.planner is None:
                self._reset()
            else:
                if len(self._states) < _MAX_STATES:
                    self._states[self.signature] = _stage_shapes.inferred_state(self.schedule)
                known = self._states.pop(key, None)
                if known is not None:
                    _stage_shapes.restore_inferred_state(self.schedule, known)
                else:
                    self._reset()
        self.signature = key

    def expected_sends(self, stage: Any, microbatch: int) -> list[tuple[int, ...] | None] | None:
        """The shapes the next stage receives ``stage``'s outputs of ``microbatch`` into (per output), or ``None``
        where unknown: this step's planned shapes, or torch's inferred ones (re-inferred per signature without a
        planner). The receiver's buffer has that shape: [Note: sends of the receiver's shape] in runtime/stage.py."""
        if self.planned is not None:
            shapes = self.planned.get(stage.stage_index)
            if shapes is None or microbatch >= len(shapes.outputs):
                return None
            return [tuple(t[0]) for t in shapes.outputs[microbatch]]
        if self.planner is not None:
            return None
        return _stage_shapes.inferred_output_shapes(stage)

    def apply(self) -> None:
        """Right after torch's stage initialisation in each step: this step's shapes into the receive descriptors."""
        planned = self.planned
        if planned is None:
            return
        for stage in self.stages:
            shapes = planned.get(stage.stage_index)
            if shapes is None:
                continue
            if not stage.is_first:
                for mb, tensors in enumerate(shapes.inputs):
                    _stage_shapes.set_receive_shapes(stage.args_recv_info.get(mb), [t[0] for t in tensors],
                                                     self.device)
            if stage.has_backward and not stage.is_last:  # gradients have their activations' shapes
                for mb, tensors in enumerate(shapes.outputs):
                    _stage_shapes.set_receive_shapes(stage.grad_recv_info.get(mb), [t[0] for t in tensors],
                                                     self.device)
