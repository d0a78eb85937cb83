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
from tests.moe_configs import moe_config


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


# ------------------------------------------------------------------------------------------------ HF mixtures of experts
# moe_config / MOE_TINY: tests/moe_configs.py (shared with tests/unit/test_hf_moe.py)


@dataclass(frozen=True)
class MoECase:
    family: str = "mixtral"
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    microbatches: int = 4
    dp: int = 1
    from_model: bool = False  # HFCausalLM(model) instead of HFCausalLM(config=...)
    steps: int = 3
    batch: int = 8
    n_data: int = 48
    expect_error: bool = False


class MoEResult(TypedDict):
    params: dict[str, torch.Tensor]
    losses: list[float]
    aux: list[float]  # logged train_aux_loss/load_balancing per step (this replica's)


MOE_SEED, MOE_LR = 5, 0.2


def _moe_module(case: MoECase) -> Any:
    from lightning_pipe import HFCausalLM

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=MOE_LR)

    if case.from_model:
        import transformers

        torch.manual_seed(MOE_SEED)
        model = transformers.AutoModelForCausalLM.from_config(moe_config(case.family), attn_implementation="eager")
        return HFCausalLM(model, optimizer=sgd)
    return HFCausalLM(config=moe_config(case.family), seed=MOE_SEED, attn_implementation="eager", optimizer=sgd)


class _MoELogged(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.aux: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.aux.append(float(trainer.callback_metrics["train_aux_loss/load_balancing"]))


def run_moe(case: MoECase) -> MoEResult:
    from tests.distributed.scenarios.hf import hf_params, padded_data

    module = _moe_module(case)
    logged = _MoELogged()
    strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                stages_per_rank=case.stages_per_rank, data_parallel_size=case.dp)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[logged])
    trainer.fit(module, DataLoader(padded_data(case.n_data), batch_size=case.batch, shuffle=False, drop_last=True))
    return MoEResult(params=hf_params(module.layers), losses=logged.losses, aux=logged.aux)


def moe_reference(case: MoECase, drop: str | None = None) -> tuple[MoEResult, dict[str, torch.Tensor]]:
    """The transformers model on one process, SGD on ``main + coef * mean_j aux_j``: ``main`` the token-weighted
    cross-entropy of the whole (global) batch, ``aux_j`` transformers' ``load_balancing_loss_func`` on micro-batch
    j's router logits (all layers) and attention mask, j over every replica's micro-batches.

    ``drop`` builds what a wrong implementation would compute (the test shows it differs): ``"microbatch_scale"``
    sums the micro-batches' aux terms instead of averaging them; ``"cross_stage_fractions"`` computes each stage's
    aux from its own layers' token fractions only (the mean of the two halves' terms, as two stages would)."""
    import importlib

    import transformers
    from torch.utils.data import default_collate

    from lightning_pipe.hf import hf_state_dict
    from lightning_pipe.hf.loss import causal_lm_loss_sum_count
    from tests.distributed.scenarios.hf import padded_data

    config = moe_config(case.family)
    if case.from_model:
        torch.manual_seed(MOE_SEED)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    else:
        start = _moe_module(case)
        start.configure_model()
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        missing, unexpected = model.load_state_dict(hf_state_dict(start.layers), strict=False)
        assert not unexpected and not missing, (missing, unexpected)
    balance = importlib.import_module(type(model).__module__).load_balancing_loss_func
    data = padded_data(case.n_data)
    order = list(SameOrderAsDistributedSampler(len(data)))
    optimizer = torch.optim.SGD(model.parameters(), lr=MOE_LR)
    losses, auxes = [], []
    m, b = case.microbatches, case.batch
    for step in range(case.steps):
        optimizer.zero_grad()
        total, count, aux_terms = torch.zeros(()), torch.zeros(()), []
        for replica in range(case.dp):
            rows = order[replica::case.dp][step * b:(step + 1) * b]
            batch = default_collate([data[i] for i in rows])
            for j in range(m):
                mb = {k: v[j * b // m:(j + 1) * b // m] for k, v in batch.items()}
                out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True)
                s, c = causal_lm_loss_sum_count(out.logits, mb["labels"])
                total, count = total + s, count + c
                logits = tuple(out.router_logits)
                if drop == "cross_stage_fractions":
                    half = len(logits) // 2
                    aux_j = sum(balance(part, model.num_experts, model.num_experts_per_tok, mb["attention_mask"])
                                for part in (logits[:half], logits[half:])) / 2
                else:
                    aux_j = balance(logits, model.num_experts, model.num_experts_per_tok, mb["attention_mask"])
                aux_terms.append(aux_j)
        aux = torch.stack(aux_terms).sum() / (1 if drop == "microbatch_scale" else len(aux_terms))
        loss = total / count.clamp_min(1) + model.router_aux_loss_coef * aux
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        auxes.append(float(model.router_aux_loss_coef * aux.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return MoEResult(params=params, losses=losses, aux=auxes), params
