"""The stage every engine builds: torch's ``PipelineStage`` with the shape-inference guard
(``_compat.GuardedPipelineStage``), plus the hooks the engine calls on each stage, declared here as no-ops.

A schedule that needs other stages (weight versions, one update per micro-batch: ``schedules/pipedream/``) subclasses
:class:`PipelineStage`, names the class in ``ScheduleSpec.stage_class`` and overrides the hooks it uses; the engine
calls them on every stage, without asking what kind of stage it holds.
"""

from __future__ import annotations

from typing import Any

from lightning_pipe._compat import torch as _compat


class PipelineStage(_compat.GuardedPipelineStage):
    """One stage of one pipeline on this rank (same constructor as ``_compat.GuardedPipelineStage``)."""

    updates_per_microbatch = False
    """The optimizer steps inside the schedule, once per micro-batch (PipeDream): read by the engine and the
    strategy, which then skip the per-batch optimizer step."""
    updater: Any = None
    """What applies a per-micro-batch update (``MicrobatchUpdate``; set by the engine); unused by other stages."""

    def flush_update(self) -> None:
        """Apply an update that is due (per-micro-batch stages); called by the engine after each training step."""

    def stash_live(self) -> None:
        """Keep the current weights as the version the next batch runs on (weight-versioned stages); called by the
        engine right before each optimizer step."""
