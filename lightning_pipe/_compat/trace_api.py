"""The torch names the execution trace wraps (``lightning_pipe.trace``), checked at import, and the swaps of the
private ones for one recorded step.

[Note: how the trace is recorded] in trace/recorder.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining import stage as _torch_stage

from lightning_pipe._compat.torch_release import CHECKED_TORCH, _resolve

_WHERE = "torch.distributed.pipelining.schedules"

# [Note: how the trace is recorded] in trace/recorder.py: while a step is recorded, these torch names are wrapped on this rank's
# own stage and schedule objects (instance attributes) and, for the two module functions, in torch's schedules module;
# all are restored when the step ends. Checked on torch 2.13 for PipelineScheduleSingle (GPipe, 1F1B) and the
# _PipelineScheduleRuntime family, which all reach compute and P2P through exactly these names.
TRACE_TORCH_API = {
    "_PipelineStageBase.forward_one_chunk": ("stage", "forward_one_chunk"),
    "_PipelineStageBase.backward_one_chunk": ("stage", "backward_one_chunk"),
    "_PipelineStageBase.backward_weight_one_chunk": ("stage", "backward_weight_one_chunk"),
    "_PipelineStageBase.get_fwd_send_ops": ("stage", "get_fwd_send_ops"),
    "_PipelineStageBase.get_fwd_recv_ops": ("stage", "get_fwd_recv_ops"),
    "_PipelineStageBase.get_bwd_send_ops": ("stage", "get_bwd_send_ops"),
    "_PipelineStageBase.get_bwd_recv_ops": ("stage", "get_bwd_recv_ops"),
    "_PipelineSchedule._compute_loss": ("schedule", "_compute_loss"),
    "schedules._batch_p2p": ("module", "_batch_p2p"),
    "schedules._wait_batch_p2p": ("module", "_wait_batch_p2p"),
}


TRACE_OWNERS = {"stage": _resolve(_torch_stage, "_PipelineStageBase", "torch.distributed.pipelining.stage"),
                "schedule": _resolve(_torch_schedules, "_PipelineSchedule", _WHERE), "module": _torch_schedules}


def missing_trace_api() -> list[str]:
    """The names of ``TRACE_TORCH_API`` this torch lacks (empty when recording can work)."""
    return [key for key, (owner, attr) in TRACE_TORCH_API.items()
            if not callable(getattr(TRACE_OWNERS[owner], attr, None))]


if missing_trace_api():
    raise ImportError(
        f"torch {torch.__version__} lacks {missing_trace_api()}, which lightning_pipe.trace wraps to record what a "
        f"pipeline step ran (checked on torch {CHECKED_TORCH}). Update TRACE_TORCH_API in "
        "lightning_pipe/_compat/trace_api.py and lightning_pipe/trace/recorder.py."
    )


# ------------------------------------------------------------------ the trace recorder's swaps (TRACE_TORCH_API)
# [Note: how the trace is recorded] (lightning_pipe/trace/recorder.py). The recorder replaces, for one recorded step,
# torch's module-level P2P functions and a schedule's loss method; both are private, so the swaps live here and the
# recorder names neither. Each swap is undone when its context exits, even on an error.
_P2P_BATCH, _P2P_WAIT = TRACE_TORCH_API["schedules._batch_p2p"][1], TRACE_TORCH_API["schedules._wait_batch_p2p"][1]
_LOSS = TRACE_TORCH_API["_PipelineSchedule._compute_loss"][1]


@contextlib.contextmanager
def swapped_p2p(wrap_batch: Callable[[Callable[..., Any]], Callable[..., Any]],
                wrap_wait: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the context torch's ``_batch_p2p`` and ``_wait_batch_p2p`` are ``wrap_batch(original)`` and
    ``wrap_wait(original)``; the originals are put back on exit. Torch >= 2.14's ``_batch_p2p`` calls itself through
    the module's name (once per process group), so the wrapper also sees those nested calls."""
    module = TRACE_OWNERS["module"]
    original_batch, original_wait = getattr(module, _P2P_BATCH), getattr(module, _P2P_WAIT)
    setattr(module, _P2P_BATCH, wrap_batch(original_batch))
    setattr(module, _P2P_WAIT, wrap_wait(original_wait))
    try:
        yield
    finally:
        setattr(module, _P2P_BATCH, original_batch)
        setattr(module, _P2P_WAIT, original_wait)


@contextlib.contextmanager
def swapped_compute_loss(schedule: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the context ``schedule``'s ``_compute_loss`` is ``wrap(original)``, set on the instance only; on exit
    the instance is as it was (the attribute removed again when the instance had none of its own)."""
    had = _LOSS in vars(schedule)
    old = vars(schedule).get(_LOSS)
    setattr(schedule, _LOSS, wrap(getattr(schedule, _LOSS)))
    try:
        yield
    finally:
        if had:
            setattr(schedule, _LOSS, old)
        else:
            delattr(schedule, _LOSS)
