"""The strategy's side of dynamic rebalancing (:mod:`lightning_pipe.rebalance`): when, and what to re-point.

The strategy calls :func:`start` at setup and :meth:`StrategyRebalancer.after_optimizer_step` after each real
optimizer step (Lightning calls the strategy's ``optimizer_step`` once per accumulation boundary). After a
rebalance everything that holds the engine is pointed at the new one: the strategy, the module
(``_pipeline_engine`` / ``_pipeline_layout``, so a later Trainer reuses the new cut) and the precision plugin; the
engine's step contexts (trace recorder, memory meter) are carried over by the core. Every move is logged on rank 0.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.layers.partition import counts_of
from lightning_pipe.rebalance import RebalanceEvent, Rebalancer
from lightning_pipe.rebalance.move import check_movable


class StrategyRebalancer:
    """A :class:`~lightning_pipe.rebalance.Rebalancer` wired to one PipelineStrategy's fit."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.core = Rebalancer(strategy.pipeline_config, strategy.lightning_module, strategy.engine,
                               strategy.lightning_module._pipeline_layout)

    @property
    def history(self) -> list[RebalanceEvent]:
        return self.core.history

    def after_optimizer_step(self) -> None:
        strategy = self.strategy
        # Lightning counts the step as completed after the optimizer_step hook returns: this one is global_step + 1.
        step = strategy.lightning_module.trainer.global_step + 1
        event, engine = self.core.after_optimizer_step(strategy.optimizers, step)
        if event is None or not event.decision.rebalance:
            return
        self._point_at(engine)
        rank_zero_info("\n".join(event.describe()))

    def resume(self, checkpoint: dict[str, Any], saved_layout: dict[str, Any] | None) -> None:
        """After loading a checkpoint: its step, and its split when a rebalancing run saved it with this schedule on
        this pipeline size ([Note: resuming a rebalanced run]). Collective (every rank read the same layout)."""
        before = counts_of(self.core.layout.ranges)
        topology = self.strategy.topology
        same_plan = (saved_layout is not None and saved_layout.get("rebalance_every_n_steps") is not None
                     and saved_layout.get("schedule") == self.core.config.schedule
                     and saved_layout.get("pipeline_size") == topology.pipeline_size)
        stages = saved_layout.get("stages") if same_plan and saved_layout is not None else None
        moves = self.core.resume(int(checkpoint.get("global_step", 0)), stages, self.strategy.optimizers)
        if moves is None:
            return
        self._point_at(self.core.engine)
        lines = [f"PipelineStrategy rebalance on resume at step {self.core.steps}: split {before} -> "
                 f"{counts_of(self.core.layout.ranges)} (the split the checkpoint was saved with)"]
        lines += [f"  layer {m.layer}: pipeline rank {m.src} -> {m.dst}" for m in moves]
        rank_zero_info("\n".join(lines))

    def _point_at(self, engine: Any) -> None:
        strategy, module = self.strategy, self.strategy.lightning_module
        module._pipeline_engine = engine
        module._pipeline_layout = self.core.layout
        strategy.engine = engine
        if getattr(strategy.precision_plugin, "engine", None) is not None:
            strategy.precision_plugin.engine = engine

    def detach(self) -> None:
        self.core.detach()


def check_before_split(strategy: Any, trainer: Any) -> None:
    """At setup, before the layer list is split: a fit that will rebalance checks every layer can move."""
    config = strategy.pipeline_config
    if (config.rebalance_every_n_steps is not None and trainer.state.fn == TrainerFn.FITTING
            and getattr(strategy.lightning_module, "_pipeline_layout", None) is None):
        check_movable(strategy.lightning_module, config.layers_attr, config.rebalance_every_n_steps)


def start(strategy: Any, trainer: Any) -> StrategyRebalancer | None:
    """A rebalancer for this fit, when ``rebalance_every_n_steps`` is set (``set_world_ranks`` checked it)."""
    config = strategy.pipeline_config
    if config.rebalance_every_n_steps is None:
        return None
    if trainer.state.fn != TrainerFn.FITTING:
        return None
    return StrategyRebalancer(strategy)
