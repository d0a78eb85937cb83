"""What every feature scenario shares (issue 45): the case, the Trainer on either side, the data, a fit and what
it returns. ``features.py`` (the issue's features) and ``everyday.py`` (Lightning's everyday ones) build on it."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_pipe import PipelineStrategy
from tests.distributed.scenarios.feature_model import FeatureNet, Stream, classification_data
from tests.models import SameOrderAsDistributedSampler


@dataclass(frozen=True)
class FeatureCase:
    feature: str  # a key of FEATURES
    dp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    steps: int = 4
    batch: int = 8  # per replica
    tied: bool = False
    n_data: int = 96
    stream: bool = False  # an IterableDataset (its short last batch is kept)
    drop_last: bool = True
    stages_per_rank: int | None = None
    out_dir: str = ""  # where checkpoints and prediction files go (one sub-folder per side)
    expect_error: bool = False


class Recorder(Callback):
    """train_loss per batch, and every logged value a feature asks for."""

    def __init__(self, keys: tuple[str, ...] = ()) -> None:
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.keys, self.logged = keys, {k: [] for k in keys}  # type: dict[str, list[float]]

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        for key in self.keys:
            if key in trainer.callback_metrics:
                self.logged[key].append(float(trainer.callback_metrics[key]))

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.state.fn == "fit" and "val_loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


def side(case: FeatureCase, pipeline: bool) -> Path:
    return Path(case.out_dir) / ("pipeline" if pipeline else "reference")


def trainer_for(case: FeatureCase, pipeline: bool, callbacks: list[Callback], **kwargs: Any) -> L.Trainer:
    strategy: Any = "auto"
    devices = 1
    if pipeline:
        strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches, data_parallel_size=case.dp,
                                    stages_per_rank=case.stages_per_rank, **kwargs.pop("strategy_kwargs", {}))
        devices = int(os.environ["TEST_WORLD_SIZE"])
    settings: dict[str, Any] = dict(max_steps=case.steps, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                    limit_val_batches=3, val_check_interval=2, check_val_every_n_epoch=None)
    settings.update(kwargs)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, callbacks=callbacks, **settings)


def train_loader(case: FeatureCase, pipeline: bool) -> DataLoader:
    data = classification_data(case.n_data)
    if case.stream:  # no sampler: every rank (and the reference) reads the stream in order
        return DataLoader(Stream(data), batch_size=case.batch)
    if pipeline:  # Lightning adds the (shuffling) DistributedSampler
        return DataLoader(data, batch_size=case.batch, drop_last=case.drop_last)
    return DataLoader(data, batch_size=case.batch * case.dp, sampler=SameOrderAsDistributedSampler(case.n_data),
                      drop_last=case.drop_last)


def val_loader(case: FeatureCase, pipeline: bool, n: int = 40) -> DataLoader:
    return DataLoader(classification_data(n, seed=3), batch_size=case.batch * (1 if pipeline else case.dp))


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


def result_of(trainer: L.Trainer, model: FeatureNet, recorder: Recorder, pipeline: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"params": params_of(model), "losses": recorder.losses, "logged": recorder.logged,
                           "record": model.record, "val_losses": recorder.val_losses,
                           "global_step": trainer.global_step}
    if pipeline:
        topo = trainer.strategy.topology  # type: ignore[attr-defined]
        out["topology"] = (topo.dp_rank, topo.pp_rank)
        out["global_rank"] = trainer.global_rank
    return out


def fit(case: FeatureCase, pipeline: bool, model: FeatureNet | None = None, keys: tuple[str, ...] = (),
        callbacks: tuple[Callback, ...] = (), validate: bool = True, datamodule: Any = None,
        **kwargs: Any) -> dict[str, Any]:
    """Train ``model`` (a plain FeatureNet in ``case.feature``'s mode by default) for ``case.steps`` steps (or as
    the Trainer settings in ``kwargs`` say)."""
    model = model or FeatureNet(case.feature, tied=case.tied)
    recorder = Recorder(keys)
    trainer = trainer_for(case, pipeline, [recorder, *callbacks], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if datamodule is not None:
            trainer.fit(model, datamodule=datamodule)
        else:
            trainer.fit(model, train_loader(case, pipeline), val_loader(case, pipeline) if validate else None)
    out = result_of(trainer, model, recorder, pipeline)
    out["warnings"] = [str(w.message) for w in caught if "lightning_pipe" in str(w.message)]
    out["trainer"] = trainer
    return out


def fitted(case: FeatureCase, pipeline: bool, **kwargs: Any) -> dict[str, Any]:
    """:func:`fit`'s result without its trainer (what a rank sends back)."""
    out = fit(case, pipeline, **kwargs)
    out.pop("trainer")
    return out
