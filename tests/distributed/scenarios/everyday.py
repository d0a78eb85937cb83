"""Lightning's everyday Trainer features under the pipeline (issue 45, item 8), written once for both sides: each
trains the feature scenarios' classifier with one feature on, on the pipeline ranks or one device, and returns what
the feature produced beside the parameters (``feature_fit.result_of``)."""

from __future__ import annotations

import csv
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader

from tests.distributed.scenarios.feature_fit import (
    FeatureCase,
    Recorder,
    fit,
    fitted,
    result_of,
    side,
    train_loader,
    trainer_for,
    val_loader,
)
from tests.distributed.scenarios.feature_model import FeatureNet, Stream, classification_data

Run = Callable[[FeatureCase, bool], dict[str, Any]]


def _with(**kwargs: Any) -> Run:
    """A fit with these Trainer settings (and ``model=`` keyword arguments of FeatureNet under ``model``)."""
    model_kwargs = kwargs.pop("model", {})
    return lambda case, pipeline: fitted(case, pipeline, model=FeatureNet("plain", **model_kwargs), **kwargs)


def checkpoint_topk(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    folder = side(case, pipeline) / "topk"
    callback = ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=2, filename="{step}")
    out = fitted(case, pipeline, callbacks=(callback,), enable_checkpointing=True, max_steps=8)
    out["best_score"] = float(callback.best_model_score)  # type: ignore[arg-type]
    out["kept"] = sorted(p.name for p in folder.iterdir())
    return out


def early_stopping(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=0.02)
    out = fitted(case, pipeline, callbacks=(stop,), max_steps=30)
    out["stopped_epoch"] = stop.stopped_epoch
    return out


def loggers(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """CSV and TensorBoard loggers, LearningRateMonitor: what rank 0 writes, as one device writes it."""
    folder = side(case, pipeline)
    logs = [CSVLogger(folder, name="csv"), TensorBoardLogger(folder, name="tb")]
    out = fitted(case, pipeline, model=FeatureNet("plain", scheduler="onecycle"), logger=logs,
                 callbacks=(LearningRateMonitor(logging_interval="step"),), log_every_n_steps=1)
    out["csv"] = str(folder / "csv" / "version_0" / "metrics.csv")
    out["tb_files"] = len(list((folder / "tb").rglob("events.out.tfevents.*")))
    return out


def read_csv_column(path: str, column: str) -> list[float]:
    with open(path) as f:
        return [float(row[column]) for row in csv.DictReader(f) if row.get(column)]


def resume_sharded(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """Fit, save (sharded under the pipeline, one file on one device), fit again from it: the resumed run's
    parameters."""
    folder = side(case, pipeline) / "resume"
    fit(case, pipeline, callbacks=(ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0),),
        enable_checkpointing=True)
    model, recorder = FeatureNet("plain"), Recorder()
    trainer = trainer_for(case, pipeline, [recorder], max_steps=case.steps + 3)
    trainer.fit(model, train_loader(case, pipeline), val_loader(case, pipeline), ckpt_path=str(folder / "last.ckpt"))
    return result_of(trainer, model, recorder, pipeline)


class Data(L.LightningDataModule):
    def __init__(self, case: FeatureCase, pipeline: bool) -> None:
        super().__init__()
        self.case, self.pipeline = case, pipeline

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.case, self.pipeline)

    def val_dataloader(self) -> DataLoader:
        return val_loader(self.case, self.pipeline)


def datamodule(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    return fitted(case, pipeline, datamodule=Data(case, pipeline))


def iterable(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """An IterableDataset (no sampler: every rank reads the same stream, as the reference)."""
    model, recorder = FeatureNet("plain"), Recorder()
    trainer = trainer_for(case, pipeline, [recorder])
    trainer.fit(model, DataLoader(Stream(classification_data(96)), batch_size=8),
                DataLoader(Stream(classification_data(40, seed=3)), batch_size=8))
    return result_of(trainer, model, recorder, pipeline)


def lr_find(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    model = FeatureNet("plain")
    trainer = trainer_for(case, pipeline, [Recorder()])
    finder = Tuner(trainer).lr_find(model, train_loader(case, pipeline), val_loader(case, pipeline), num_training=6,
                                    early_stop_threshold=None)
    assert finder is not None
    out = {"params": {}, "losses": [], "lr_losses": [float(v) for v in finder.results["loss"]],
           "suggestion": finder.suggestion(skip_begin=1, skip_end=1)}
    if pipeline:
        topo = trainer.strategy.topology  # type: ignore[attr-defined]
        out["topology"] = (topo.dp_rank, topo.pp_rank)
    return out


def scale_batch_size(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    trainer = trainer_for(case, pipeline, [Recorder()])
    Tuner(trainer).scale_batch_size(FeatureNet("plain"), train_dataloaders=train_loader(case, pipeline),
                                    max_trials=2)
    return {}


def swa(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    return fitted(case, pipeline, callbacks=(StochasticWeightAveraging(swa_lrs=0.01),))


def evaluate_and_predict(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    out = fit(case, pipeline)
    trainer = out.pop("trainer")
    out["test"] = trainer.test(trainer.lightning_module, val_loader(case, pipeline), verbose=False)[0]
    loader = DataLoader(classification_data(22, seed=7), batch_size=case.batch)
    out["predictions"] = trainer.predict(trainer.lightning_module, loader)
    return out


EVERYDAY: dict[str, Run] = {
    "accumulate": _with(accumulate_grad_batches=2, model={"optimizer": "adamw"}, max_steps=3),
    "trainer_clip_norm": _with(gradient_clip_val=0.05),
    "trainer_clip_value": _with(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    "lr_step": _with(model={"scheduler": "step"}, max_steps=-1, max_epochs=3, limit_train_batches=3),
    "lr_onecycle": _with(model={"scheduler": "onecycle"}),
    "lr_plateau": _with(model={"scheduler": "plateau"}, max_steps=-1, max_epochs=3, limit_train_batches=4),
    "checkpoint_topk": checkpoint_topk,
    "early_stopping": early_stopping,
    "loggers": loggers,
    "accumulation_scheduler": _with(callbacks=(GradientAccumulationScheduler({0: 1, 1: 2}),), max_steps=-1,
                                    max_epochs=2, limit_train_batches=4),
    "val_check_interval": _with(val_check_interval=0.5, check_val_every_n_epoch=1, max_steps=-1, max_epochs=1,
                                limit_train_batches=4),
    "check_val_every_n_epoch": _with(val_check_interval=None, check_val_every_n_epoch=2, max_steps=-1,
                                     max_epochs=4, limit_train_batches=2),
    "limit_batches": _with(limit_train_batches=3, limit_val_batches=2, max_steps=-1, max_epochs=2),
    "fast_dev_run": _with(fast_dev_run=2),
    "overfit_batches": _with(overfit_batches=2, max_steps=-1, max_epochs=3),
    "datamodule": datamodule,
    "iterable": iterable,
    "profiler": _with(profiler="simple"),
    "resume_sharded": resume_sharded,
    "evaluate_and_predict": evaluate_and_predict,
    "lr_find": lr_find,
    "scale_batch_size": scale_batch_size,
    "swa": swa,
}

__all__ = ["EVERYDAY", "read_csv_column"]
