"""The timeline scenario (tests/distributed/test_trace.py): train with PipelineTimeline, return what it recorded."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_pipe import PipelineStrategy, PipelineTimeline
from tests.models import ToyRegressor, loader, regression_data


@dataclass(frozen=True)
class TraceCase:
    """A ToyRegressor of ``n_layers`` x ``width`` trained ``steps`` steps, ``mb_rows`` rows per micro-batch."""

    schedule: str = "1f1b"
    microbatches: int = 4
    stages_per_rank: int | None = None
    partition: str | list[int] = "uniform"
    n_layers: int = 8
    width: int = 8
    mb_rows: int = 2
    steps: int = 3
    every_n_steps: int = 1  # PipelineTimeline's settings
    warmup_steps: int = 1
    export_dir: str | None = None
    csv_dir: str | None = None  # a CSVLogger writes here (no logger when None)
    expect_error: bool = False
    layer_sleep_s: float = 0.0
    """Each layer also sleeps this long in its forward: stage times set by the split, which a loaded machine can
    only lengthen (the bubble comparisons of test_trace.py)."""


class Paced(nn.Module):
    """A layer that sleeps before it runs: a known lower bound on its forward time."""

    def __init__(self, layer: nn.Module, seconds: float) -> None:
        super().__init__()
        self.layer, self.seconds = layer, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.layer(x)


class TraceResult(TypedDict):
    records: list[dict[str, Any]]  # StepRecord.to_dict() of every recorded step, this rank
    last_bubble: float | None
    per_pp: Any  # PipelineTimeline.last_bubbles_per_pp_rank
    seen: list[dict[str, float]]  # the pipeline/* metrics the logger connector held, per batch
    theory: float | None  # the plan's theoretical bubble
    planned: dict[str, Any] | None  # the planner's plan when the layout came from it (partition="time"), else None


class MetricsSeen(Callback):
    """What the logger connector holds after each batch (the callback's values are logged on_train_batch_end)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._grab(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._grab(trainer)

    def _grab(self, trainer: L.Trainer) -> None:
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pipeline/")})


def run_trace(case: TraceCase) -> TraceResult:
    torch.manual_seed(0)
    model = ToyRegressor(n_layers=case.n_layers, width=case.width)
    if case.layer_sleep_s:
        model.layers = nn.Sequential(*(Paced(layer, case.layer_sleep_s) for layer in model.layers))
    m = case.microbatches
    batch = m * case.mb_rows
    data = regression_data(batch * case.steps)
    timeline = PipelineTimeline(every_n_steps=case.every_n_steps, export_dir=case.export_dir,
                                warmup_steps=case.warmup_steps)
    seen = MetricsSeen()
    strategy = PipelineStrategy(schedule=case.schedule, microbatches=m, partition=case.partition,
                                stages_per_rank=case.stages_per_rank)
    logger: Any = CSVLogger(case.csv_dir, name="", version="") if case.csv_dir else False
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[timeline, seen])
    trainer.fit(model, loader(data, batch))
    engine = trainer.strategy.engine
    return TraceResult(records=[r.to_dict() for r in timeline.records], last_bubble=timeline.last_bubble,
                       per_pp=timeline.last_bubbles_per_pp_rank, seen=seen.seen,
                       theory=engine.plan.theoretical_bubble() if engine else None, planned=strategy.planned)
