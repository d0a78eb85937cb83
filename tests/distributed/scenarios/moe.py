"""Aux losses under the pipeline (issue 25): a toy layer list with an aux term on a non-last stage, and transformers
mixture-of-experts models through ``HFCausalLM``, each against one device.

The toy's aux terms (``w.square().sum()`` of a block's weight and the mean square of its activation) are the same
for the whole batch as for the mean over equal micro-batches, so its reference is the same LightningModule trained
by Lightning on one device. The MoE reference is the transformers model with the loss
``main + router_aux_loss_coef * mean_j aux_j`` (see ``moe_reference``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe import PipelineModule, PipelinePrecision, PipelineStrategy
from lightning_pipe.layers.aux import attach_aux_loss
from tests.distributed.scenarios.training import full_tensor
from tests.models import WIDTH, Block, SameOrderAsDistributedSampler, regression_data


class AuxBlock(Block):
    """A residual block whose weight's square sum and activation's mean square join the loss as aux terms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        h = attach_aux_loss(h, self.fc.weight.square().sum(), name="weight_l2", coef=0.01)
        return attach_aux_loss(h, h.square().mean(), name="act_l2", coef=0.1)


class AuxToy(PipelineModule):
    def __init__(self, n_layers: int = 8, aux_at: tuple[int, ...] = (1, 2)) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(4, WIDTH)]
        layers += [AuxBlock(WIDTH) if i + 1 in aux_at else Block(WIDTH) for i in range(n_layers - 2)]
        layers.append(nn.Linear(WIDTH, 4))
        self.layers = nn.Sequential(*layers)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@dataclass(frozen=True)
class AuxCase:
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    microbatches: int = 4
    batch: int = 8
    dp: int = 1
    acc: int = 1
    steps: int = 3
    precision: str = "32-true"
    aux_at: tuple[int, ...] = (1, 2)  # layers with aux terms (the first stage's, for 8 layers over >= 2 stages)
    expect_error: bool = False


class AuxResult(TypedDict):
    params: dict[str, torch.Tensor]
    losses: list[float]
    aux: list[dict[str, float]]  # logged train_aux_loss/<name> per step


class _Logged(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.aux: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        m = trainer.callback_metrics
        self.losses.append(float(m["train_loss"]))
        self.aux.append({k: float(v) for k, v in m.items() if k.startswith("train_aux_loss")})


def _precision(case: AuxCase, pipeline: bool) -> dict[str, Any]:
    if case.precision != "16-mixed":
        return {"precision": case.precision}
    from lightning.pytorch.plugins import MixedPrecision

    if pipeline:
        return {"plugins": [PipelinePrecision("16-mixed", device="cpu", init_scale=2.0**10)]}
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]}


def run_toy(case: AuxCase, pipeline: bool = True) -> AuxResult:
    module = AuxToy(aux_at=case.aux_at)
    data = regression_data(96)
    logged = _Logged()
    if pipeline:
        strategy: Any = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                         stages_per_rank=case.stages_per_rank, data_parallel_size=case.dp)
        devices, loader = int(os.environ["TEST_WORLD_SIZE"]), DataLoader(data, batch_size=case.batch, drop_last=True)
    else:
        strategy, devices = "auto", 1
        loader = DataLoader(data, batch_size=case.batch * case.dp, sampler=SameOrderAsDistributedSampler(len(data)),
                            drop_last=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case.steps,
                        accumulate_grad_batches=case.acc, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[logged], **_precision(case, pipeline))
    trainer.fit(module, loader)
    return AuxResult(params={n: full_tensor(p) for n, p in module.named_parameters()}, losses=logged.losses,
                     aux=logged.aux)
