"""``soak`` (issue 23): a few hundred tiny training steps with the timeline on, sampling what a leak would grow;
``refit``: several fits in one process, sampling what each fit would leave behind.

Each rank samples, every ``every`` steps: resident memory (``/proc/self/statm``, after ``gc.collect`` and
``malloc_trim``), open file descriptors, threads (Python's and the OS's), live tensors and the objects the garbage
collector tracks. The test judges the samples after a warm-up.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from dataclasses import dataclass
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pipe import PipelineStrategy
from lightning_pipe.lightning.callbacks import PipelineTimeline
from tests.models import ToyRegressor, loader, regression_data


@dataclass(frozen=True)
class SoakCase:
    steps: int = 240
    every: int = 20  # steps between two samples (one takes about 0.6 s: a full gc.collect)
    batches_per_epoch: int = 40  # epochs end (and validation runs) along the way
    schedule: str = "1f1b"
    timeline: bool = True  # PipelineTimeline on every step


class Sample(TypedDict):
    step: int
    rss: int  # bytes
    fds: int
    threads: int  # Python threads
    os_threads: int
    tensors: int
    objects: int  # every object the garbage collector tracks


class SoakResult(TypedDict):
    samples: list[Sample]


_LIBC = ctypes.CDLL("libc.so.6")


def _os_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def sample(step: int) -> Sample:
    gc.collect()
    _LIBC.malloc_trim(0)  # freed memory back to the OS: what stays resident is held, not the allocator's slack
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    types = [type(obj) for obj in gc.get_objects()]  # by type: isinstance on 400k objects takes 10 times longer
    tensor_types = {t for t in set(types) if issubclass(t, torch.Tensor)}
    tensors = sum(1 for t in types if t in tensor_types)
    return Sample(step=step, rss=rss, fds=len(os.listdir("/proc/self/fd")), threads=threading.active_count(),
                  os_threads=_os_threads(), tensors=tensors, objects=len(types))


class Sampler(Callback):
    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: list[Sample] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.samples.append(sample(trainer.global_step))


def run_soak(case: SoakCase) -> SoakResult:
    torch.manual_seed(0)
    model = ToyRegressor(n_layers=8)
    sampler = Sampler(case.every)
    trainer = L.Trainer(strategy=PipelineStrategy(schedule=case.schedule, microbatches=4), accelerator="cpu",
                        devices=int(os.environ["TEST_WORLD_SIZE"]), max_steps=case.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=2,
                        callbacks=[*([PipelineTimeline(every_n_steps=1, prog_bar=False)] if case.timeline else []),
                                   sampler])
    data = regression_data(8 * case.batches_per_epoch)
    trainer.fit(model, loader(data, 8), loader(data, 8))
    return SoakResult(samples=sampler.samples)


@dataclass(frozen=True)
class RefitCase:
    """Several fits in one process, each a fresh module and Trainer; the fit at ``fail_at`` ends in an exception on
    every rank (a batch with fewer rows than micro-batches) ([Note: process groups are reused])."""

    schedules: tuple[str, ...] = ("1f1b", "gpipe", "1f1b", "interleaved_1f1b", "1f1b")
    fail_at: int = 2
    expect_error: bool = False


class Fit(TypedDict):
    schedule: str
    ok: bool
    pipeline_group: int  # id() of the pipeline's process group in that fit
    os_threads: int
    fds: int


class RefitResult(TypedDict):
    fits: list[Fit]


class _GroupSeen(Callback):
    def __init__(self) -> None:
        self.group = 0

    def on_fit_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.group = id(trainer.strategy.engine.groups.pp)


def run_refit(case: RefitCase) -> RefitResult:
    fits: list[Fit] = []
    for i, schedule in enumerate(case.schedules):
        torch.manual_seed(0)
        seen = _GroupSeen()
        trainer = L.Trainer(strategy=PipelineStrategy(schedule=schedule, microbatches=4), accelerator="cpu",
                            devices=int(os.environ["TEST_WORLD_SIZE"]), max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[seen])
        ok = True
        try:
            trainer.fit(ToyRegressor(n_layers=8, tied=True), loader(regression_data(48), 3 if i == case.fail_at else 8))
        except ValueError:  # PipelineConfigError: 3 rows cannot fill 4 micro-batches, on every rank
            ok = False
        gc.collect()
        fits.append(Fit(schedule=schedule, ok=ok, pipeline_group=seen.group, os_threads=_os_threads(),
                        fds=len(os.listdir("/proc/self/fd"))))
    return RefitResult(fits=fits)
