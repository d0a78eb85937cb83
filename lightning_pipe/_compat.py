"""Every private torch / Lightning API lightning_pipe touches, in one place, with the versions it was checked on.

If one of these moves, ``tests/unit/test_compat.py`` fails loudly naming the attribute, instead of a training run
failing obscurely (or silently computing something else).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import lightning
import torch
from torch.distributed.pipelining import schedules as _torch_schedules

CHECKED_TORCH = ("2.13",)
CHECKED_LIGHTNING = ("2.6",)

# Names of the private flags by which torch's schedules remember that P2P buffer shapes were inferred.
_SINGLE_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized")
_MULTI_FLAGS = ("_stages_forward_initialized", "_stages_backward_initialized")

# Private pieces used for custom action-list schedules (issue: custom schedules).
PipelineScheduleRuntime = getattr(_torch_schedules, "_PipelineScheduleRuntime", None)
Action = getattr(_torch_schedules, "_Action", None)
ComputationType = getattr(_torch_schedules, "_ComputationType", None)


def versions_checked() -> dict[str, bool]:
    """Whether the installed torch / Lightning are versions this module was verified against."""
    return {
        "torch": torch.__version__.startswith(CHECKED_TORCH),
        "lightning": lightning.__version__.startswith(CHECKED_LIGHTNING),
    }


def _flags(schedule: Any) -> tuple[str, str]:
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
    for flag in _flags(schedule):
        if not hasattr(schedule, flag):
            raise RuntimeError(
                f"torch {torch.__version__}: {type(schedule).__name__} has no attribute {flag!r}; "
                "lightning_pipe._compat.reset_schedule_shapes needs updating for this torch version."
            )
        setattr(schedule, flag, False)


# --------------------------------------------------------------------------- forward-only runs of action-list schedules
# [Note: forward-only action lists]
# ``schedule.eval()`` runs the training action list with ``has_backward=False``; each backward action is expected to
# be a no-op. That holds across ranks (the stage skips backward compute and sends/receives nothing), but not between
# two adjacent stages on one rank (V placement: rank r holds r and 2p-1-r; for r = p-1 the two are neighbours):
# there the runtime hands the input gradient over locally via ``get_local_bwd_output``, which asserts
# ``has_backward``. So for eval we run the *forward part* of the lowered action list: every F, SEND_F and RECV_F in
# its original order, the forward halves of OVERLAP_F_B, nothing else. Dropping actions only removes waits (a
# backward waits on a RECV_B), never adds one, so the forward-only list cannot deadlock where the full one did not.
_FORWARD_TYPES = ("F", "SEND_F", "RECV_F")


def _forward_part(actions: list[Any]) -> list[Any]:
    out = []
    for action in actions:
        if action is None:
            continue
        if action.computation_type.value == "OVERLAP_F_B":
            out.extend(a for a in action.sub_actions or () if a.computation_type.value in _FORWARD_TYPES)
        elif action.computation_type.value in _FORWARD_TYPES:
            out.append(action)
    return out


@contextlib.contextmanager
def forward_only_actions(schedule: Any) -> Iterator[None]:
    """Inside this context an action-list schedule (``_PipelineScheduleRuntime``) runs forward actions only.

    A no-op for other schedules. See [Note: forward-only action lists].
    """
    if PipelineScheduleRuntime is None or not isinstance(schedule, PipelineScheduleRuntime):
        yield
        return
    if not hasattr(schedule, "pipeline_order_with_comms"):
        raise RuntimeError(
            f"torch {torch.__version__}: {type(schedule).__name__} has no attribute 'pipeline_order_with_comms'; "
            "lightning_pipe._compat.forward_only_actions needs updating for this torch version."
        )
    full = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: _forward_part(actions) for rank, actions in full.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = full
