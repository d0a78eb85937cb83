"""The planner on real ranks (tests/distributed/test_planner.py): schedule="auto" with one rank slowed down."""

from __future__ import annotations

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
    """``n_layers`` equal layers; every layer forward on global rank ``slow_rank`` sleeps ``delay_s`` more."""

    n_layers: int = 8
    slow_rank: int = 1
    delay_s: float = 0.003
    steps: int = 2
    expect_error: bool = False


class SlowRankResult(TypedDict):
    plan: dict[str, Any]  # the plan schedule="auto" adopted (strategy.auto_plan), the same on every rank
    topology: tuple[int, int]


class Throttled(nn.Module):
    """A device that is slower on one rank: the same layer, with a pause per call there."""

    def __init__(self, delay_s: float, slow: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.delay_s, self.slow = delay_s, slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(self.delay_s)
        return torch.tanh(self.lin(x))


class SlowRankModel(PipelineModule):
    def __init__(self, case: SlowRankCase) -> None:
        super().__init__()
        slow = int(os.environ.get("RANK", "0")) == case.slow_rank
        self.layers = nn.Sequential(*(Throttled(case.delay_s, slow) for _ in range(case.n_layers)))

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run_slow_rank(case: SlowRankCase) -> SlowRankResult:
    torch.manual_seed(0)
    strategy = PipelineStrategy(schedule="auto")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(SlowRankModel(case), loader(regression_data(64), 8))
    assert strategy.auto_plan is not None and strategy.topology is not None
    return SlowRankResult(plan=strategy.auto_plan, topology=(strategy.topology.dp_rank, strategy.topology.pp_rank))
