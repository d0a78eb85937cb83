"""The order of ``PipelineStrategy.setup``: check the module, choose the layout (planner or measured partition),
split it into this rank's engine, then optimizers, precision and rebalancing; and at teardown, the undoing of it and
the module's move.

Kept apart from the strategy's hooks because the order is the contract: every check that can refuse the run comes
before the split (a refused run must not hold half-moved layers), and the optimizers are built only over the layers
this rank keeps.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.config import MEASURED_PARTITIONS
from lightning_pipe.lightning.features import adapt_features
from lightning_pipe.lightning.manual import check_manual_optimization
from lightning_pipe.lightning.metrics import sync_metrics_over_data
from lightning_pipe.lightning.microbatch_updates import attach_microbatch_updates
from lightning_pipe.lightning.optimizers import check_optimizers_agree
from lightning_pipe.lightning.precision import PipelinePrecision
from lightning_pipe.lightning.preflight import (
    balance_partition,
    check_callbacks,
    check_module,
    check_plan_fits,
    log_layout,
    plan_automatically,
)
from lightning_pipe.lightning.rebalancing import check_before_split
from lightning_pipe.lightning.rebalancing import start as start_rebalancing
from lightning_pipe.parallel.fsdp import ShardingOptions
from lightning_pipe.parallel.group_cache import agree_on_kept_groups
from lightning_pipe.runtime.build import PipelineLayout, build_engine
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.schedules import plan_schedule

# ``strategy`` is the PipelineStrategy, typed ``Any`` like the adapter's other helpers: this module is imported by
# strategy.py, and the architecture test forbids import cycles (TYPE_CHECKING imports included).


def setup_pipeline(strategy: Any, trainer: Trainer) -> None:
    """``PipelineStrategy.setup``: from the whole (or meta) module to this rank's engine, optimizers and precision."""
    assert strategy.accelerator is not None
    strategy.accelerator.setup(trainer)
    module = strategy.lightning_module
    assert module is not None
    check_module(module)
    check_callbacks(trainer)
    check_plan_fits(strategy._plan_source, strategy._plan_name, module, strategy.pipeline_config.layers_attr)
    if strategy._auto and strategy.auto_plan is None:
        strategy.auto_plan, strategy.pipeline_config = plan_automatically(
            trainer, module, strategy.pipeline_config, strategy._memory_budget, strategy.world_size,
            strategy.root_device)
        strategy.plan = plan_schedule(strategy.pipeline_config, strategy._topology().pipeline_size)
    elif strategy.pipeline_config.partition in MEASURED_PARTITIONS:  # "time" / "memory": measured, then counts
        assert strategy.plan is not None
        strategy.auto_plan, strategy.pipeline_config = balance_partition(
            trainer, module, strategy.pipeline_config, strategy.plan, strategy._memory_budget, strategy.world_size,
            strategy.root_device)
    check_manual_optimization(module, strategy.plan, strategy.pipeline_config)  # lightning/manual.py
    strategy.precision_plugin.convert_module(module)
    check_before_split(strategy, trainer)  # rebalancing pickles layers: refuse one that cannot be, now
    strategy.engine = engine = _build_engine(strategy, module)  # moves this rank's layers to the device
    strategy.precision_plugin.setup(engine, strategy.root_device)
    if trainer.state.fn == TrainerFn.FITTING:
        strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    if trainer.state.fn == TrainerFn.FITTING:
        _compat.optimizers_to_device(strategy.optimizers, strategy.root_device)
        if engine.per_microbatch_updates:  # schedule=pipedream ([Note: PipeDream in Lightning's loop])
            attach_microbatch_updates(strategy, trainer)
    strategy.rebalancer = start_rebalancing(strategy, trainer)
    if strategy._undo_fast_log is None:  # [Note: self.log's move to the device it is on] (_compat/lightning.py)
        strategy._undo_fast_log = _compat.fast_metric_moves()
    if strategy._undo_metric_sync is None:  # [Note: what sync_dist reduces over] (lightning/metrics.py)
        strategy._undo_metric_sync = sync_metrics_over_data(module, engine)
    if strategy._undo_features is None:  # prediction writers, the model summary (lightning/features.py)
        strategy._undo_features = adapt_features(strategy, trainer)


def teardown_pipeline(strategy: Any) -> None:
    """``PipelineStrategy.teardown``, before the module's move: undo what setup attached (the log and metric hooks,
    the fault handling, the rebalancer), and drop the engine."""
    faults, strategy._faults = strategy._faults, None
    undo_fast_log, strategy._undo_fast_log = strategy._undo_fast_log, None
    if undo_fast_log is not None:
        undo_fast_log()
    undo_metric_sync, strategy._undo_metric_sync = strategy._undo_metric_sync, None
    if undo_metric_sync is not None:
        undo_metric_sync()
    undo_features, strategy._undo_features = strategy._undo_features, None
    if undo_features is not None:
        undo_features()
    if faults is not None:
        faults.stop()
    if strategy.rebalancer is not None:
        strategy.rebalancer.detach()  # kept (its history) until the next setup
    if strategy.lightning_module is not None:
        strategy.lightning_module._pipeline_engine = None
    if isinstance(strategy._precision_plugin, PipelinePrecision):
        strategy._precision_plugin.engine = None
    strategy.engine = None


def check_rank_optimizers(strategy: Any) -> None:
    """After ``configure_optimizers`` ran on this rank's layers: every rank must hold the same optimizers
    ([Note: stages with nothing to train])."""
    engine, module = strategy.engine, strategy.lightning_module
    if engine is None or module is None:
        return
    stages = zip(engine.plan.stages_of_rank(strategy._topology().pp_rank), engine.stage_modules)
    where = ", ".join(f"stage {s}, layers {sm.layer_indices.start}-{sm.layer_indices.stop - 1}" for s, sm in stages)
    ties = [(param, tie_group.tie.names) for param, tie_group in engine.grads.ties]
    check_optimizers_agree(strategy.optimizers, len(strategy.lr_scheduler_configs), engine.parameters, where, ties)


def _build_engine(strategy: Any, module: LightningModule) -> PipelineEngine:
    assert strategy.plan is not None, "set_world_ranks resolves the plan before setup"
    topology = strategy._topology()
    agree_on_kept_groups(strategy.root_device)  # [Note: process groups are reused] in parallel/group_cache.py
    layout: PipelineLayout | None = getattr(module, "_pipeline_layout", None)
    engine, layout = build_engine(module, strategy.pipeline_config, strategy.plan, topology, strategy.root_device,
                                  layout, sharding=_sharding_options(strategy))
    module._pipeline_layout = layout  # type: ignore[assignment]  # (nn.Module types attributes as tensors)
    module._pipeline_engine = engine  # type: ignore[assignment]
    engine.manual = not module.automatic_optimization  # [Note: manual optimization in a pipeline]
    log_layout(strategy.plan, topology, list(layout.ranges), strategy.plan.stages_of_rank(topology.pp_rank),
               sum(p.numel() for p in engine.parameters))
    return engine


def _sharding_options(strategy: Any) -> ShardingOptions:
    """FSDP settings (used when fsdp_size > 1): bf16-mixed gathers weights in bf16, reduces in fp32."""
    bf16 = strategy.precision_plugin.precision == "bf16-mixed"
    return ShardingOptions(reshard_after_forward=strategy.pipeline_config.fsdp_reshard_after_forward,
                           param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None)


def release_to_cpu(module: torch.nn.Module) -> None:
    """What Lightning's teardown does to free an accelerator's memory (move the module to CPU), only where a tensor
    lives on one, and never in the way of the error that ended the run.

    A CPU module has nothing to free, and a meta one (a setup that failed before allocation) cannot move. Tensor
    subclasses (DTensor: tensor parallelism, FSDP2) are moved by swapping the parameter objects, which torch refuses
    while anything else holds them, as the frames of an exception in flight do after a failed step: Lightning's
    ``.cpu()`` then raised "_apply(): Couldn't swap Linear.weight" from the teardown, and that error replaced the
    step's own (a peer's lost connection, a layer's error) in what the user saw. With an exception in flight, a
    failed move is a warning; without one, it raises."""
    devices = {t.device.type for t in (*module.parameters(), *module.buffers())}
    if devices <= {"cpu"} or "meta" in devices:
        return
    failed_run = sys.exc_info()[1] is not None  # read here: inside the except below it is the move's own error
    try:
        module.cpu()
    except RuntimeError as err:
        if not failed_run:
            raise
        warnings.warn(f"lightning_pipe: the teardown after a failed run could not move the module to CPU ({err}); "
                      f"its tensors stay on {sorted(devices - {'cpu'})} until the process ends.", stacklevel=2)
