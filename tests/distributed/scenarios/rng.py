"""[Note: random streams per stage] (lightning_pipe/runtime/rng.py): a residual MLP whose blocks draw their own dropout
masks and record them, row by row, so a test can count equal masks across stages, runs and one device.

``run_pipeline(case)`` runs inside a launched rank (every rank seeded alike, as ``seed_everything`` does);
``run_reference(seed)`` trains the same module on one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn

from lightning_pipe import PipelineStrategy
from tests.models import ToyRegressor, loader, reference_train_loader, regression_data

WIDTH, P = 64, 0.5


class RecordingDropout(nn.Module):
    """``x * keep / (1 - p)`` with ``keep = rand >= p`` drawn from torch's default generator, as ``nn.Dropout``
    draws; each row of ``keep`` is recorded as bytes under this layer's index."""

    seen: list[tuple[int, bytes]] = []  # (layer index, one row of a mask), in draw order, this process

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = torch.rand(x.shape, device=x.device) >= P
        RecordingDropout.seen += [(self.index, bytes(row.tolist())) for row in keep.cpu()]
        return x * keep / (1 - P)


class DropBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(WIDTH, WIDTH), RecordingDropout(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class DropoutRegressor(ToyRegressor):
    def __init__(self) -> None:
        super().__init__(n_layers=8, width=WIDTH)
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(4, WIDTH), *(DropBlock(i) for i in range(1, 7)), nn.Linear(WIDTH, 4))


@dataclass(frozen=True)
class RngCase:
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    seed: int = 1234
    recompute: str | int = "none"
    steps: int = 2
    batch: int = 8
    expect_error: bool = False


def _run(case: RngCase, pipeline: bool) -> dict[str, Any]:
    RecordingDropout.seen = []
    model = DropoutRegressor()  # seeds its own init
    torch.manual_seed(case.seed)  # then every process alike, as seed_everything before fit
    data = regression_data(64)
    strategy: Any = "auto"
    devices = 1
    if pipeline:
        strategy = PipelineStrategy(schedule=case.schedule, microbatches=4, stages_per_rank=case.stages_per_rank,
                                    recompute=case.recompute)
        devices = int(os.environ["TEST_WORLD_SIZE"])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(model, loader(data, case.batch) if pipeline else reference_train_loader(data, case.batch))
    return {"masks": list(RecordingDropout.seen), "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def run_pipeline(case: RngCase) -> dict[str, Any]:
    return _run(case, pipeline=True)


def run_reference(seed: int) -> dict[str, Any]:
    return _run(RngCase(seed=seed), pipeline=False)
