"""Sharded-checkpoint scenarios (tests/distributed/test_checkpoint.py) and their single-device reference.

Three scenarios: ``ckpt_train`` (train with ModelCheckpoint, then resume from a checkpoint of it), ``ckpt_resume``
(start from a checkpoint written by any layout, or a single file) and ``ckpt_crash`` (a rank dies mid-save).
Every path a case names is absolute (the test's tmp_path).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import TensorDataset
from typing_extensions import NotRequired

from lightning_pipe import PipelineStrategy
from lightning_pipe.checkpoint import ModuleNames, write_shards
from tests.distributed.scenarios.training import LossRecorder, TrainingCase, full_tensor, tiny_gpt, token_data
from tests.models import TensorParallelRegressor, ToyRegressor, loader, reference_train_loader, regression_data


@dataclass(frozen=True)
class CheckpointCase:
    """One run of a checkpoint scenario: a ToyRegressor (AdamW + StepLR), 2 epochs of 4 steps by default."""

    schedule: str = "1f1b"
    dp: int = 1
    fsdp: int = 1  # FSDP2 shards per stage (fsdp_size)
    tp: int = 1  # tensor_parallel_size (> 1: the toy model is a TensorParallelRegressor, on every side)
    model: str = "toy"  # "gpt": the recipe's tiny GPT (tied, split by its own hook under tp > 1), on token data
    stages_per_rank: int | None = None
    microbatches: int = 4
    n_layers: int = 8
    tied: bool = False
    optimizer: str = "adamw"
    steps: int = 8
    batch: int = 8  # per replica
    steps_per_epoch: int = 4
    dir: str | None = None  # ckpt_train, ckpt_crash: ModelCheckpoint's dirpath
    resume_from: str | None = None  # ckpt_train: resume from it after the full run; ckpt_resume: start from it
    crash_rank: int | None = None  # ckpt_crash: the rank that dies in the second save
    expect_error: bool = False
    schedule_options: dict[str, Any] | None = None
    compile: bool = False  # torch.compile each layer (test_compile.py: saved compiled, loaded eager and back)
    async_save: bool = False  # PipelineStrategy(async_checkpoint=True); "last" is then a copy, not a link
    weights_only: bool | None = None  # Trainer.fit's: False trusts the checkpoint's source


class CheckpointRun(TypedDict):
    """One fit, on one rank (or the single-device reference)."""

    params: dict[str, torch.Tensor]  # at the end
    losses: list[float]
    start_params: dict[str, torch.Tensor]  # at on_train_start: what the checkpoint loaded
    start_optim: dict[str, Any]  # name-keyed optimizer state at on_train_start
    global_step: int
    topology: NotRequired[tuple[int, int]]  # pipeline only: (dp_rank, pp_rank)


class TrainThenResume(TypedDict):
    full: CheckpointRun
    resumed: NotRequired[CheckpointRun]  # when the case names resume_from


class StateAtStart(Callback):
    """The state a resumed run starts from (params and name-keyed optimizer state), after the checkpoint loaded."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.optim: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = {n: full_tensor(p) for n, p in pl_module.named_parameters()}
        self.optim = optimizer_by_name(pl_module, trainer.optimizers[0])


def optimizer_by_name(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer state keyed ``<parameter name>.<state key>``, for the parameters this rank owns."""
    layout = getattr(module, "_pipeline_layout", None)
    names = ModuleNames(module, "layers", layout.tied if layout is not None else ())
    out = {}
    for p, st in optimizer.state.items():
        if id(p) in names.owned or layout is None:
            for k, v in st.items():
                out[f"{names.name_of[id(p)]}.{k}"] = full_tensor(v) if isinstance(v, torch.Tensor) else v
    return out


def _model(case: CheckpointCase) -> L.LightningModule:
    if case.model == "gpt":
        return tiny_gpt(TrainingCase(model="gpt", n_layers=case.n_layers, tied=True, optimizer="adamw"))
    cls = TensorParallelRegressor if case.tp > 1 else ToyRegressor
    return cls(n_layers=case.n_layers, optimizer=case.optimizer, tied=case.tied)


def _data(case: CheckpointCase, n: int) -> TensorDataset:
    return token_data(n) if case.model == "gpt" else regression_data(n)


def _require(case: CheckpointCase, scenario: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(case, f) is None]
    if missing:
        raise ValueError(f"{scenario} needs {', '.join(missing)}: {case}")


def _run(case: CheckpointCase, ckpt_path: str | Path | None = None,
         callbacks: tuple[Callback, ...] = ()) -> CheckpointRun:
    torch.manual_seed(1234)
    model = _model(case)
    n_data = case.steps_per_epoch * case.batch * case.dp * case.fsdp
    recorder, start = LossRecorder(), StateAtStart()
    strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                data_parallel_size=case.dp, stages_per_rank=case.stages_per_rank,
                                fsdp_size=case.fsdp, tensor_parallel_size=case.tp,
                                schedule_options=case.schedule_options, compile=case.compile,
                                async_checkpoint=case.async_save)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[recorder, start, *callbacks], enable_checkpointing=bool(callbacks))
    trainer.fit(model, loader(_data(case, n_data), case.batch), ckpt_path=ckpt_path, weights_only=case.weights_only)
    return CheckpointRun(params={n: full_tensor(p) for n, p in model.named_parameters()},
                         losses=recorder.losses, start_params=start.params, start_optim=start.optim,
                         global_step=trainer.global_step,
                         topology=(trainer.strategy.topology.dp_rank, trainer.strategy.topology.pp_rank))


def run_train(case: CheckpointCase) -> TrainThenResume:
    """Train with ModelCheckpoint (sharded, one per epoch, "last" link); then resume from ``resume_from``."""
    _require(case, "ckpt_train", "dir")
    # Saved at the end of each epoch's last batch (every_n_train_steps): resuming from there is exact in Lightning.
    # (A save from on_train_epoch_end replays one batch on resume, on one device too; mid-epoch resumes restart
    # the epoch's data, as Lightning does for loaders without state.)
    ckpt = ModelCheckpoint(dirpath=case.dir, save_top_k=-1, every_n_train_steps=case.steps_per_epoch,
                           save_last=_last(case))
    out = TrainThenResume(full=_run(case, callbacks=(ckpt,)))
    if case.resume_from is not None:
        out["resumed"] = _run(case, ckpt_path=case.resume_from)
    return out


def run_resume(case: CheckpointCase) -> CheckpointRun:
    """Resume (``ckpt_path``) in this case's layout, from a checkpoint written by any layout or a single file."""
    _require(case, "ckpt_resume", "resume_from")
    return _run(case, ckpt_path=case.resume_from)


@contextlib.contextmanager
def dying_in_save(save_number: int, rank: int) -> Iterator[None]:
    """While active, rank ``rank`` exits (os._exit) inside its ``save_number``-th write of checkpoint shards.

    ``write_shards`` is replaced in every ``lightning_pipe`` module that holds it (whichever module the strategy
    calls it through), and restored on exit.
    """
    calls = 0

    def dying_write(state: dict[str, Any], tmp: Path, no_dist: bool = False, **kwargs: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == save_number and int(os.environ["RANK"]) == rank:
            os._exit(17)  # killed mid-save: the other ranks have started writing into the .partial directory
        return write_shards(state, tmp, no_dist, **kwargs)  # the checksums of the files written

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("lightning_pipe") and getattr(m, "write_shards", None) is write_shards]
    if not holders:
        raise RuntimeError("no lightning_pipe module holds checkpoint.write_shards: the crash would never happen")
    for module in holders:
        module.write_shards = dying_write
    try:
        yield
    finally:
        for module in holders:
            module.write_shards = write_shards


def run_crash(case: CheckpointCase) -> CheckpointRun:
    """Save every 2 steps; rank ``crash_rank`` dies in the middle of the save at step 4 (the second save; with
    asynchronous saves, whose "last" is a copy, the fourth: "last" itself, written on the saver's thread)."""
    if case.dir is None or case.crash_rank is None:
        raise ValueError(f"ckpt_crash needs dir and crash_rank: {case}")
    ckpt = ModelCheckpoint(dirpath=case.dir, save_top_k=-1, every_n_train_steps=2, save_last=_last(case))
    with dying_in_save(4 if case.async_save else 2, case.crash_rank):
        return _run(case, callbacks=(ckpt,))


def _last(case: CheckpointCase) -> bool | str:
    """ModelCheckpoint's save_last: a link to the newest checkpoint, or (asynchronous saves) a copy."""
    return True if case.async_save else "link"


@contextlib.contextmanager
def disk_full_in_save(save_number: int, rank: int) -> Iterator[None]:
    """While active, rank ``rank``'s ``save_number``-th checkpoint write fails with ENOSPC after its first item
    reached the disk (DCP's per-item writer, patched: what a full disk does mid-save)."""
    import errno

    from torch.distributed.checkpoint import filesystem

    original, saves, items = filesystem._write_item, 0, 0

    def counting_write(state: dict[str, Any], tmp: Path, no_dist: bool = False) -> dict[str, Any]:
        nonlocal saves, items
        saves, items = saves + 1, 0
        return write_shards(state, tmp, no_dist)

    def full_write(*args: Any, **kwargs: Any) -> Any:
        nonlocal items
        items += 1
        if saves == save_number and items > 1 and int(os.environ["RANK"]) == rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(*args, **kwargs)

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("lightning_pipe") and getattr(m, "write_shards", None) is write_shards]
    for module in holders:
        module.write_shards = counting_write
    filesystem._write_item = full_write
    try:
        yield
    finally:
        filesystem._write_item = original
        for module in holders:
            module.write_shards = write_shards


def run_disk_full(case: CheckpointCase) -> CheckpointRun:
    """Save every 2 steps; rank ``crash_rank``'s disk is full in the middle of the second save."""
    if case.dir is None or case.crash_rank is None:
        raise ValueError(f"ckpt_full needs dir and crash_rank: {case}")
    ckpt = ModelCheckpoint(dirpath=case.dir, save_top_k=-1, every_n_train_steps=2, save_last="link")
    with disk_full_in_save(2, case.crash_rank):
        return _run(case, callbacks=(ckpt,))


def run_reference(case: CheckpointCase, ckpt_path: str | Path | None = None, steps: int = 8
                  ) -> tuple[CheckpointRun, L.LightningModule, L.Trainer]:
    """The same module on one device, global batch, optionally resumed from a single-file checkpoint."""
    torch.manual_seed(1234)
    model = _model(case)
    recorder, start = LossRecorder(), StateAtStart()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[recorder, start])
    n = case.steps_per_epoch * case.batch * case.dp * case.fsdp
    trainer.fit(model, reference_train_loader(_data(case, n), case.batch * case.dp * case.fsdp), ckpt_path=ckpt_path)
    run = CheckpointRun(params={k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)},
                        losses=recorder.losses, start_params=start.params, start_optim=start.optim,
                        global_step=trainer.global_step)
    return run, model, trainer
