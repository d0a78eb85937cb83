"""[Note: self.log's move to the device it is on] (lightning_pipe/_compat/lightning.py): while a PipelineStrategy
runs, Lightning's per-call move of a logged metric to the device it already lies on returns the metric as it is;
every other move takes Lightning's own path, and the logged numbers are the same."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

from lightning_pipe._compat import lightning as _compat

CPU, META = torch.device("cpu"), torch.device("meta")


def _metric() -> _ResultMetric:
    meta = _Metadata(fx="training_step", name="loss")
    meta.sync = _Sync()
    return _ResultMetric(meta, is_tensor=True)


@pytest.fixture
def fast() -> Iterator[None]:
    undo = _compat.fast_metric_moves()
    yield
    undo()


def test_a_move_to_where_the_metric_is_returns_it_unchanged(fast: None) -> None:
    metric = _metric()
    before = dict(vars(metric))
    assert metric.to(CPU) is metric
    assert all(vars(metric)[k] is v for k, v in before.items())  # nothing rebuilt (Lightning deep-copies meta)


def test_any_other_move_takes_lightnings_path(fast: None) -> None:
    metric = _metric()
    metric.to(META)
    assert metric.value.device == META and metric.cumulated_batch_size.device == META
    metric = _metric()
    metric.to(device=CPU)  # not the call self.log makes: Lightning's path, the same result
    assert metric.value.device == CPU


@dataclasses.dataclass
class _Holder:
    tensor: torch.Tensor


@pytest.mark.parametrize("value,on_cpu", [
    (torch.zeros(1), True),
    (torch.zeros(1, device=META), False),
    ({"a": [1, "x", None, (torch.zeros(1),)]}, True),
    ({"a": [1, "x", None, (torch.zeros(1, device=META),)]}, False),
    (_Holder(torch.zeros(1, device=META)), False),
    (_Holder(torch.zeros(1)), True),
    (_metric(), False),  # a metric inside a metric: always Lightning's path
    (torch.nn.Linear(1, 1).to(META), True),  # a plain module: apply_to_collection leaves it as it is
], ids=["tensor", "tensor-elsewhere", "nested", "nested-elsewhere", "dataclass-elsewhere", "dataclass", "metric",
        "module"])
def test_already_on_reaches_what_apply_to_collection_reaches(value: object, on_cpu: bool) -> None:
    assert _compat._already_on([value], CPU) is on_cpu


def test_installs_nest_and_the_last_undo_restores() -> None:
    original = _ResultMetric.__dict__["to"]
    first, second = _compat.fast_metric_moves(), _compat.fast_metric_moves()
    first()
    first()  # an undo runs once
    assert _ResultMetric.__dict__["to"] is not original
    second()
    assert _ResultMetric.__dict__["to"] is original


class _Logs(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        self.log("mean", float(batch_idx), on_step=False, on_epoch=True)
        self.log("max", torch.tensor(float(batch_idx)), reduce_fx="max", on_step=True, on_epoch=True)
        self.log("weighted", torch.tensor(float(batch_idx)), on_epoch=True, batch_size=batch_idx + 1)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _logged(fast: bool) -> dict[str, float]:
    undo = _compat.fast_metric_moves() if fast else (lambda: None)
    try:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(_Logs(), torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2))
    finally:
        undo()
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_logged_values_are_the_same() -> None:
    fast, slow = _logged(fast=True), _logged(fast=False)
    assert fast == slow
    assert fast["mean"] == 1.5 and fast["max_epoch"] == 3.0 and fast["weighted"] == pytest.approx(20 / 10)
