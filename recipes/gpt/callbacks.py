"""Callbacks for the GPT recipe."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from torch import Tensor


def data_parallel_replicas(trainer: pl.Trainer) -> int:
    """How many replicas see different data: DP size under the pipeline or DDP, 1 on one device.

    Read from the strategy's sampler settings (``num_replicas``), which is exactly the data-parallel world —
    the pipeline strategy counts each replica once, however many stages it has.
    """
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


def batch_tokens(batch: Any) -> int:
    """Tokens in one batch: the element count of the inputs of an ``(x, y)`` batch (or of a bare tensor)."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return x.numel() if isinstance(x, Tensor) else 0


class TokensPerSecond(pl.Callback):
    """Log training throughput, ``tokens_per_s`` = batch tokens x data-parallel replicas / step time.

    Step time is measured from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward and
    optimizer step of the whole pipeline schedule; data loading and validation excluded). The first
    ``skip_steps`` steps (warm-up, shape inference) are left out of the run average ``mean_tokens_per_s``.
    """

    def __init__(self, skip_steps: int = 2) -> None:
        super().__init__()
        self.skip_steps = skip_steps
        self._t0 = 0.0
        self._steps = 0
        self._tokens = 0
        self._seconds = 0.0

    @property
    def mean_tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else float("nan")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        seconds = time.perf_counter() - self._t0
        tokens = batch_tokens(batch) * data_parallel_replicas(trainer)
        self._steps += 1
        if self._steps > self.skip_steps:
            self._tokens += tokens
            self._seconds += seconds
        # Not synced: every rank measured the same step; rank 0's value is the one the loggers keep.
        pl_module.log("tokens_per_s", tokens / max(seconds, 1e-9), prog_bar=True, on_step=True, on_epoch=False)
