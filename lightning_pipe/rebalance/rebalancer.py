"""Dynamic rebalancing: move layers between pipeline ranks mid-run when measured times say another split is faster.

``PipelineStrategy(rebalance_every_n_steps=N, rebalance_threshold=t)``: during the last few optimizer steps before
every N-th, each rank times its layers ([Note: how layer times are measured] in measure.py); at the N-th step
boundary the times are gathered on every rank, every rank computes the same decision ([Note: layer cost versus rank
speed], [Note: the predicted step time] in decide.py), and when the predicted gain exceeds ``t`` the layers move,
with their optimizer state ([Note: moving a layer] in move.py), and the engine is rebuilt for the new split.
Training stays exact: the same layers run the same arithmetic, only on other ranks.

The Lightning side (which step is a boundary, re-pointing what holds the engine, logging) is
``lightning_pipe/lightning/rebalancing.py``; this package does not import Lightning.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.layers.partition import counts_of
from lightning_pipe.rebalance.decide import Decision, LayerTime, Move, decide, describe, moves_between
from lightning_pipe.rebalance.measure import LayerTimer
from lightning_pipe.rebalance.move import move_layers, rebuild_engine
from lightning_pipe.runtime.build import PipelineLayout
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.schedules import SchedulePlan

# [Note: resuming a rebalanced run]
# A checkpoint holds parameters by name, whatever the split (it resumes into any layout), and records the split it
# was saved with. A run that rebalances and resumes from a checkpoint a rebalancing run saved goes back to that
# split right after loading (the same layers move, with their optimizer state, as at a decision) when its plan has
# the same stages (same schedule and pipeline size; a checkpoint of a run without rebalancing keeps the configured
# split: it was the user's choice, not the rebalancer's), and counts its cadence from the checkpoint's step: it then
# decides at the same steps, on the same split, as the run that was never interrupted. Without this it would restart on the configured split and move only one period later.

MEASURED_STEPS = 5
"""Optimizer steps timed before each decision (fewer when N is smaller; never the first batch after a rebuild);
each layer's time is the median over them."""


def check_rebalance(config: PipelineConfig, plan: SchedulePlan) -> None:
    """What rebalancing cannot do, refused on plain data on every rank before any engine exists."""
    if config.rebalance_every_n_steps is not None and plan.spec.engine is not None:
        raise config_error(
            f"Rebalancing rebuilds a one-pipeline engine; schedule {plan.spec.name!r} runs its own engine "
            f"({plan.spec.engine.__name__}) with its own placement of stages.",
            f"schedule={plan.spec.name!r} with rebalance_every_n_steps={config.rebalance_every_n_steps}",
            "rebalance_every_n_steps", "set it to None for this schedule", also=("schedule",))
    if config.rebalance_every_n_steps is not None and config.fsdp_size > 1:
        raise config_error(
            "Rebalancing moves whole layers (parameters and optimizer state) between pipeline ranks; FSDP stages "
            "hold shards, which it does not move.",
            f"fsdp_size={config.fsdp_size} with rebalance_every_n_steps={config.rebalance_every_n_steps}",
            "rebalance_every_n_steps", "set it to None, or fsdp_size=1", also=("fsdp_size",))
    if config.rebalance_every_n_steps is not None and plan.spec.stage_class is not None:
        raise config_error(
            "Rebalancing moves layers between ranks between steps; a schedule that keeps weight versions in its "
            "stages (PipeDream-2BW) carries stashed weights across steps that would be left behind.",
            f"schedule={plan.spec.name!r} with rebalance_every_n_steps={config.rebalance_every_n_steps}",
            "rebalance_every_n_steps", "set it to None for this schedule", also=("schedule",))


@dataclass(frozen=True)
class RebalanceEvent:
    step: int
    """Optimizer steps completed when the decision was taken (the trainer's global step)."""
    decision: Decision

    def describe(self) -> list[str]:
        return describe(self.decision, self.step)


class Rebalancer:
    """Decides and runs rebalances of one module's pipeline; owned by the strategy, fed at each optimizer step."""

    def __init__(self, config: PipelineConfig, module: nn.Module, engine: PipelineEngine,
                 layout: PipelineLayout) -> None:
        assert config.rebalance_every_n_steps is not None
        self.every = config.rebalance_every_n_steps
        self.threshold = config.rebalance_threshold
        self.config = config
        self.module = module
        self.layout = layout
        self.steps = 0
        self.history: list[RebalanceEvent] = []
        self.engine = engine
        self.timer = LayerTimer(engine).attach()
        self._arm()

    def _arm(self) -> None:
        window = min(MEASURED_STEPS, self.every)
        self.timer.armed = self.every - self.steps % self.every <= window

    def after_optimizer_step(self, optimizers: Sequence[torch.optim.Optimizer], step: int | None = None
                             ) -> tuple[RebalanceEvent | None, PipelineEngine]:
        """After an optimizer step (``step``: optimizer steps completed with it, e.g. the trainer's global step, so
        a resumed run keeps the cadence; ``None``: counted here). Every N-th, decide and maybe move. Returns the
        event (``None``: no decision taken) and the engine to use from now on. Collective on the N-th step."""
        self.steps = self.steps + 1 if step is None else step
        event = None
        if self.steps % self.every == 0:
            decision = self._decide()
            self.timer.reset()
            if decision is not None:
                event = RebalanceEvent(self.steps, decision)
                self.history.append(event)
                if decision.rebalance:
                    self._apply(decision.moves, decision.proposed, optimizers)
        self._arm()
        return event, self.engine

    def resume(self, step: int, saved: Sequence[Sequence[int]] | None,
               optimizers: Sequence[torch.optim.Optimizer]) -> tuple[Move, ...] | None:
        """After a checkpoint saved at optimizer step ``step`` was loaded: keep the cadence from there, and go back
        to the split the run had when it was saved (``saved``: its layer ranges per stage) when this run's plan can
        hold it. [Note: resuming a rebalanced run]. Returns the moves made (``None``: the split stays). Collective."""
        self.steps = step
        moves = None
        current = counts_of(self.layout.ranges)
        counts = [len(r) for r in saved] if saved is not None else None
        if (counts is not None and len(counts) == len(current) and sum(counts) == sum(current) and min(counts) > 0
                and list(counts) != list(current)):
            plan = self.layout.plan
            moves = moves_between(current, counts, [plan.stage_to_rank(s) for s in range(plan.num_stages)])
            self._apply(moves, counts, optimizers)
        self.timer.reset()
        self._arm()
        return moves

    def _decide(self) -> Decision | None:
        topo = self.engine.groups.topology
        if topo.pipeline_size == 1:
            return None  # replicas only: nothing to move
        local = (self.timer.batches, self.timer.collect(topo.pp_rank))
        gathered: list[Any] = [None] * topo.world_size
        if topo.world_size > 1:
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        if any(batches == 0 for batches, _ in gathered):
            return None  # nothing measured yet on some rank (e.g. N=1 right after a rebuild)
        by_layer: dict[int, list[LayerTime]] = {}
        for _, times in gathered:
            for t in times:
                by_layer.setdefault(t.index, []).append(t)
        times = [LayerTime(i, same[0].pp_rank, same[0].kind, statistics.fmean(t.seconds for t in same))
                 for i, same in sorted(by_layer.items())]  # replicas of a layer: their mean
        plan = self.layout.plan
        stage_rank = [plan.stage_to_rank(s) for s in range(plan.num_stages)]
        return decide(times, counts_of(self.layout.ranges), stage_rank, topo.pipeline_size, self.threshold)

    def _apply(self, moves: Sequence[Move], counts: Sequence[int], optimizers: Sequence[torch.optim.Optimizer]
               ) -> None:
        old = self.engine
        self.timer.detach()  # a moving layer is pickled: it must carry none of our hooks
        move_layers(self.module, self.config.layers_attr, moves, old.groups.topology, self.layout.tied,
                    optimizers, old.device)
        self.engine, self.layout = rebuild_engine(old, self.module, self.config, self.layout, counts)
        self.timer = LayerTimer(self.engine).attach()

    def detach(self) -> None:
        self.timer.detach()


__all__ = ["RebalanceEvent", "Rebalancer", "check_rebalance"]
