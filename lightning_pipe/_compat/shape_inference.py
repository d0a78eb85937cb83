"""Torch's shape inference for pipeline stages, per release, without side effects; and how to make it run again.

Torch's ``PipelineStage`` learns its P2P buffer shapes by running the stage; :class:`GuardedPipelineStage` runs
that inside the engine's guard and on zero-filled stand-ins, and :func:`reset_schedule_shapes` makes the next step
infer again. Both override or reset private names that differ from release to release (listed below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining import stage as _torch_stage

from lightning_pipe._compat.torch_release import PRIVATE_TORCH_API, TORCH_VERSION, _module, _resolve

PRIVATE_TORCH_STATE: tuple[str, ...] = ()
"""Private *instance state* of torch's objects that this torch needs us to read or reset (per release)."""

# [Note: shape inference has no side effects] (engine.py). Torch's PipelineStage learns its P2P shapes by running
# the stage for real, in the module's current train/eval mode, and the schedule calls it whenever its "initialized"
# flags are down (first step, train/eval switch, reset_schedule_shapes). Two generations of that code exist:
# * torch >= 2.12 (METADATA_INFERENCE): ``_forward_metadata_inference`` (a forward on the first micro-batch's
#   inputs or on stand-ins made by ``_to_tensor``) and ``_backward_metadata_inference`` (the loss on the last stage
#   and input gradients); stand-ins are ``torch.empty``, which we zero.
# * torch 2.11: ``_shape_inference``, a forward only (under no_grad, on zero-filled stand-ins), run once per stage
#   while ``inputs_meta`` is unset; nothing re-runs it, so ``reset_schedule_shapes`` also clears what it set.
_STAGE_WHERE = "torch.distributed.pipelining.PipelineStage"
_PipelineStage = _resolve(_module("torch.distributed.pipelining"), "PipelineStage",
                          "torch.distributed.pipelining")
METADATA_INFERENCE = hasattr(_PipelineStage, "_forward_metadata_inference")
# torch >= 2.15: the public ``register_forward_context`` runs a context around every stage forward, metadata
# inference included (``PipelineStageInfo.is_metadata_inference``): the forward guard needs no private override.
FORWARD_CONTEXT = callable(getattr(_PipelineStage, "register_forward_context", None))
_INFERENCE_NAMES = ((() if FORWARD_CONTEXT else ("_forward_metadata_inference",))
                    + ("_backward_metadata_inference", "_to_tensor") if METADATA_INFERENCE else ("_shape_inference",))
_STAGE_INFERENCE_API = {f"PipelineStage.{name}": _resolve(_PipelineStage, name, _STAGE_WHERE)
                        for name in _INFERENCE_NAMES}
_batchnorm = _module("torch.nn.modules.batchnorm")
BatchNormBase = _resolve(_batchnorm, "_BatchNorm", _batchnorm.__name__)
"""The base of every BatchNorm flavour (1d/2d/3d, lazy, SyncBatchNorm)."""
PRIVATE_TORCH_API.update({**_STAGE_INFERENCE_API, "_BatchNorm": BatchNormBase})

# torch 2.11 and 2.12 refuse to send "no gradient" for a received stage input that got none (an attention mask,
# position ids: "... has gradients None and is expecting to send gradients"); 2.13 sends zeros, which is the exact
# gradient of an input the stage's output does not depend on. Before 2.13 we send the zeros.
_ZERO_FILL_MISSING_INPUT_GRADS = TORCH_VERSION < (2, 13)
if _ZERO_FILL_MISSING_INPUT_GRADS:
    PRIVATE_TORCH_STATE += ("PipelineStage.bwd_cache", "PipelineStage.args_recv_info",
                            "PipelineStage.grad_send_info", "PipelineStage._create_grad_send_info")
    if METADATA_INFERENCE:
        PRIVATE_TORCH_STATE += ("PipelineStage._stage_meta.inputs",)
    _RecvInfo = _resolve(_torch_stage, "_RecvInfo", "torch.distributed.pipelining.stage")
    PRIVATE_TORCH_API["_RecvInfo"] = _RecvInfo
if not METADATA_INFERENCE:
    PRIVATE_TORCH_API.update({f"PipelineStage.{name}": _resolve(_PipelineStage, name, _STAGE_WHERE)
                              for name in ("_prepare_forward_infra", "_get_init_p2p_neighbors_ops")})

InferenceGuard = Callable[[torch.nn.Module, bool], contextlib.AbstractContextManager]
"""``guard(stage_module, forward)``: entered around each shape inference of a stage (``forward``: the forward one)."""


class GuardedPipelineStage(_PipelineStage):  # type: ignore[misc, valid-type]
    """torch's ``PipelineStage`` whose shape inference runs inside ``inference_guard`` and on zero-filled stand-ins.

    Torch (>= 2.12) makes a later stage's stand-in inputs with ``torch.empty``: garbage values (NaN, 1e34,
    out-of-range indices for integer inputs such as position ids) that can crash a layer. Zeros have the same shapes
    and dtypes (torch 2.11 already uses zeros).
    """

    def __init__(self, *args: Any, inference_guard: InferenceGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inference_guard = inference_guard
        if FORWARD_CONTEXT:
            self.register_forward_context(self._forward_context)

    def _forward_context(self, info: Any) -> contextlib.AbstractContextManager:
        """torch >= 2.15: entered around every forward of this stage; guards the metadata-inference one."""
        if info.is_metadata_inference:
            return self._inference_guard(self.submod, True)
        return contextlib.nullcontext()

    if METADATA_INFERENCE and not FORWARD_CONTEXT:
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with self._inference_guard(self.submod, True):
                return super()._forward_metadata_inference(*args, **kwargs)

    if METADATA_INFERENCE:
        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with self._inference_guard(self.submod, False):
                return super()._backward_metadata_inference(*args, **kwargs)

        def _to_tensor(self, arg: Any) -> torch.Tensor:
            tensor = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor) and type(tensor) in (torch.Tensor, torch.nn.Parameter):
                with torch.no_grad():
                    tensor.zero_()
            return tensor
    else:
        def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
            with self._inference_guard(self.submod, True):
                return super()._shape_inference(*args, **kwargs)

        def _prepare_forward_infra(self, num_microbatches: int, *args: Any, **kwargs: Any) -> Any:
            # torch 2.11 marks every receive buffer requires_grad, integer ones (position ids, masks) included,
            # which torch refuses; later releases mark floating-point buffers only. So do we.
            has_backward, self.has_backward = self.has_backward, False  # type: ignore[has-type]
            try:
                out = super()._prepare_forward_infra(num_microbatches, *args, **kwargs)
            finally:
                self.has_backward = has_backward
            if has_backward:
                for infos in self.args_recv_info.values():
                    for info in infos:
                        if isinstance(info, _RecvInfo) and info.buffer.is_floating_point():
                            info.buffer.requires_grad_(True)
            return out

        def _get_init_p2p_neighbors_ops(self) -> list[Any]:
            # torch 2.11 warms up P2P with each neighbouring stage, one held by this rank too (V placement, pipeline
            # size 1), and gloo cannot send to itself; a stage on the same rank needs no warm-up (both sides drop it).
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    if _ZERO_FILL_MISSING_INPUT_GRADS:
        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
            if self.has_backward and not self.is_first and bwd_chunk_id in self.bwd_cache:
                if self.grad_send_info is None:  # type: ignore[has-type]  # torch creates it lazily, on the first send
                    self.grad_send_info = self._create_grad_send_info(self.args_recv_info[0])
                infos, sends = self.args_recv_info[bwd_chunk_id], list(self.grad_send_info or ())
                grads = list(self.bwd_cache[bwd_chunk_id])
                for i, (grad, dst, info) in enumerate(zip(grads, sends, infos, strict=True)):
                    if grad is None and dst is not None and isinstance(info, _RecvInfo):
                        if _receiver_has_buffer(self, i):
                            grads[i] = torch.zeros_like(info.buffer)
                        else:  # 2.12: the sender of an input that needs no gradient posts no receive for one
                            sends[i] = None
                self.bwd_cache[bwd_chunk_id], self.grad_send_info = tuple(grads), sends
            return super().get_bwd_send_ops(bwd_chunk_id)


def _receiver_has_buffer(stage: Any, index: int) -> bool:
    """Whether the stage that sent input ``index`` posts a receive for its gradient: torch 2.11 always does; 2.12
    only for an output that requires grad (as recorded in the metadata this stage received)."""
    if not METADATA_INFERENCE:
        return True
    metas = stage._stage_meta.inputs
    return metas is None or index >= len(metas) or metas[index] is None or bool(metas[index].requires_grad)


def _forget_inferred_shapes(stage: Any) -> None:
    """torch 2.11: clear what ``_shape_inference`` / ``_prepare_*_infra`` set, so the next step infers again."""
    stage.inputs_meta = None
    stage._outputs_meta = None
    stage.args_recv_info.clear()
    stage.act_send_info.clear()
    stage.grad_recv_info.clear()
    stage.grad_send_info = None


if not METADATA_INFERENCE:
    PRIVATE_TORCH_STATE += tuple(f"PipelineStage.{n}" for n in (
        "inputs_meta", "_outputs_meta", "args_recv_info", "act_send_info", "grad_recv_info", "grad_send_info"))
    PRIVATE_TORCH_STATE += ("PipelineScheduleSingle._stage", "PipelineScheduleMulti._stages")  # schedule_stages


# --------------------------------------------------------------------------- re-inference on the next step
# Names of the private flags by which torch's schedules remember that P2P buffer shapes were inferred.
_SINGLE_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized")
_MULTI_FLAGS = ("_stages_forward_initialized", "_stages_backward_initialized")


def schedule_flags(schedule: Any) -> tuple[str, str]:
    """The names of ``schedule``'s private flags that say its stages' shapes were inferred (forward, backward)."""
    if isinstance(schedule, _torch_schedules.PipelineScheduleSingle):
        return _SINGLE_FLAGS
    if isinstance(schedule, _torch_schedules.PipelineScheduleMulti):
        return _MULTI_FLAGS
    raise TypeError(f"Unknown schedule type {type(schedule).__name__}")


def reset_schedule_shapes(schedule: Any) -> None:
    """Make torch re-infer the stages' P2P buffer shapes on the next step (the micro-batch size changed).

    Torch infers shapes once and only re-infers on a train/eval switch; a batch of another size would otherwise be
    received into buffers of the old size.
    """
    for flag in schedule_flags(schedule):
        if not hasattr(schedule, flag):
            raise RuntimeError(
                f"torch {torch.__version__}: {type(schedule).__name__} has no attribute {flag!r}; "
                "lightning_pipe._compat.reset_schedule_shapes needs updating for this torch version."
            )
        setattr(schedule, flag, False)
    if not METADATA_INFERENCE:
        for stage in schedule_stages(schedule):
            if isinstance(stage, _PipelineStage):
                _forget_inferred_shapes(stage)


def schedule_stages(schedule: Any) -> list[Any]:
    """This rank's stages of a torch schedule (one for a single-stage schedule)."""
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]
