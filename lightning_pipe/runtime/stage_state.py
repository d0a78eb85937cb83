"""What a schedule's stages keep per parameter across batches, in and out of a checkpoint.

[Note: stage state in checkpoints]
Most schedules keep nothing between batches beyond the module and the optimizer: every micro-batch of a step drains
before it ends. Two keep a tensor per parameter that the next batch reads: PipeDream-2BW's stash (the previous
weight version, which the next batch's forwards and backwards run on) and PipeMare's velocity estimate ``delta``
(discrepancy correction). Without them a resumed run departs from an uninterrupted one at its first batch.

So they are saved like optimizer state: keyed by the parameter's name (``stage_state.<name>.<key>``: [Note:
checkpoint format]), written as full tensors by the rank that writes the parameter, read back by whichever rank
holds it in the resuming layout and cut like it. Any layout resumes them. A checkpoint without them (another
schedule's, one consolidated to a single file, or one written before the first batch) leaves the stages to start as
a fresh run does, with the schedule's warning where that departs from an uninterrupted run
(``ScheduleSpec.resume_caveat``).

A stage class takes part by implementing :class:`KeepsState`; the others are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class KeepsState(Protocol):
    def state_slots(self) -> list[tuple[Tensor, str]]:
        """(live parameter, key) of everything the stage can restore."""
        ...

    def checkpoint_state(self) -> list[tuple[Tensor, str, Tensor]]:
        """(live parameter, key, tensor) of what the stage holds now (nothing before its first batch)."""
        ...

    def restore_state(self, values: Mapping[tuple[int, str], Tensor]) -> bool:
        """Take the saved tensors, keyed by (``id`` of the live parameter, key), already cut like the parameter;
        True if the stage found all it keeps (otherwise it starts as a fresh run does)."""
        ...


def _keeping(stages: Iterable[object]) -> list[KeepsState]:
    return [stage for stage in stages if isinstance(stage, KeepsState)]


def state_slots(stages: Iterable[object]) -> list[tuple[Tensor, str]]:
    return [slot for stage in _keeping(stages) for slot in stage.state_slots()]


def checkpoint_state(stages: Iterable[object]) -> list[tuple[Tensor, str, Tensor]]:
    return [entry for stage in _keeping(stages) for entry in stage.checkpoint_state()]


def restore_state(stages: Iterable[object], values: Mapping[tuple[int, str], Tensor]) -> bool:
    """Hand the saved tensors to the stages that keep state; True if every such stage found all of its own."""
    return all([stage.restore_state(values) for stage in _keeping(stages)])
