"""Step timing shared by the benchmarks (imported inside the rank workers, which have Lightning loaded)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import Callback


class StepClock(Callback):
    """Records when each training batch ends; a step's time is the gap between consecutive ends (data loading,
    schedule, gradient sync, optimizer: everything a step costs)."""

    def __init__(self, on_step: Callable[[int], None] | None = None) -> None:
        self.ends: list[float] = []
        self.on_step = on_step  # called with the number of finished steps

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        if self.on_step is not None:
            self.on_step(len(self.ends))

    def durations(self, warmup: int) -> list[float]:
        """Step times after the first ``warmup`` steps."""
        return [b - a for a, b in zip(self.ends, self.ends[1:])][warmup - 1:]
