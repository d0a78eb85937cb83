"""What a multi-rank test runs, written once for both sides: the pipeline ranks and the single-device reference.

``run_training(case, pipeline=True)`` runs inside a launched rank; ``pipeline=False`` runs the same LightningModule
on one process, with the global batch (per-replica batch x data-parallel size), as the reference.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pipe import PipelineStrategy
from tests.models import ToyRegressor, loader, reference_train_loader, regression_data

DEFAULTS: dict[str, Any] = dict(schedule="1f1b", dp=1, acc=1, clip=None, clip_algo="norm", steps=3, optimizer="sgd",
                                tied=False, n_layers=8, microbatches=4, split="uniform", batch=8,
                                stages_per_rank=None, predict=False, validate=True, n_data=192, model="toy")


class NoLayerList(ToyRegressor):
    """Keeps its layers under another name: the strategy must say how to provide a layer list."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = self.layers
        del self.layers


MODELS = {"toy": ToyRegressor, "no_layers": NoLayerList}


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _trainer(case: dict[str, Any], pipeline: bool, recorder: Callback) -> L.Trainer:
    if pipeline:
        strategy: Any = PipelineStrategy(schedule=case["schedule"], microbatches=case["microbatches"],
                                         data_parallel_size=case["dp"], split=case["split"],
                                         stages_per_rank=case["stages_per_rank"])
        devices = int(os.environ["TEST_WORLD_SIZE"])  # Lightning deletes WORLD_SIZE at teardown
    else:
        strategy, devices = "auto", 1
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case["steps"],
                     accumulate_grad_batches=case["acc"], gradient_clip_val=case["clip"],
                     gradient_clip_algorithm=case["clip_algo"], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=3, val_check_interval=None, check_val_every_n_epoch=None,
                     callbacks=[recorder])


def run_training(case: dict[str, Any], pipeline: bool) -> dict[str, Any]:
    case = {**DEFAULTS, **case}
    torch.manual_seed(1234)
    model = MODELS[case["model"]](n_layers=case["n_layers"], optimizer=case["optimizer"], tied=case["tied"])
    data = regression_data(case["n_data"])
    batch = case["batch"] * (1 if pipeline else case["dp"])
    recorder = LossRecorder()
    trainer = _trainer(case, pipeline, recorder)
    # Lightning shuffles training data through its DistributedSampler; the reference walks the same order.
    train_loader = loader(data, batch) if pipeline else reference_train_loader(data, batch)
    trainer.fit(model, train_loader, loader(data, batch) if case["validate"] else None)
    out: dict[str, Any] = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)},
        "losses": recorder.losses,
        "calls": dict(model.calls),
        "grad_sq_before_step": model.grad_norms_before_step,
    }
    if case["validate"]:
        metrics = trainer.validate(model, loader(data, batch), verbose=False)
        out["val_loss"] = metrics[0]["val_loss"]
    if case["predict"]:
        # 22 samples with batch 8: the last batch (6 rows) does not divide into 4 micro-batches: pad-and-trim.
        pred_data = regression_data(22, seed=7)
        preds = trainer.predict(model, loader(pred_data, case["batch"], drop_last=False))
        out["predictions"] = torch.cat(preds) if preds and preds[0] is not None else None
    if pipeline:
        out["topology"] = (trainer.strategy.topology.dp_rank, trainer.strategy.topology.pp_rank)
    return out
