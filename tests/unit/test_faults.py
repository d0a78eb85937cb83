"""The Lightning side of failures and preemption, without processes: the timeout setting, the SIGTERM handler (no
collective inside it), and the private Lightning attributes lightning_pipe/lightning/faults.py relies on."""

from __future__ import annotations

import signal
from datetime import timedelta
from typing import Any

import lightning.pytorch as L
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe import PipelineConfigError, PipelineStrategy
from lightning_pipe.lightning.faults import DEFAULT_TIMEOUT, PipelineSignalConnector, resolve_timeout


def test_timeout_default_seconds_and_timedelta() -> None:
    assert PipelineStrategy()._timeout == DEFAULT_TIMEOUT == timedelta(minutes=10)
    assert PipelineStrategy(timeout=90)._timeout == timedelta(seconds=90)  # Hydra: strategy.timeout=90
    assert PipelineStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT


@pytest.mark.parametrize("bad", [0, -5, "10m", True])
def test_a_bad_timeout_names_the_setting(bad: Any) -> None:
    with pytest.raises(PipelineConfigError, match=r"positive duration\. Got timeout=.*Change `timeout`"):
        PipelineStrategy(timeout=bad)


class RecordingFaults:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def sigterm_received(self, signum: int) -> None:
        self.signals.append(signum)


def test_sigterm_handler_only_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's handler broadcasts inside the handler (the 11-of-13 hang); ours must not touch the network."""
    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective ran inside the SIGTERM handler")

    monkeypatch.setattr(dist, "broadcast", no_collective)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    faults = RecordingFaults()
    connector = PipelineSignalConnector(trainer, faults)  # type: ignore[arg-type]
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert faults.signals == [signal.SIGTERM] and not connector.received_sigterm  # Lightning's stop comes later
    assert connector.__getstate__()["faults"] is None  # picklable for spawned ranks


def test_private_lightning_attributes_exist() -> None:
    """faults.py swaps the trainer's signal connector and asks ModelCheckpoint when it last saved."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert hasattr(trainer, "_signal_connector") and hasattr(trainer._signal_connector, "received_sigterm")
    assert isinstance(trainer.callbacks, list)
    assert hasattr(ModelCheckpoint(save_last=True), "_last_global_step_saved")
