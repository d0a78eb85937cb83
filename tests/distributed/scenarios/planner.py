"""The planner on real ranks (tests/distributed/test_planner.py): schedule="auto" / partition="time" with one rank,
or one layer, slowed down."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe import PipelineModule, PipelineStrategy
from tests.models import loader, regression_data


@dataclass(frozen=True)
class SlowRankCase:
    """``n_layers`` equal layers; every layer forward on global rank ``slow_rank`` sleeps ``delay_s`` more, or
    only layer ``slow_layer`` (on every rank) ``delay_s`` per sample. The strategy plans with ``schedule`` and
    ``partition``."""

    n_layers: int = 8
    slow_rank: int | None = 1
    slow_layer: int | None = None
    delay_s: float = 0.003
    layer_s: float = 0.0  # every layer's compute, per sample (so pipelining pays off against the runtime's cost)
    schedule: str = "auto"
    partition: str = "uniform"
    steps: int = 2
    expect_error: bool = False


class SlowRankResult(TypedDict):
    plan: dict[str, Any]  # the plan the strategy adopted (strategy.auto_plan), the same on every rank
    topology: tuple[int, int]
    logged: list[str]  # what the strategy logged through Lightning's rank-zero logger (rank 0 only)


class Throttled(nn.Module):
    """A device that is slower on one rank (a pause per call there), or a layer with more compute than the others
    (``per_sample``: a pause per sample of the call, so it scales with the micro-batch like compute does)."""

    def __init__(self, delay_s: float, slow: bool, per_sample: bool = False, base_s: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.delay_s, self.slow, self.per_sample, self.base_s = delay_s, slow, per_sample, base_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pause = self.base_s * x.size(0)
        if self.slow:
            pause += self.delay_s * (x.size(0) if self.per_sample else 1)
        if pause:
            time.sleep(pause)
        return torch.tanh(self.lin(x))


class SlowRankModel(PipelineModule):
    def __init__(self, case: SlowRankCase) -> None:
        super().__init__()
        slow = int(os.environ.get("RANK", "0")) == case.slow_rank
        self.layers = nn.Sequential(*(Throttled(case.delay_s, slow or i == case.slow_layer, i == case.slow_layer, case.layer_s)
                                      for i in range(case.n_layers)))

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run_slow_rank(case: SlowRankCase) -> SlowRankResult:
    torch.manual_seed(0)
    strategy = PipelineStrategy(schedule=case.schedule, partition=case.partition)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    try:
        trainer.fit(SlowRankModel(case), loader(regression_data(64), 8))
    finally:
        logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
    assert strategy.auto_plan is not None and strategy.topology is not None
    return SlowRankResult(plan=strategy.auto_plan, topology=(strategy.topology.dp_rank, strategy.topology.pp_rank),
                          logged=logged)
