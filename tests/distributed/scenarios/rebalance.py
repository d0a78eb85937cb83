"""Dynamic rebalancing on real ranks (tests/distributed/test_rebalance.py): a slow layer, a slowed rank, a checkpoint
saved after a rebalance and resumed; each against the same module trained on one device."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, TypedDict

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import NotRequired

from lightning_pipe import PipelineStrategy, PipelineTimeline
from tests.models import WIDTH, Block, ToyRegressor, loader, reference_train_loader, regression_data


@dataclass(frozen=True)
class RebalanceCase:
    """A ToyRegressor (AdamW + StepLR) whose blocks sleep ``base_s`` per call; one block ``slow_s`` instead
    (``slow_layer``), and every block on global rank ``slow_rank`` ``rank_delay_s`` more."""

    partition: tuple[int, ...] | str = "uniform"
    n_layers: int = 8
    base_s: float = 0.005
    slow_layer: int | None = None
    slow_s: float = 0.02
    slow_rank: int | None = None
    rank_delay_s: float = 0.0
    tied: bool = False  # the head reuses the first layer's weight
    tie_blocks: tuple[int, int] | None = None  # (a, b): block b uses block a's fc.weight
    dp: int = 1  # data-parallel replicas (world = 2 x dp)
    timeline: bool = False  # record every step with PipelineTimeline (its recorder must follow the new engine)
    every: int = 4
    threshold: float = 0.15  # well above the noise of 2 shared cores; the moves tested predict 35-50 %
    steps: int = 8
    microbatches: int = 2
    batch: int = 8
    ckpt: str | None = None  # a directory: checkpoint at the end of the (one-epoch) fit, then resume from it
    resume_steps: int = 2
    resume_rebalance: bool = False  # the resumed run rebalances too (same settings), else uniform, no rebalancing
    expect_error: bool = False


class RebalanceResult(TypedDict):
    params: dict[str, torch.Tensor]
    losses: list[float]
    topology: tuple[int, int]
    layers: list[int]  # layer indices this rank holds at the end
    logged: list[str]  # rank 0: the rebalance log lines
    events: list[dict[str, Any]]  # every decision: step, proposed split, moves
    timeline: NotRequired[list[int]]  # per recorded step, its forward slices (the last ones: after the rebalance)
    resumed: NotRequired[dict[str, torch.Tensor]]  # params after resuming from the checkpoint
    resumed_start: NotRequired[list[int]]  # resume_rebalance: layers per stage right after the checkpoint loaded
    resumed_events: NotRequired[list[dict[str, Any]]]  # resume_rebalance: the resumed run's decisions


class SleepyBlock(Block):
    """A residual block that pauses per call: ``delay_s`` always, ``rank_delay_s`` more on ``slow_rank``."""

    def __init__(self, width: int, delay_s: float, slow_rank: int | None, rank_delay_s: float) -> None:
        super().__init__(width)
        self.delay_s, self.slow_rank, self.rank_delay_s = delay_s, slow_rank, rank_delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delay = self.delay_s
        if self.slow_rank is not None and dist.is_initialized() and dist.get_rank() == self.slow_rank:
            delay += self.rank_delay_s
        if delay > 0:
            time.sleep(delay)
        return super().forward(x)


class RebalanceModel(ToyRegressor):
    def __init__(self, case: RebalanceCase) -> None:
        super().__init__(n_layers=case.n_layers, optimizer="adamw", lr=0.02, tied=case.tied)
        for i in range(1, case.n_layers - 1):
            delay = case.slow_s if i == case.slow_layer else case.base_s
            block = SleepyBlock(WIDTH, delay, case.slow_rank, case.rank_delay_s)
            block.load_state_dict(self.layers[i].state_dict())
            self.layers[i] = block
        if case.tie_blocks is not None:
            a, b = case.tie_blocks
            self.layers[b].fc.weight = self.layers[a].fc.weight


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "rebalance" in record.getMessage():
            self.lines.append(record.getMessage())


def _trainer(steps: int, strategy: Any, devices: int, callbacks: list[Any]) -> L.Trainer:
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                     enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)


def _data(case: RebalanceCase) -> Any:
    # one epoch (the checkpoint is at its end); each replica reads `batch` rows of the global batch per step
    return loader(regression_data(case.batch * case.dp * case.steps), case.batch)


def run_reference(case: RebalanceCase, steps: int) -> dict[str, Any]:
    """The same module on one device (no process group: no rank delays), ``steps`` optimizer steps."""
    model, losses = RebalanceModel(case), _Losses()
    # the order Lightning's DistributedSampler (shuffle, seed 0) gives the pipeline's one replica
    data = reference_train_loader(regression_data(case.batch * case.dp * case.steps), case.batch * case.dp)
    _trainer(steps, "auto", 1, [losses]).fit(model, data)
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "losses": losses.losses}


def run_rebalance(case: RebalanceCase) -> RebalanceResult:
    devices = int(os.environ["TEST_WORLD_SIZE"])
    strategy = PipelineStrategy(schedule="1f1b", microbatches=case.microbatches, partition=case.partition,
                                data_parallel_size=case.dp, rebalance_every_n_steps=case.every, rebalance_threshold=case.threshold)
    capture = _Capture()
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    log.addHandler(capture)
    model, losses = RebalanceModel(case), _Losses()
    # Saved after the last batch (every_n_train_steps): resuming from there is exact in Lightning (a save from
    # on_train_epoch_end replays one batch on resume, on one device too).
    saver = ([ModelCheckpoint(dirpath=case.ckpt, filename="end", every_n_train_steps=case.steps)]
             if case.ckpt is not None else [])
    timeline = [PipelineTimeline(log=False, warmup_steps=0)] if case.timeline else []
    trainer = _trainer(case.steps, strategy, devices, [losses, *saver, *timeline])
    try:
        trainer.fit(model, _data(case))
    finally:
        log.removeHandler(capture)
    assert strategy.topology is not None
    layout = model._pipeline_layout
    held = [i for s in layout.plan.stages_of_rank(strategy.topology.pp_rank) for i in layout.ranges[s]]
    history = strategy.rebalancer.history if strategy.rebalancer is not None else []
    result = RebalanceResult(
        params={k: v.detach().clone() for k, v in model.named_parameters()}, losses=losses.losses,
        topology=(strategy.topology.dp_rank, strategy.topology.pp_rank), layers=held, logged=capture.lines,
        events=[{"step": e.step, "proposed": list(e.decision.proposed), "gain": e.decision.gain,
                 "speeds": list(e.decision.speeds), "costs": list(e.decision.costs),
                 "moves": [(m.layer, m.src, m.dst) for m in e.decision.moves]} for e in history])
    if timeline:
        recorder = timeline[0].recorder
        assert recorder is not None
        recorded = [i for sm in recorder.engine.stage_modules for i in sm.layer_indices]
        assert recorded == held, f"the recorder follows the new engine: it records layers {recorded}, not {held}"
        result["timeline"] = [sum(s.kind == "F" for s in r.slices) for r in timeline[0].records]
    if case.ckpt is not None:
        if case.resume_rebalance:  # the same settings: [Note: resuming a rebalanced run]
            again = PipelineStrategy(schedule="1f1b", microbatches=case.microbatches, partition=case.partition,
                                     data_parallel_size=case.dp, rebalance_every_n_steps=case.every,
                                     rebalance_threshold=case.threshold)
        else:  # uniform, no rebalancing
            again = PipelineStrategy(schedule="1f1b", microbatches=case.microbatches, data_parallel_size=case.dp)
        resumed, start = RebalanceModel(case), _SplitAtStart()
        _trainer(case.steps + case.resume_steps, again, devices, [start]).fit(
            resumed, _data(case), ckpt_path=f"{case.ckpt}/end.ckpt")
        result["resumed"] = {k: v.detach().clone() for k, v in resumed.named_parameters()}
        if case.resume_rebalance:
            assert again.rebalancer is not None
            result["resumed_start"] = start.counts
            result["resumed_events"] = [{"step": e.step, "proposed": list(e.decision.proposed)}
                                        for e in again.rebalancer.history]
    return result


class _SplitAtStart(L.Callback):
    """The layers per stage when training starts (after the checkpoint loaded)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.counts = [len(r) for r in pl_module._pipeline_layout.ranges]
