"""The host-device sync scenario (tests/distributed/test_sync_points.py): count every call that would make the host
wait for the device (``Tensor.item`` / ``tolist`` / ``cpu`` / ``__bool__`` / ``__float__`` / ``__int__``, CUDA
synchronisation and event queries) during training steps, per call site.

On CPU these calls cost nothing, but each is a stall on CUDA: the counter sees them here so a test fails when a new
one appears on the step path, on a machine without a GPU. A call is charged to the frame that made it (the
immediate caller): ours when that frame is in ``lightning_pipe/``, else torch's or Lightning's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from torch.utils.data import TensorDataset

from lightning_pipe import PipelineStrategy
from tests.models import TinyLM, ToyRegressor, loader, regression_data

PACKAGE = str(Path(__file__).resolve().parents[3] / "lightning_pipe")

# (owner, attribute): what makes the host wait for the device's queue to drain (up to that tensor)
TENSOR_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list", "reduce")
CUDA_SYNCS = ((torch.cuda, "synchronize"), (torch.cuda.Event, "query"), (torch.cuda.Event, "synchronize"),
              (torch.cuda.Stream, "synchronize"), (torch.cuda.Stream, "query"))


@dataclass(frozen=True)
class SyncCase:
    """``steps`` training steps of a quiet ToyRegressor; the first ``warmup`` (shape inference) are not counted."""

    model: str = "toy"  # "toy" (a mean loss), "lm_pair" (a token model's (sum, count) loss), "lm_tied" (its
    # embedding and head tied: across the ranks at pipeline 2)
    schedule: str = "1f1b"
    microbatches: int = 4
    dp: int = 1
    stages_per_rank: int | None = None
    n_layers: int = 8
    steps: int = 3
    warmup: int = 1
    acc: int = 1
    clip: float | None = None
    expect_error: bool = False


class SyncResult(TypedDict):
    ours: dict[str, int]  # "file:line function kind" -> calls during the counted steps, frames in lightning_pipe/
    others: dict[str, int]  # the same for calls made by torch's or Lightning's own frames
    counted_steps: int
    fast_log: list[bool]  # per counted batch: self.log's fast metric move installed ([Note: self.log's move to the device it is on])
    fast_log_after: bool  # still installed after fit (must not be: teardown undoes it)
    kept_outputs: list[int]  # per counted batch, after it: last-stage outputs the stages still hold
    collectives: dict[str, int]  # torch.distributed collective -> calls during the counted steps (P2P not counted)


class SyncCounter:
    """Patches the sync points while ``armed``; keeps per call site counts."""

    def __init__(self) -> None:
        self.ours: Counter[str] = Counter()
        self.others: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self.armed = False

    def _wrap_collective(self, name: str, original: Any) -> Any:
        counter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            if counter.armed:
                counter.collectives[name] += 1
            return original(*args, **kwargs)

        return counted

    def _wrap(self, kind: str, original: Any) -> Any:
        counter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            if counter.armed:
                frame = sys._getframe(1)
                where = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name} {kind}"
                mine = frame.f_code.co_filename.startswith(PACKAGE)
                (counter.ours if mine else counter.others)[where.replace(PACKAGE, "lightning_pipe")] += 1
            return original(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def patched(self) -> Iterator[SyncCounter]:
        targets = [(torch.Tensor, name) for name in TENSOR_SYNCS] + list(CUDA_SYNCS)
        saved = [(owner, name, owner.__dict__.get(name)) for owner, name in targets]
        saved += [(dist, name, getattr(dist, name)) for name in COLLECTIVES]
        try:
            for owner, name in targets:
                setattr(owner, name, self._wrap(name, getattr(owner, name)))
            for name in COLLECTIVES:
                setattr(dist, name, self._wrap_collective(name, getattr(dist, name)))
            yield self
        finally:
            for owner, name, original in saved:
                if original is None:
                    delattr(owner, name)  # inherited (Tensor's from torch._C.TensorBase): the base's is back
                else:
                    setattr(owner, name, original)


class QuietRegressor(ToyRegressor):
    """ToyRegressor without its test hook that reads every gradient's norm on the host before the optimizer step."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.calls["on_before_optimizer_step"] += 1


class Arm(Callback):
    """Counts from the start of batch ``warmup`` to the end of the last: training_step (the schedule), Lightning's
    backward (the gradient hand-over), clipping, the optimizer step, the loss logging."""

    def __init__(self, counter: SyncCounter, warmup: int) -> None:
        self.counter, self.warmup, self.counted = counter, warmup, 0
        self.fast_log: list[bool] = []
        self.kept_outputs: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.counter.armed = batch_idx >= self.warmup
        self.counted += self.counter.armed
        if self.counter.armed:
            self.fast_log.append(fast_log_installed())

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.counter.armed:  # [Note: no outputs kept by a training step]
            stages = trainer.strategy.engine.stages  # type: ignore[attr-defined]
            self.kept_outputs.append(sum(len(getattr(stage, "output_chunks", ())) for stage in stages))
        self.counter.armed = False


class QuietLM(TinyLM):
    """TinyLM (token-weighted loss) without the host read of every gradient's norm."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.calls["on_before_optimizer_step"] += 1


def _data(case: SyncCase, n: int) -> TensorDataset:
    if case.model == "toy":
        return regression_data(n)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (n, 9), generator=g)
    labels = tokens[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.3] = -100  # replicas hold different target counts
    return TensorDataset(tokens[:, :-1], labels)


def fast_log_installed() -> bool:
    return hasattr(_ResultMetric.__dict__["to"], "_lightning_pipe_original")


def run_syncs(case: SyncCase) -> SyncResult:
    torch.manual_seed(0)
    model = (QuietRegressor(n_layers=case.n_layers) if case.model == "toy"
             else QuietLM(n_layers=case.n_layers, loss="sum_count"))
    if case.model == "lm_tied":  # the head's (vocab, width) weight is the embedding's
        model.layers[-1].weight = model.layers[0].weight
    batch = case.microbatches * 2
    counter = SyncCounter()
    arm = Arm(counter, case.warmup * case.acc)
    strategy = PipelineStrategy(schedule=case.schedule, microbatches=case.microbatches,
                                stages_per_rank=case.stages_per_rank, data_parallel_size=case.dp)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["TEST_WORLD_SIZE"]),
                        max_steps=case.steps, accumulate_grad_batches=case.acc, gradient_clip_val=case.clip,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[arm])
    with counter.patched():
        trainer.fit(model, loader(_data(case, batch * case.steps * case.acc * case.dp), batch))
    return SyncResult(ours=dict(counter.ours), others=dict(counter.others), counted_steps=arm.counted,
                      fast_log=arm.fast_log, fast_log_after=fast_log_installed(), kept_outputs=arm.kept_outputs,
                      collectives=dict(counter.collectives))
