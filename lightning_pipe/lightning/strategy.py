"""PipelineStrategy: Lightning's hooks, delegating to the plain-torch core (layout, engine, grads, checkpoint) and
to the adapter's helpers (setup, preflight, checkpointing, faults, precision)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.checkpoint import remove as remove_checkpoint_files
from lightning_pipe.config import PartitionSpec
from lightning_pipe.lightning import metrics, world
from lightning_pipe.lightning.checkpointing import RankGroup, ShardedCheckpointer
from lightning_pipe.lightning.faults import DEFAULT_TIMEOUT, PipelineFaults, resolve_timeout
from lightning_pipe.lightning.launchers import PipelineMultiProcessingLauncher
from lightning_pipe.lightning.module import check_returned_loss
from lightning_pipe.lightning.optimizers import empty_parameter_lists_allowed
from lightning_pipe.lightning.precision import PipelinePrecision, to_pipeline_precision
from lightning_pipe.lightning.preflight import check_compiled_plan, check_last_batch, resolve_settings
from lightning_pipe.lightning.rebalancing import StrategyRebalancer
from lightning_pipe.lightning.setup import check_rank_optimizers, release_to_cpu, setup_pipeline
from lightning_pipe.parallel.group_cache import forget_groups
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.planner.plan import apply_plan
from lightning_pipe.rebalance import check_rebalance
from lightning_pipe.runtime.build import check_expert_settings
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.schedules import SchedulePlan, check_torch_runs, plan_schedule


class PipelineStrategy(ParallelStrategy):
    """Pipeline parallelism (optionally times data parallelism) for a layer-list LightningModule.

    ``world size = data_parallel_size x pipeline size x fsdp_size x tensor_parallel_size``. The module's layer list is split into
    ``pipeline size x stages_per_rank`` stages; each rank keeps only its own layers (parameter names unchanged) and
    torch.distributed.pipelining runs the schedule. Settings are those of :class:`~lightning_pipe.PipelineConfig`.

    Args (in :class:`~lightning_pipe.PipelineConfig`'s order; all but ``schedule`` are keyword-only):
        schedule, microbatches, data_parallel_size, fsdp_size, fsdp_reshard_after_forward, tensor_parallel_size,
            expert_parallel_size, partition, stages_per_rank, layers_attr, recompute, offload, schedule_options:
            the layout settings, documented once on :class:`~lightning_pipe.PipelineConfig` (and in docs/settings.md,
            generated from it, with their Hydra paths). ``schedule="auto"`` lets the planner choose at setup (docs/planner.md).
        rebalance_every_n_steps, rebalance_threshold: move layers between ranks mid-run when measured times
            predict a faster split (docs/planner.md: "Rebalancing while training"); see :class:`~lightning_pipe.PipelineConfig`.
        plan: a plan file (or its dict) from ``python -m lightning_pipe.planner search``: its schedule,
            micro-batches, stages per rank, replicas and partition replace those arguments.
        memory_budget: per-device limit for ``schedule="auto"`` (bytes or e.g. ``"20GiB"``).
        timeout: how long a rank waits on another in one transfer before failing (a ``timedelta`` or seconds;
            default 10 minutes). A rank that fails stops its peers within seconds regardless
            (docs/failures.md).
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"spawn"`` for notebooks.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        # PipelineConfig's fields, in its order
        schedule: str = "1f1b",
        *,
        microbatches: int | None = None,
        data_parallel_size: int = 1,
        fsdp_size: int = 1,
        fsdp_reshard_after_forward: bool = False,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        partition: PartitionSpec = "uniform",
        stages_per_rank: int | None = None,
        layers_attr: str = "layers",
        recompute: str | int = "none",
        offload: str | int | bool | Sequence[int] = "none",
        compile: bool | dict[str, Any] = False,
        schedule_options: dict[str, Any] | None = None,
        rebalance_every_n_steps: int | None = None,
        rebalance_threshold: float = 0.05,
        # what replaces or chooses them (a saved plan, schedule="auto")
        plan: str | os.PathLike | dict[str, Any] | None = None,
        memory_budget: int | str | None = None,
        # the processes
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        # Lightning's plugins
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        resolved = resolve_settings(schedule, microbatches, data_parallel_size, partition, stages_per_rank,
                                    layers_attr, recompute, schedule_options, plan, memory_budget,
                                    fsdp_size=fsdp_size, fsdp_reshard_after_forward=fsdp_reshard_after_forward,
                                    tensor_parallel_size=tensor_parallel_size,
                                    expert_parallel_size=expert_parallel_size,
                                    rebalance_every_n_steps=rebalance_every_n_steps,
                                    rebalance_threshold=rebalance_threshold, offload=offload,
                                    compile=compile)
        self.pipeline_config = resolved.config
        self.rebalancer: StrategyRebalancer | None = None
        self._plan_source, self._plan_name = resolved.plan, resolved.plan_name
        self._auto, self._memory_budget = resolved.auto, resolved.memory_budget
        self.auto_plan: dict[str, Any] | None = None
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = resolve_timeout(timeout)
        self._faults: PipelineFaults | None = None
        self._undo_fast_log: Callable[[], None] | None = None
        self._undo_metric_sync: Callable[[], None] | None = None
        self._start_method = start_method
        self.engine: PipelineEngine | None = None
        self.plan: SchedulePlan | None = None
        self.topology: Topology | None = None

    @property
    def planned(self) -> dict[str, Any] | None:
        """The plan the layout came from, with its prediction (``schedule="auto"``, ``partition="time"/"memory"``
        or ``plan=``); ``None`` for a layout set by hand. ``PipelineTimeline`` logs its prediction."""
        return self.auto_plan if self.auto_plan is not None else self._plan_source

    # ------------------------------------------------------------------ world
    @property
    def is_distributed(self) -> bool:
        # Lightning asks this to decide on DistributedSampler and self.log(sync_dist=True).
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard by data-parallel rank only (replicas x FSDP shards): every stage and every tensor rank of one replica
        # must read the same batches.
        topo = self._topology()
        return {"num_replicas": topo.dp_degree, "rank": topo.dp_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _topology(self) -> Topology:
        if self.topology is None:
            self.topology = Topology.create(self.world_size, self.pipeline_config.data_parallel_size,
                                            self.global_rank, self.pipeline_config.fsdp_size,
                                            self.pipeline_config.tensor_parallel_size)
        return self.topology

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            self._launcher = None  # torchrun / SLURM / our tests started the ranks
        elif self._start_method == "popen":
            self._launcher = _compat.SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                              self.num_nodes)
        else:
            self._launcher = PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None and self.cluster_environment.creates_processes_externally:
            # torchrun / SLURM started the processes: Lightning's own rule that devices x num_nodes is their world
            # (its launcher checks it; none runs here), before any device list is indexed by a local rank
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        self.topology = None
        if self._plan_source is not None:
            apply_plan(self._plan_source, world_size=self.world_size, name=self._plan_name)  # for one world size
        # World-shape rules are checked here, before any process waits on another; the plan is resolved once.
        self.plan = plan_schedule(self.pipeline_config, self._topology().pipeline_size)
        check_torch_runs(self.plan)  # what this torch would compute wrongly ([Note: torch versions])
        check_compiled_plan(self.pipeline_config, self.plan)  # [Note: compiled layers]: no split backward
        check_rebalance(self.pipeline_config, self.plan)  # before any rank waits on another
        check_expert_settings(self.plan, self._topology(), self.pipeline_config.expert_parallel_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = world.init_process_group(self.cluster_environment, self.root_device,
                                                               self._process_group_backend, self._timeout)
        # Failures on one rank stop the others; SIGTERM stops all ranks at a step boundary (lightning/faults.py).
        self._faults = PipelineFaults.start(self)

    # ------------------------------------------------------------------ precision
    @property
    def precision_plugin(self) -> PipelinePrecision:
        if self._precision_plugin is None:
            self._precision_plugin = PipelinePrecision("32-true")
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        self._precision_plugin = to_pipeline_precision(plugin)

    # ------------------------------------------------------------------ setup (lightning/setup.py)
    @override
    def setup(self, trainer: Trainer) -> None:
        setup_pipeline(self, trainer)
        if self._undo_fast_log is None:  # [Note: self.log's move to the device it is on] (_compat/lightning.py)
            self._undo_fast_log = _compat.fast_metric_moves()
        module = self.lightning_module  # [Note: what sync_dist reduces over] (lightning/metrics.py)
        if self._undo_metric_sync is None and self.engine is not None and module is not None:
            self._undo_metric_sync = metrics.sync_metrics_over_data(module, self.engine)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        # configure_optimizers sees this rank's layers only: a stage with nothing to train gets an empty optimizer
        # ([Note: stages with nothing to train] in lightning/optimizers.py)
        with empty_parameter_lists_allowed():
            super().setup_optimizers(trainer)
        check_rank_optimizers(self)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device: no rank allocates layers it will not hold. Each rank
        allocates its own layers at setup and initialises them with the module's ``reset_layer(index, layer)``
        (docs/module-contract.md: "Large models")."""
        with torch.device("meta"):
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None and self.plan is not None
        check_last_batch(self.lightning_module.trainer, self.plan.microbatches)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is not None and engine.per_microbatch_updates:
            return closure()  # the optimizer already stepped per micro-batch ([Note: PipeDream in Lightning's loop])

        def closure_then_sync() -> Any:
            # After every accumulated backward, before on_before_optimizer_step and clipping see the gradients:
            # average over replicas, sum tied copies (lightning_pipe.parallel.grads).
            result = closure()
            if engine is not None:
                engine.sync_gradients()
                engine.before_optimizer_step()  # weight versions (PipeDream-2BW) keep W(b) before the update
            return result

        result = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        if self.rebalancer is not None:
            self.rebalancer.after_optimizer_step()  # a step boundary: layers may move (lightning_pipe.rebalance)
        return result

    def _run(self, phase: str, parent: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        self.engine.accumulate_grad_batches = trainer.accumulate_grad_batches
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        if phase == "train":  # hints for the overlapped gradient sync (exact whatever they say: engine.py)
            self.engine.dp_handoff.optimizer_step_follows = not _compat.should_accumulate(trainer)
            self.engine.dp_handoff.zero_grad_follows = (batch_idx is None
                                                        or batch_idx % trainer.accumulate_grad_batches == 0)
            self.engine.step_flags = self._faults.train_flags if self._faults is not None else None
        try:
            with self.engine.running(phase, batch_idx):
                result = parent(*args, **kwargs)
                if phase == "train":
                    check_returned_loss(result, self.engine.step_loss, type(self.lightning_module).__name__)
        except BaseException as err:
            if self._faults is not None:
                self._faults.report(err)  # now: peers are blocked on this rank ([Note: failure propagation])
            raise
        if self._faults is not None:
            self._faults.after_step(phase, batch_idx)  # every rank: stop together on SIGTERM
        return result

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("train", super().training_step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("validate", super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("test", super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("predict", super().predict_step, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints (lightning/checkpointing.py)
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
        if self._failed:
            # A run that failed (here or on a peer: reported before any on_exception checkpoint) cannot write a
            # sharded checkpoint: every rank writes its part together, and the ranks are stopping. Said, not
            # attempted: the attempt would wait on a peer that is gone and end in the transport's error.
            warnings.warn(f"lightning_pipe: no checkpoint written at {str(filepath)!r} on rank {self.global_rank}: "
                          "the run failed, and a sharded checkpoint needs every rank to write its part (an "
                          "OnExceptionCheckpoint saves on an agreed SIGTERM stop, not after an error). The last "
                          "complete checkpoint stays.", stacklevel=2)
            return
        self._checkpointer().save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint_files(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
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

    def _checkpointer(self) -> ShardedCheckpointer:
        assert self.lightning_module is not None
        ranks = RankGroup(self.global_rank, self.world_size, self.broadcast, self.barrier)
        return ShardedCheckpointer(ranks, self.lightning_module, self.optimizers, self.pipeline_config,
                                   self._topology(), getattr(self.engine, "stages", ()))

    # ------------------------------------------------------------------ collectives
    @property
    def _failed(self) -> bool:
        """This run failed, here or on a peer (lightning/faults.py): no collective can complete any more."""
        return self._faults is not None and self._faults.failed

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._failed:
            return  # the ranks are stopping after a failure: no peer will meet it (e.g. Trainer.save_checkpoint's)
        world.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return world.broadcast(obj, src)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | str | None = "mean") -> Any:
        """Over the ranks that read different data unless ``group`` is given: the pipeline's ranks of one replica
        hold the same logged values ([Note: what sync_dist reduces over] in lightning/metrics.py)."""
        if group is None and self.engine is not None:
            return metrics.reduce_over_data(tensor, reduce_op, self.engine)
        return world.reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # a decision every rank takes alike (stop, save): counted over the whole world, not the data group
        votes = world.reduce(torch.tensor(int(decision), device=self.root_device), None, "sum")
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def on_exception(self, exception: BaseException) -> None:
        forget_groups()  # a message may be in flight: [Note: process groups are reused] in parallel/group_cache.py
        if self._faults is not None:
            self._faults.on_exception(exception)

    @override
    def teardown(self) -> None:
        faults, self._faults = self._faults, None
        undo_fast_log, self._undo_fast_log = self._undo_fast_log, None
        if undo_fast_log is not None:
            undo_fast_log()
        undo_metric_sync, self._undo_metric_sync = self._undo_metric_sync, None
        if undo_metric_sync is not None:
            undo_metric_sync()
        if faults is not None:
            faults.stop()
        if self.rebalancer is not None:
            self.rebalancer.detach()  # kept (its history) until the next setup
        if self.lightning_module is not None:
            self.lightning_module._pipeline_engine = None  # type: ignore[assignment]
        if isinstance(self._precision_plugin, PipelinePrecision):
            self._precision_plugin.engine = None
        self.engine = None
        module = self._lightning_module
        if module is not None:
            release_to_cpu(module)
        self._lightning_module = None  # Lightning's teardown moves it to CPU: done above where there was a reason to
        super().teardown()
        self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("pipeline", cls, description="Pipeline parallelism (torch.distributed.pipelining)")
        strategy_registry.register("pipeline_spawn", cls, description="Pipeline parallelism, spawned processes",
                                   start_method="spawn")


__all__ = ["PipelineStrategy"]
