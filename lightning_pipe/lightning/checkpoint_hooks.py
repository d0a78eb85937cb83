"""The strategy's checkpoint hooks: sharded saves and loads through :mod:`lightning_pipe.lightning.checkpointing`, an
asynchronous save in flight ([Note: asynchronous checkpoints]), and the resume caveats of a schedule or a rebalanced
split. :class:`~lightning_pipe.PipelineStrategy` derives from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pipe.checkpoint import remove as remove_checkpoint_files
from lightning_pipe.config import PipelineConfig
from lightning_pipe.lightning.async_checkpoint import AsyncSaver
from lightning_pipe.lightning.checkpointing import RankGroup, ShardedCheckpointer, save_on_every_rank
from lightning_pipe.lightning.faults import PipelineFaults
from lightning_pipe.lightning.rebalancing import StrategyRebalancer
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.schedules import SchedulePlan


class CheckpointHooks(ParallelStrategy):
    """Lightning's checkpoint hooks for a pipeline: every rank saves and loads its own layers, together."""

    pipeline_config: PipelineConfig
    plan: SchedulePlan | None
    engine: PipelineEngine | None
    rebalancer: StrategyRebalancer | None
    _faults: PipelineFaults | None
    _saver: AsyncSaver | None
    _save_consolidated: bool

    def _topology(self) -> Topology:
        raise NotImplementedError

    @property
    def _failed(self) -> bool:
        """This run failed, here or on a peer (lightning/faults.py): no collective can complete any more."""
        return self._faults is not None and self._faults.failed

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # each rank can only load its own layers, which exist once setup() has split the model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores them by parameter name; no load_optimizer_state_dict

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()  # this rank's layers under their original names

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._checkpointer().optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, where each rank reads only its own layers

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        save_on_every_rank(self, checkpoint, filepath, storage_options)  # lightning/checkpointing.py

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.wait_for_checkpoint()
        if self.is_global_zero:
            remove_checkpoint_files(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        checkpointer = self._checkpointer()
        checkpoint = checkpointer.load(checkpoint_path, weights_only)  # as data unless False
        plan = self.plan
        if plan is not None and plan.spec.resume_caveat is not None and not checkpointer.stage_state_complete:
            caveat = plan.spec.resume_caveat(self.pipeline_config)
            if caveat is not None:
                rank_zero_warn(f"lightning_pipe: resuming under schedule={plan.spec.name!r}: {caveat}.")
        if self.rebalancer is not None:  # back to the split it was saved with ([Note: resuming a rebalanced run])
            self.rebalancer.resume(checkpoint, checkpointer.saved_layout)
        return checkpoint

    def wait_for_checkpoint(self) -> None:
        """Until an asynchronous save in flight is written and in place; raises its error if it failed."""
        if self._saver is not None:
            self._saver.wait()

    def _checkpointer(self) -> ShardedCheckpointer:
        assert self.lightning_module is not None
        ranks = RankGroup(self.global_rank, self.world_size, self.broadcast, self.barrier)
        return ShardedCheckpointer(ranks, self.lightning_module, self.optimizers, self.pipeline_config,
                                   self._topology(), getattr(self.engine, "stages", ()))


__all__ = ["CheckpointHooks"]
