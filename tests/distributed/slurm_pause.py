"""A callback for the SLURM tests, given to the recipe as a Hydra callback: on a job's first start, every rank stops
after training step ``step`` until ``signal`` reaches it, so the test's ``scancel`` lands at a known step.

Each rank writes ``<directory>/paused.<rank>`` when it waits; the test sends the signal once all have. The wait
chains the handler Lightning (and lightning_pipe) installed, so they see the signal as they would at any other
time; the step after the pause is the first step boundary that can act on it.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class PauseForSignal(pl.Callback):
    def __init__(self, directory: str, step: int, signal_name: str = "SIGUSR1", timeout: float = 120.0) -> None:
        self.directory = Path(directory)
        self.step = step
        self.signum = signal.Signals[signal_name]
        self.timeout = timeout

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self.step or os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
            return
        arrived = threading.Event()
        previous = signal.getsignal(self.signum)

        def note(signum: int, frame: Any) -> None:
            arrived.set()
            if callable(previous):
                previous(signum, frame)

        signal.signal(self.signum, note)
        try:
            (self.directory / f"paused.{trainer.global_rank}").touch()
            if not arrived.wait(self.timeout):
                raise RuntimeError(f"rank {trainer.global_rank}: no {self.signum.name} within {self.timeout:.0f} s")
        finally:
            signal.signal(self.signum, previous)
