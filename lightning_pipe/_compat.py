"""Every private torch / Lightning API lightning_pipe touches, in one place, with the versions it was checked on.

If one of these moves, ``tests/unit/test_compat.py`` fails loudly naming the attribute, instead of a training run
failing obscurely (or silently computing something else).
"""

from __future__ import annotations

from typing import Any

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
