"""Lightning's everyday features under the pipeline (issue 45), written once for both sides: ``run_pipeline`` inside a
launched rank, ``run_reference`` on one process over the global batch. ``FEATURES`` maps a feature's name (the
keys of docs/features.md's table) to what runs; each returns this side's parameters, logged values and what the
feature produced, for tests/distributed/test_features.py to compare.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ModelCheckpoint, ModelSummary
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_pipe import PipelineStrategy
from lightning_pipe.layers.stages import RemoteLayer
from tests.distributed.scenarios.feature_model import (
    FeatureNet,
    ManualNet,
    PenaltyNet,
    Stream,
    classification_data,
)
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
        self.keys, self.logged = keys, {k: [] for k in keys}  # type: dict[str, list[float]]

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        for key in self.keys:
            if key in trainer.callback_metrics:
                self.logged[key].append(float(trainer.callback_metrics[key]))


def _side(case: FeatureCase, pipeline: bool) -> Path:
    return Path(case.out_dir) / ("pipeline" if pipeline else "reference")


def _trainer(case: FeatureCase, pipeline: bool, callbacks: list[Callback], **kwargs: Any) -> L.Trainer:
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


def _result(trainer: L.Trainer, model: FeatureNet, recorder: Recorder, pipeline: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"params": params_of(model), "losses": recorder.losses, "logged": recorder.logged,
                           "record": model.record}
    if pipeline:
        topo = trainer.strategy.topology  # type: ignore[attr-defined]
        out["topology"] = (topo.dp_rank, topo.pp_rank)
        out["global_rank"] = trainer.global_rank
    return out


def fit(case: FeatureCase, pipeline: bool, model: FeatureNet | None = None, keys: tuple[str, ...] = (),
        callbacks: tuple[Callback, ...] = (), validate: bool = True, **kwargs: Any) -> dict[str, Any]:
    """Train ``model`` (a plain FeatureNet in ``case.feature``'s mode by default) for ``case.steps`` steps."""
    model = model or FeatureNet(case.feature, tied=case.tied)
    recorder = Recorder(keys)
    trainer = _trainer(case, pipeline, [recorder, *callbacks], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_loader(case, pipeline), val_loader(case, pipeline) if validate else None)
    out = _result(trainer, model, recorder, pipeline)
    out["warnings"] = [str(w.message) for w in caught if "lightning_pipe" in str(w.message)]
    out["trainer"] = trainer
    return out


# ---------------------------------------------------------------------------------- item 1: collectives, writers
def collectives(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    out = fit(case, pipeline, keys=("val_rows",))
    trainer = out.pop("trainer")
    out["validate"] = trainer.validate(trainer.lightning_module, val_loader(case, pipeline), verbose=False)[0]
    return out


class RowWriter(BasePredictionWriter):
    """The DDP idiom: one file per process (and per batch), named by its global rank."""

    def __init__(self, folder: Path, interval: str) -> None:
        super().__init__(interval)  # type: ignore[arg-type]
        self.folder = folder

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int = 0) -> None:
        torch.save((prediction, batch_indices), self.folder / f"batch-{trainer.global_rank}-{batch_idx}.pt")

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        torch.save((predictions, batch_indices), self.folder / f"epoch-{trainer.global_rank}.pt")


def writers(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    folder = _side(case, pipeline)
    folder.mkdir(parents=True, exist_ok=True)
    out = fit(case, pipeline)
    trainer = out.pop("trainer")
    loader = DataLoader(classification_data(22, seed=7), batch_size=case.batch)
    predict = _trainer(case, pipeline, [RowWriter(folder, "batch"), RowWriter(folder, "epoch")])
    predict.predict(trainer.lightning_module, loader, return_predictions=False)
    return out


# ---------------------------------------------------------------------------------- item 4: checkpoints
def checkpoint(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """ModelCheckpoint's last checkpoint (sharded, or one file with ``save_consolidated``)."""
    consolidated = case.feature == "ckpt_consolidated"
    folder = _side(case, pipeline) / "ckpt"
    extra = {"strategy_kwargs": {"save_consolidated": True}} if consolidated and pipeline else {}
    out = fit(case, pipeline, callbacks=(ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0),),
              enable_checkpointing=True, **extra)
    out.pop("trainer")
    out["path"] = str(folder / "last.ckpt")
    return out


def resume(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """Continue from the pipeline's consolidated checkpoint for 2 more steps (both sides read the same file)."""
    path = Path(case.out_dir) / "pipeline" / "ckpt" / "last.ckpt"
    model = FeatureNet("plain", tied=case.tied)
    recorder = Recorder()
    trainer = _trainer(case, pipeline, [recorder], max_steps=case.steps + 2)
    trainer.fit(model, train_loader(case, pipeline), val_loader(case, pipeline), ckpt_path=str(path))
    return _result(trainer, model, recorder, pipeline)


# ---------------------------------------------------------------------------------- items 2, 3 and 7
def manual(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    out = fit(case, pipeline, model=ManualNet(case.feature, tied=case.tied), keys=("loss_d",))
    out.pop("trainer")
    return out


def train_metrics(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    out = fit(case, pipeline, keys=("train_acc",))
    out.pop("trainer")
    return out


def ragged(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """One epoch whose last batch does not divide into the micro-batches (an IterableDataset's, or drop_last=False)."""
    out = fit(case, pipeline, max_steps=-1, max_epochs=1)
    out.pop("trainer")
    return out


# ---------------------------------------------------------------------------------- items 5 and 6
def penalty(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    out = fit(case, pipeline, model=PenaltyNet("penalty", tied=case.tied), keys=("train_aux_loss/penalty",))
    out.pop("trainer")
    return out


def gradients(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """A hook that clips or measures gradients itself (the mode names how)."""
    out = fit(case, pipeline, keys=("grad_2.0_norm_total",))
    out.pop("trainer")
    return out


class SummaryLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(record.getMessage())


def layout(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """ModelSummary's table, and a layer read on a rank that does not hold it."""
    handler = SummaryLog()
    logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out = fit(case, pipeline, callbacks=(ModelSummary(max_depth=-1),), enable_model_summary=True)
    finally:
        logger.removeHandler(handler)
    model = out.pop("trainer").lightning_module
    out["summary"] = "\n".join(handler.text)
    remote = [i for i, layer in enumerate(model.layers) if isinstance(layer, RemoteLayer)]
    if remote:
        try:
            model.layers[remote[-1]].fc.weight  # noqa: B018  (what a user's hook reads)
        except AttributeError as err:
            out["remote_error"] = str(err)
    out["layer_value"] = model.layer_value(len(model.layers) - 1, lambda layer: layer.weight.norm())
    return out


FEATURES: dict[str, Callable[[FeatureCase, bool], dict[str, Any]]] = {
    "collectives": collectives,
    "prediction_writers": writers,
    "ckpt_sharded": checkpoint,
    "ckpt_consolidated": checkpoint,
    "ckpt_resume": resume,
    "clip_torch_norm": gradients,
    "clip_torch_value": gradients,
    "clip_self": gradients,
    "grad_norm_lightning": gradients,
    "grad_norm_ours": gradients,
    "penalty": penalty,
    "layout": layout,
    "manual_gan": manual,
    "manual_alternate": manual,
    "manual_groups": manual,
    "manual_twice": manual,
    "manual_changed": manual,
    "manual_tie_split": manual,
    "train_metrics": train_metrics,
    "ragged": ragged,
}


def run_pipeline(case: FeatureCase) -> dict[str, Any]:
    return FEATURES[case.feature](case, True)


def run_reference(case: FeatureCase) -> dict[str, Any]:
    return FEATURES[case.feature](case, False)
