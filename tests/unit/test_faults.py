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
        self.requeue_pending = False

    def sigterm_received(self, signum: int) -> None:
        self.signals.append(signum)


def test_signal_handlers_only_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's SIGTERM handler broadcasts inside the handler (the 11-of-13 hang) and its SLURM requeue handler
    saves a checkpoint there; ours must not touch the network."""
    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective ran inside the SIGTERM handler")

    monkeypatch.setattr(dist, "broadcast", no_collective)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    faults = RecordingFaults()
    connector = PipelineSignalConnector(trainer, faults)  # type: ignore[arg-type]
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert faults.signals == [signal.SIGTERM] and not connector.received_sigterm  # Lightning's stop comes later
    monkeypatch.setattr(trainer, "save_checkpoint", no_collective)
    connector._slurm_sigusr_handler_fn(signal.SIGUSR1, None)  # Lightning's saves a checkpoint right here
    assert faults.requeue_pending
    assert connector.__getstate__()["faults"] is None  # picklable for spawned ranks


def test_private_lightning_attributes_exist() -> None:
    """faults.py swaps the trainer's signal connector and asks ModelCheckpoint when it last saved."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert hasattr(trainer, "_signal_connector") and hasattr(trainer._signal_connector, "received_sigterm")
    assert isinstance(trainer.callbacks, list)
    assert hasattr(ModelCheckpoint(save_last=True), "_last_global_step_saved")


def test_sigterm_and_requeue_are_acted_on_after_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank (the all-reduce returns the flags as they are): requeue once per run, in training at the end of the
    batch whose optimizer step closes the accumulation window; SIGTERM at the step that closes the window in
    training, at once in evaluation."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_pipe.lightning import faults as faults_module

    calls: list[str] = []
    monkeypatch.setattr(faults_module, "any_rank", lambda flags, device, group=None: list(flags))
    connector = SimpleNamespace(run_requeue=lambda: calls.append("requeue"), received_sigterm=False)
    progress = SimpleNamespace(is_last_batch=False)
    accumulating = [True]  # Lightning's rule: does the current batch only accumulate?
    fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress),
                               _should_accumulate=lambda: accumulating[0])
    trainer = SimpleNamespace(_signal_connector=connector, accumulate_grad_batches=2, global_step=3, training=True,
                              fit_loop=fit_loop, state=SimpleNamespace(fn="validate"),
                              validate_loop=SimpleNamespace(batch_progress=progress))
    strategy = SimpleNamespace(root_device="cpu", global_rank=0, launcher=None)
    watch = SimpleNamespace(clear_deadline=lambda: calls.append("clear"),
                            set_deadline=lambda *args: calls.append("deadline"), heartbeat=None)
    faults = faults_module.PipelineFaults(strategy, trainer, watch)  # type: ignore[arg-type]

    faults.requeue_pending = True
    faults.after_step("train", 0)
    faults._hooks.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    assert calls == []  # batch 0 of a window of 2: the checkpoint would miss its gradients
    accumulating[0] = False
    faults.after_step("train", 1)  # the same signal seen a step later on another rank: no second requeue
    assert calls == []  # the training step ran, its optimizer step has not
    faults._hooks.on_train_batch_end(trainer, None, None, None, 1)  # type: ignore[arg-type]
    faults._hooks.on_train_batch_end(trainer, None, None, None, 2)  # type: ignore[arg-type]
    assert calls == ["requeue"]
    faults.sigterm_received(signal.SIGTERM)
    assert calls == ["requeue", "deadline"]
    faults.after_step("train", 2)  # batch 2 of windows of 2: the optimizer has not stepped yet
    assert faults.stopping and calls[-1] == "clear" and not connector.received_sigterm
    faults.after_step("train", 3)
    assert connector.received_sigterm  # Lightning raises SIGTERMException after this batch's optimizer step
    with pytest.raises(SIGTERMException):
        faults.after_step("validate", 0)

    evaluating = faults_module.PipelineFaults(strategy, SimpleNamespace(**{**vars(trainer), "training": False}),
                                              watch)  # type: ignore[arg-type]
    evaluating.requeue_pending = True
    evaluating.after_step("validate", 0)
    assert calls[-1] == "requeue"  # outside training: after the current batch


def test_ranks_whose_data_ends_at_different_batches_raise_naming_who_ran_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags "last batch here" / "more here" ride in the per-step all-reduce; both set: every rank raises, with
    who ran out after how many batches (one gather, on this path only)."""
    from types import SimpleNamespace

    from lightning_pipe.config import PipelineConfigError
    from lightning_pipe.lightning import faults as faults_module

    reduced: list[list[bool]] = []

    def all_reduce(flags: list[bool], device: object, group: object = None) -> list[bool]:
        reduced.append(list(flags))
        return [False, False, True, True]  # some rank's last batch, another's not

    def all_gather_object(out: list[object], obj: object, group: object = None) -> None:
        out[:] = [(0, False), obj, (2, True)]

    monkeypatch.setattr(faults_module, "any_rank", all_reduce)
    monkeypatch.setattr(faults_module.dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(faults_module.dist, "all_gather_object", all_gather_object)
    progress = SimpleNamespace(is_last_batch=True)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    strategy = SimpleNamespace(root_device="cpu", global_rank=1, launcher=None)
    faults = faults_module.PipelineFaults(strategy, trainer, SimpleNamespace())  # type: ignore[arg-type]
    with pytest.raises(PipelineConfigError, match=r"training data ends at different batches: rank\(s\) \[1, 2\] ran "
                                                  r"out after 3 batches \(batch_idx 2 was their last\) while "
                                                  r"rank\(s\) \[0\] have more.*Trainer\(limit_train_batches=...\)"):
        faults.after_step("train", 2)
    assert reduced == [[False, False, True, False]]  # one all-reduce: SIGTERM, requeue, last here, more here
