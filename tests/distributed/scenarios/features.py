"""Lightning's everyday features under the pipeline (issue 45), written once for both sides: ``run_pipeline`` inside a
launched rank, ``run_reference`` on one process over the global batch. ``FEATURES`` maps a feature's name (the
keys of docs/features.md's table) to what runs; each returns this side's parameters, logged values and what the
feature produced, for tests/distributed/test_features.py to compare.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint, ModelSummary
from torch.utils.data import DataLoader

from lightning_pipe.layers.stages import RemoteLayer
from tests.distributed.scenarios.everyday import EVERYDAY
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
from tests.distributed.scenarios.feature_hf import hf_everyday
from tests.distributed.scenarios.feature_model import FeatureNet, ManualNet, PenaltyNet, classification_data


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
    folder = side(case, pipeline)
    folder.mkdir(parents=True, exist_ok=True)
    out = fit(case, pipeline)
    trainer = out.pop("trainer")
    loader = DataLoader(classification_data(22, seed=7), batch_size=case.batch)
    predict = trainer_for(case, pipeline, [RowWriter(folder, "batch"), RowWriter(folder, "epoch")])
    predict.predict(trainer.lightning_module, loader, return_predictions=False)
    return out


# ---------------------------------------------------------------------------------- item 4: checkpoints
def checkpoint(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """ModelCheckpoint's last checkpoint (sharded, or one file with ``save_consolidated``)."""
    consolidated = case.feature == "ckpt_consolidated"
    folder = side(case, pipeline) / "ckpt"
    extra = {"strategy_kwargs": {"save_consolidated": True}} if consolidated and pipeline else {}
    out = fitted(case, pipeline, callbacks=(ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0),),
                 enable_checkpointing=True, **extra)
    out["path"] = str(folder / "last.ckpt")
    return out


def resume(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """Continue from the pipeline's consolidated checkpoint for 2 more steps (both sides read the same file)."""
    path = Path(case.out_dir) / "pipeline" / "ckpt" / "last.ckpt"
    model = FeatureNet("plain", tied=case.tied)
    recorder = Recorder()
    trainer = trainer_for(case, pipeline, [recorder], max_steps=case.steps + 2)
    trainer.fit(model, train_loader(case, pipeline), val_loader(case, pipeline), ckpt_path=str(path))
    return result_of(trainer, model, recorder, pipeline)


# ---------------------------------------------------------------------------------- items 2, 3, 5 and 7
def manual(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    return fitted(case, pipeline, model=ManualNet(case.feature, tied=case.tied), keys=("loss_d",))


def ragged(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """One epoch whose last batch does not divide into the micro-batches (an IterableDataset's, or drop_last=False)."""
    return fitted(case, pipeline, max_steps=-1, max_epochs=1)


def penalty(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    return fitted(case, pipeline, model=PenaltyNet("penalty", tied=case.tied), keys=("train_aux_loss/penalty",))


def gradients(case: FeatureCase, pipeline: bool) -> dict[str, Any]:
    """A hook that clips or measures gradients itself (the mode names how), or logs a training metric."""
    return fitted(case, pipeline, keys=("grad_2.0_norm_total", "train_acc"))


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
    "train_metrics": gradients,
    "ragged": ragged,
    "ragged_too_short": ragged,
    "hf_everyday": hf_everyday,
    **EVERYDAY,
}

# The feature matrix: one launch on 2 ranks, every case against one device (tests/distributed/test_features.py);
# docs/features.md has one row per feature name, its verdict checked against these (tests/unit/test_feature_table.py).
MATRIX = [
    FeatureCase("collectives"),
    FeatureCase("prediction_writers"),
    FeatureCase("ckpt_sharded"),
    FeatureCase("ckpt_consolidated"),
    FeatureCase("ckpt_resume"),
    FeatureCase("clip_torch_norm"),
    FeatureCase("clip_torch_norm", tied=True),
    FeatureCase("clip_torch_value"),
    FeatureCase("clip_self"),
    FeatureCase("grad_norm_lightning"),
    FeatureCase("grad_norm_ours", tied=True),
    FeatureCase("penalty"),
    FeatureCase("layout"),
    FeatureCase("train_metrics"),
    FeatureCase("manual_gan"),
    FeatureCase("manual_gan", tied=True, schedule="gpipe"),
    FeatureCase("manual_alternate", schedule="zbv", stages_per_rank=2),
    FeatureCase("manual_groups"),
    FeatureCase("manual_twice", steps=1, expect_error=True),
    FeatureCase("manual_changed", steps=1, expect_error=True),
    FeatureCase("manual_tie_split", tied=True, steps=1, expect_error=True),
    # 150 samples in batches of 16: the last has 6 rows, cut 2, 2, 1, 1
    FeatureCase("ragged", stream=True, n_data=150, batch=16),
    FeatureCase("ragged", stream=True, n_data=150, batch=16, schedule="interleaved_1f1b", stages_per_rank=2),
    FeatureCase("ragged", stream=True, n_data=150, batch=16, schedule="zbv", stages_per_rank=2),
    FeatureCase("ragged", n_data=94, drop_last=False, schedule="gpipe"),  # map-style: the last batch 6 of 8
    FeatureCase("ragged_too_short", n_data=91, drop_last=False, expect_error=True),  # 3 rows for 4 micro-batches
    *(FeatureCase(name) for name in EVERYDAY if name not in ("swa", "scale_batch_size")),
    FeatureCase("hf_everyday"),
    FeatureCase("swa", steps=1, expect_error=True),
    FeatureCase("scale_batch_size", expect_error=True),
]
REFUSED = {
    "manual_twice": "training_step called compute_loss again (batch_idx 0) before manual_backward",
    "manual_changed": "training_step called manual_backward with a loss other than the one compute_loss returned",
    "manual_tie_split": "The weight tied across stages under the names ['layers.0.weight', 'layers.5.weight'] is held "
                        "by several ranks, and each copy is updated by the optimizers (and param groups) that hold it "
                        "there: rank 0: optimizer(s) [0]; rank 1: optimizer(s) [1]. The copies would train apart.",
    "ragged_too_short": "A training batch of 3 rows (the last of each epoch, batch_idx 11: 91 samples per rank in "
                        "batches of 8; refused as training starts) does not divide into microbatches=4, and 3 rows "
                        "cannot fill 4 micro-batches (one would be empty)",
    "swa": "StochasticWeightAveraging cannot run under PipelineStrategy",
    "scale_batch_size": "Tuning the batch size is currently not supported with distributed strategies.",
}
"""What every rank raises for a refused feature."""
WARNS = {"grad_norm_lightning"}
"""Features that run and warn (what they compute is not the model's)."""


def verdict(feature: str) -> str:
    """What docs/features.md says of a feature: ``works``, ``refused`` or ``warns``."""
    return "refused" if feature in REFUSED else "warns" if feature in WARNS else "works"


def run_pipeline(case: FeatureCase) -> dict[str, Any]:
    return FEATURES[case.feature](case, True)


def run_reference(case: FeatureCase) -> dict[str, Any]:
    return FEATURES[case.feature](case, False)
