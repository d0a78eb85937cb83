"""Torch's per-micro-batch receive descriptors, rewritten to new shapes ([Note: shapes without re-inference] in
lightning_pipe/runtime/shapes.py), and the hook that runs right after torch's stage initialisation in every step.

What holds a shape, per release (read from each release's ``stage.py``):

* torch 2.12 - 2.14: ``stage.args_recv_info[mb]`` / ``stage.grad_recv_info[mb]`` are tuples of ``_RecvInfo`` whose
  ``tensor_meta`` (a frozen ``_TensorMeta``: shape, stride, dtype, requires_grad) describes the tensor and whose
  ``buffer`` is the tensor received into, allocated once at inference and reused every step;
* torch 2.15: the same descriptors, but ``buffer`` is allocated from ``tensor_meta`` right before each receive
  (``_RecvInfo.allocate_buffer``) and is ``None`` between steps;
* torch >= 2.13 sends zeros for an input that got no gradient, shaped by ``_get_grad_send_meta(input_idx)`` from
  the stage-wide ``_stage_meta`` (not per micro-batch): :class:`ChunkShapes` answers it from the micro-batch's own
  descriptor;
* torch 2.11 keeps shapes in ``inputs_meta`` / ``_outputs_meta`` and checks outputs against them: not rewritten
  (:data:`SUPPORTED` is False; a new shape re-infers there).

Anything else a stage keeps (``act_send_info``, ``grad_send_info``, ``_stage_meta``) holds stage indices, counts
and dtypes, which a shape change leaves alone; runtime validation against ``_stage_meta`` runs only under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining import stage as _torch_stage

from lightning_pipe._compat.shape_inference import METADATA_INFERENCE, schedule_flags, schedule_stages
from lightning_pipe._compat.torch_release import TORCH_VERSION

SUPPORTED = METADATA_INFERENCE
"""Whether this torch's receive descriptors can be rewritten (2.12 and later)."""
_RecvInfo = getattr(_torch_stage, "_RecvInfo", None)
if _RecvInfo is None and SUPPORTED:  # 2.15 moved it to _recv_buffers.py and imports it into stage.py
    raise ImportError(f"torch {torch.__version__}: no torch.distributed.pipelining.stage._RecvInfo; update "
                      "lightning_pipe/_compat/stage_shapes.py.")
_PERSISTENT_BUFFERS = TORCH_VERSION < (2, 15)  # 2.15 allocates each receive's buffer from tensor_meta
_GRAD_SEND_META = hasattr(_torch_stage._PipelineStageBase, "_get_grad_send_meta")
_INIT_NAMES = {_torch_schedules.PipelineScheduleMulti: "_initialize_stages",
               _torch_schedules.PipelineScheduleSingle: "_initialize_stage"}

PRIVATE_NAMES = ("_RecvInfo", "_RecvInfo.tensor_meta", "_RecvInfo.buffer", "PipelineStage.args_recv_info",
                 "PipelineStage.grad_recv_info", "PipelineScheduleSingle._initialize_stage",
                 "PipelineScheduleMulti._initialize_stages", "_PipelineSchedule._split_inputs",
                 "_PipelineSchedule._merge_outputs") + (("PipelineStage._get_grad_send_meta",) if _GRAD_SEND_META else ())
"""The private torch names this module reads or replaces (tests/unit/test_shapes.py checks them)."""


def after_initialize(schedule: Any, hook: Callable[[], None]) -> bool:
    """Run ``hook()`` right after the schedule's ``_initialize_stage(s)``, which every torch schedule calls at the
    start of every step (a no-op once its shapes are inferred); returns False where that is not so (another
    runtime, torch 2.11)."""
    if not SUPPORTED:
        return False
    name = next((n for cls, n in _INIT_NAMES.items() if isinstance(schedule, cls)), None)
    if name is None or not callable(getattr(schedule, name, None)):
        return False
    original = getattr(schedule, name)

    def initialize(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        hook()
        return out

    setattr(schedule, name, initialize)
    return True


def set_receive_shapes(infos: Sequence[Any] | None, shapes: Sequence[tuple[int, ...]], device: torch.device) -> None:
    """Give one micro-batch's receive descriptors (``args_recv_info[mb]`` or ``grad_recv_info[mb]``) these shapes,
    one per tensor in order; descriptors of root inputs and of absent gradients are left alone."""
    if infos is None:
        return
    if len(infos) != len(shapes):
        raise RuntimeError(f"torch {torch.__version__}: {len(infos)} receive descriptors for {len(shapes)} planned "
                           "tensors; lightning_pipe/_compat/stage_shapes.py needs updating.")
    for info, shape in zip(infos, shapes):
        if not isinstance(info, _RecvInfo) or info.is_root_arg or info.tensor_meta is None:  # type: ignore[arg-type]
            continue
        meta = info.tensor_meta
        if tuple(meta.shape) == tuple(shape):
            continue
        size = torch.Size(shape)
        info.tensor_meta = dataclasses.replace(meta, shape=size, stride=_contiguous_strides(size))
        if _PERSISTENT_BUFFERS and info.buffer is not None:
            old = info.buffer
            info.buffer = torch.empty(size, dtype=old.dtype, device=device).requires_grad_(old.requires_grad)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def replace_split(schedule: Any, split: Callable[..., tuple[list[Any], list[dict[str, Any]]]],
                  merge: Callable[[list[Any]], Any] | None = None) -> None:
    """Make ``schedule`` cut a batch with ``split(args, kwargs=None) -> (args per micro-batch, kwargs per
    micro-batch)`` (torch's ``_split_inputs``) and, with ``merge``, join the last stage's outputs with
    ``merge(chunks)`` (``_merge_outputs``); instance attributes, removed by :func:`restore_split`."""
    schedule._split_inputs = split
    if merge is not None:
        schedule._merge_outputs = merge


def restore_split(schedule: Any) -> None:
    """Undo :func:`replace_split`: the schedule's own cut and join again."""
    for name in ("_split_inputs", "_merge_outputs"):
        schedule.__dict__.pop(name, None)


class ChunkShapes:
    """Mixed into the stage: the zero gradient torch >= 2.13 sends for an input that got none takes the shape of
    *that* micro-batch's input (``_get_grad_send_meta`` reads the stage-wide metadata otherwise)."""

    _send_chunk: int | None = None

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        self._send_chunk = bwd_chunk_id
        try:
            return super().get_bwd_send_ops(bwd_chunk_id)  # type: ignore[misc]
        finally:
            self._send_chunk = None

    if _GRAD_SEND_META:
        def _get_grad_send_meta(self, input_idx: int) -> Any:
            meta = super()._get_grad_send_meta(input_idx)  # type: ignore[misc]
            infos = self.args_recv_info.get(self._send_chunk) if self._send_chunk is not None else None  # type: ignore[attr-defined]
            own = getattr(infos[input_idx], "tensor_meta", None) if infos and input_idx < len(infos) else None
            if meta is None or own is None or tuple(own.shape) == tuple(meta.shape):
                return meta
            return dataclasses.replace(meta, shape=own.shape, stride=own.stride)


def inferred_output_shapes(stage: Any) -> list[tuple[int, ...] | None] | None:
    """The shapes torch inferred for ``stage``'s outputs (per output; ``None`` for a non-tensor), or ``None`` where
    it holds none: torch 2.12+ keeps them in ``_stage_meta.outputs`` (local shapes, as sent); torch 2.11 checks its
    outputs against ``_outputs_meta`` itself."""
    meta = getattr(getattr(stage, "_stage_meta", None), "outputs", None)
    if not SUPPORTED or meta is None:
        return None
    return [tuple(m.shape) if m is not None and hasattr(m, "shape") else None for m in meta]


# ------------------------------------------------------------------ torch's inferred state, kept per structure
# [Note: shapes without re-inference]: a train <-> eval switch makes torch re-infer (receive buffers that need a
# gradient or not, backward descriptors or none); the engine keeps each structure's inferred state and puts it back
# instead. Torch refills the stage's dicts and ``_StageMeta`` in place when it re-infers, so they are copied.
_STAGE_STATE = ("args_recv_info", "act_send_info", "grad_recv_info", "grad_send_info", "_stage_meta", "chunks")


def inferred_state(schedule: Any) -> Any:
    """What torch inferred for the current structure: the schedule's flags and each stage's descriptors."""
    flags = schedule_flags(schedule)
    stages = [{name: copy.copy(getattr(st, name)) for name in _STAGE_STATE if hasattr(st, name)}
              for st in schedule_stages(schedule)]
    return {name: getattr(schedule, name) for name in flags}, stages


def restore_inferred_state(schedule: Any, state: Any) -> None:
    """Put back what :func:`inferred_state` took: the next step runs no inference."""
    flags, stages = state
    for name, value in flags.items():
        setattr(schedule, name, value)
    for st, saved in zip(schedule_stages(schedule), stages, strict=True):
        for name, value in saved.items():
            setattr(st, name, copy.copy(value))
