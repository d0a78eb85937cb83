"""Issue 14's silent-wrong-number cases, written once for both sides (pipeline ranks and the one-device reference):
variable sequence lengths, BatchNorm under shape inference, the layer I/O contract, token-weighted losses.

``run_pipeline(case)`` runs inside a launched rank; ``run_reference(case)`` trains the same module from the same seed
on one process over the global batch (per-replica batch x data-parallel size), in the order the replicas see it.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_pipe import PipelinePrecision, PipelineStrategy
from tests.distributed.scenarios.training import LossRecorder
from tests.models import (
    BNRegressor,
    DictInputsRegressor,
    DictOutRegressor,
    DictTargetRegressor,
    FlatOutRegressor,
    MetricsRegressor,
    SameOrderAsDistributedSampler,
    SkipRegressor,
    TinyLM,
    TrainingStepLoss,
    TrimmedLM,
    ViewsRegressor,
    pad_collate,
    regression_data,
    varlen_tokens,
)


@dataclass(frozen=True)
class HardeningCase:
    model: str = "skip"  # a key of MODELS
    schedule: str = "1f1b"
    microbatches: int = 4
    dp: int = 1
    fsdp: int = 1  # FSDP2 shards per stage (fsdp_size); replicas x shards read different data
    stages_per_rank: int | None = None
    actions: tuple[tuple[str, ...], ...] | None = None  # schedule="custom": per-rank compute actions
    steps: int = 3  # optimizer steps
    acc: int = 1
    batch: int = 8  # per replica
    n_data: int = 96
    optimizer: str = "sgd"
    # TinyLM only: the loss ("mean" or "sum_count"), the label of padded positions (0: counted, -100: ignored) and
    # the fraction of labels masked to -100 inside the sequences
    loss: str = "mean"
    pad_label: int = -100
    mask_prob: float = 0.0
    precision: str = "32-true"  # "16-mixed": fp16 AMP on CPU with a loss scaler (plugins passed explicitly)
    validate: bool = False  # validation during fit (every 2 batches) and trainer.validate
    predict: bool = False  # trainer.predict over 22 sequences / samples (short last batch)
    expect_error: bool = False


MODELS: dict[str, Callable[[HardeningCase], L.LightningModule]] = {
    "skip": lambda c: SkipRegressor(optimizer=c.optimizer),
    "bn": lambda c: BNRegressor(optimizer=c.optimizer),
    "dict_out": lambda c: DictOutRegressor(),
    "dict_inputs": lambda c: DictInputsRegressor(),
    "dict_target": lambda c: DictTargetRegressor(optimizer=c.optimizer),
    "views": lambda c: ViewsRegressor(optimizer=c.optimizer),
    "lm": lambda c: TinyLM(loss=c.loss, optimizer=c.optimizer, lr=0.1 if c.optimizer == "sgd" else 0.02),
    # issue 24: each micro-batch trimmed to its own length (trim_microbatch)
    "lm_trim": lambda c: TrimmedLM(loss=c.loss, optimizer=c.optimizer, lr=0.1 if c.optimizer == "sgd" else 0.02),
    # what training_step returns ([Note: the loss a training step returns])
    "scaled_loss": lambda c: TrainingStepLoss("scaled", optimizer=c.optimizer),
    "loss_twice": lambda c: TrainingStepLoss("twice", optimizer=c.optimizer),
    "dict_loss": lambda c: TrainingStepLoss("dict", optimizer=c.optimizer),
    # sums reduced across ranks, by self.log and by torchmetrics ([Note: what sync_dist reduces over])
    "metrics": lambda c: MetricsRegressor(optimizer=c.optimizer),
    # an output without the batch in dim 0: refused in evaluation ([Note: evaluation outputs are joined along dim 0])
    "flat_out": lambda c: FlatOutRegressor(optimizer=c.optimizer),
}


def _is_lm(case: HardeningCase) -> bool:
    return case.model in ("lm", "lm_trim")


def _data(case: HardeningCase, n: int, seed: int = 1) -> Any:
    return varlen_tokens(n, seed=seed, mask_prob=case.mask_prob) if _is_lm(case) else regression_data(n, seed=seed)


def _loader(case: HardeningCase, data: Any, batch: int, reference_train: bool = False, drop_last: bool = True
            ) -> DataLoader:
    collate = pad_collate(case.pad_label) if _is_lm(case) else None
    if reference_train:  # the order Lightning's DistributedSampler gives the replicas, whole global batches
        return DataLoader(data, batch_size=batch, sampler=SameOrderAsDistributedSampler(len(data)), drop_last=True,
                          collate_fn=collate)
    return DataLoader(data, batch_size=batch, shuffle=False, drop_last=drop_last, collate_fn=collate)


class Recorder(LossRecorder):
    """The training scenarios' recorder, plus step times and the engine's shape-inference count."""

    def __init__(self) -> None:
        super().__init__()
        self.step_seconds: list[float] = []
        self.inferences: list[int] = []
        self.dp_sync: dict[str, int] = {}  # the engine's data-parallel sync counts after the last batch
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        super().on_train_batch_end(trainer, *args)
        engine = getattr(trainer.strategy, "engine", None)
        self.inferences.append(engine.shape_inferences if engine is not None else 0)
        self.dp_sync = dict(engine.dp_sync_counts) if engine is not None else {}


def _trainer(case: HardeningCase, pipeline: bool, recorder: Callback) -> L.Trainer:
    strategy: Any = "auto"
    devices = 1
    if pipeline:
        options = {"actions": [list(row) for row in case.actions]} if case.actions is not None else None
        strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                    data_parallel_size=case.dp, fsdp_size=case.fsdp,
                                    stages_per_rank=case.stages_per_rank,
                                    schedule_options=options)
        devices = int(os.environ["TEST_WORLD_SIZE"])  # Lightning deletes WORLD_SIZE at teardown
    precision: dict[str, Any] = {"precision": case.precision}
    if case.precision == "16-mixed":  # Lightning would turn "16-mixed" into bf16 on CPU
        precision = {"plugins": [PipelinePrecision("16-mixed", device="cpu") if pipeline else
                                 MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=case.steps, **precision,
                     accumulate_grad_batches=case.acc, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=3, val_check_interval=2, check_val_every_n_epoch=None, callbacks=[recorder])


def _run(case: HardeningCase, pipeline: bool) -> dict[str, Any]:
    torch.manual_seed(1234)
    model = MODELS[case.model](case)
    data = _data(case, case.n_data)
    batch = case.batch * (1 if pipeline else case.dp * case.fsdp)
    recorder = Recorder()
    trainer = _trainer(case, pipeline, recorder)
    val = _loader(case, _data(case, 40, seed=3), batch, drop_last=False) if case.validate else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(case, data, batch, reference_train=not pipeline), val)
    out: dict[str, Any] = {
        # FSDP shards: whole tensors (collective, the same order on every shard)
        "params": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "losses": recorder.losses, "fit_val_losses": recorder.val_losses,
        "step_seconds": recorder.step_seconds, "inferences": recorder.inferences, "scales": recorder.scales,
        "warnings": [str(w.message) for w in caught if "BatchNorm" in str(w.message)],
    }
    if case.validate:
        out["val_metrics"] = {k: float(v) for k, v in trainer.validate(model, val, verbose=False)[0].items()}
        out["val_loss"] = out["val_metrics"]["val_loss"]
    if case.predict:
        preds = trainer.predict(model, _loader(case, _data(case, 22, seed=7), case.batch, drop_last=False))
        out["predictions"] = preds if preds and preds[0] is not None else None
    if pipeline:
        out["topology"] = (trainer.strategy.topology.dp_rank, trainer.strategy.topology.pp_rank)
        out["dp_sync"] = recorder.dp_sync
    return out


def run_pipeline(case: HardeningCase) -> dict[str, Any]:
    return _run(case, pipeline=True)


def run_reference(case: HardeningCase) -> dict[str, Any]:
    return _run(case, pipeline=False)
