"""PipelineStrategy: Lightning's hooks, delegating to the plain-torch core (layout, engine, grads, checkpoint) and
to the adapter's helpers (setup, preflight, checkpointing, faults, precision)."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_pipe.config import PartitionSpec, PipelineConfigError
from lightning_pipe.lightning import same_call, world
from lightning_pipe.lightning.async_checkpoint import AsyncSaver, check_links, resolve_async_checkpoint
from lightning_pipe.lightning.checkpoint_hooks import CheckpointHooks
from lightning_pipe.lightning.collectives import DataCollectives
from lightning_pipe.lightning.elastic import elastic_world
from lightning_pipe.lightning.faults import DEFAULT_TIMEOUT, PipelineFaults, resolve_timeout
from lightning_pipe.lightning.launchers import pipeline_launcher
from lightning_pipe.lightning.liveness import DEFAULT_HEARTBEAT_TIMEOUT, resolve_heartbeat_timeout
from lightning_pipe.lightning.optimizers import empty_parameter_lists_allowed
from lightning_pipe.lightning.precision import PipelinePrecision, to_pipeline_precision
from lightning_pipe.lightning.preflight import check_last_batch, plan_for_world, resolve_settings
from lightning_pipe.lightning.rebalancing import StrategyRebalancer
from lightning_pipe.lightning.setup import check_rank_optimizers, release_to_cpu, setup_pipeline, teardown_pipeline
from lightning_pipe.lightning.steps import run_step, synced_closure
from lightning_pipe.parallel.group_cache import forget_groups
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.schedules import SchedulePlan


class PipelineStrategy(DataCollectives, CheckpointHooks):
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
        heartbeat_timeout: seconds after which a rank (or the rendezvous store) that has not been heard from is
            taken for lost and every other rank stops, naming it (default 30; 0 or None: off; docs/multi-node.md).
        async_checkpoint: write checkpoints on a background thread after copying them to host memory (docs/
            checkpoints.md); the next save, a load and the end of the run wait for the write.
        start_method: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"spawn"`` for notebooks.
        save_consolidated: write every checkpoint as one ordinary ``.ckpt`` file (``torch.load`` and any
            ``load_from_checkpoint`` read it; rank 0 holds the whole model while writing) instead of a sharded
            directory ([Note: consolidated checkpoints] in lightning/checkpointing.py).
    """

    strategy_name = "pipeline"
    # Set by setup (and cleared by teardown); None before.
    engine: PipelineEngine | None = None
    plan: SchedulePlan | None = None
    topology: Topology | None = None
    rebalancer: StrategyRebalancer | None = None
    auto_plan: dict[str, Any] | None = None
    _faults: PipelineFaults | None = None
    _undo_fast_log: Callable[[], None] | None = None
    _undo_metric_sync: Callable[[], None] | None = None
    _undo_features: Callable[[], None] | None = None  # lightning/features.py, between setup and teardown

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
        heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT,
        async_checkpoint: bool = False,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        save_consolidated: bool = False,
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
        self._plan_source, self._plan_name = resolved.plan, resolved.plan_name
        self._auto, self._memory_budget = resolved.auto, resolved.memory_budget
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = resolve_timeout(timeout)
        self._heartbeat_timeout = resolve_heartbeat_timeout(heartbeat_timeout)
        self._saver = AsyncSaver() if resolve_async_checkpoint(async_checkpoint) else None
        self._start_method, self._save_consolidated = start_method, save_consolidated

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
        self._launcher = pipeline_launcher(self, self.cluster_environment, self._start_method)

    def set_world_ranks(self) -> None:
        # torchrun's elastic agent may give another number of nodes than num_nodes: [Note: elastic worlds]
        elastic = elastic_world(self.cluster_environment, self.num_nodes, self.num_processes, self.pipeline_config)
        if elastic is not None:
            planned_replicas = self.pipeline_config.data_parallel_size
            self._num_nodes, self.pipeline_config = elastic.nodes, elastic.config
        if self.cluster_environment is not None and self.cluster_environment.creates_processes_externally:
            # torchrun / SLURM started the processes: Lightning's own rule that devices x num_nodes is their world
            # (its launcher checks it; none runs here), before any device list is indexed by a local rank
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if elastic is not None:
            rank_zero_info(elastic.describe(planned_replicas))
        try:
            self._plan_world()
        except PipelineConfigError as err:
            if elastic is None:
                raise
            raise PipelineConfigError(f"{elastic.headline()}, and no layout of this run fits it: {err}") from err

    def _plan_world(self) -> None:
        self.topology = None
        self.plan = plan_for_world(self.pipeline_config, self._topology(), self._plan_source, self._plan_name)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = world.init_process_group(self.cluster_environment, self.root_device,
                                                               self._process_group_backend, self._timeout)
        same_call.start_together(self)  # every rank starts this Trainer call ([Note: every rank saves])
        # Failures on one rank stop the others; SIGTERM stops all ranks at a step boundary (lightning/faults.py).
        self._faults = PipelineFaults.start(self, self._heartbeat_timeout)

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
        if self._saver is not None:
            check_links(trainer.callbacks)  # type: ignore[attr-defined]
        setup_pipeline(self, trainer)

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
        assert self.lightning_module is not None and self.plan is not None and self.engine is not None
        shapes = self.engine.shapes  # [Note: ragged batches] in runtime/ragged.py: planned shapes run them
        check_last_batch(self.lightning_module.trainer, self.plan.microbatches,
                         shapes.why_not if shapes.planner is None else None)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is not None and engine.per_microbatch_updates:
            return closure()  # the optimizer already stepped per micro-batch ([Note: PipeDream in Lightning's loop])
        result = super().optimizer_step(optimizer, synced_closure(closure, engine), model, **kwargs)
        if self.rebalancer is not None:
            self.rebalancer.after_optimizer_step()  # a step boundary: layers may move (lightning_pipe.rebalance)
        return result

    def _run(self, phase: str, parent: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None and self.lightning_module is not None
        return run_step(self.engine, self.lightning_module, self._faults, phase, parent, *args, **kwargs)

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

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._failed:
            return  # the ranks are stopping after a failure: no peer will meet it (e.g. Trainer.save_checkpoint's)
        world.barrier(self.root_device)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # a decision every rank takes alike (stop, save): counted over the whole world, not the data group
        votes = world.reduce(torch.tensor(int(decision), device=self.root_device), None, "sum")
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._saver is not None and self._failed:
            self._saver.abandon()  # its peers may be gone: the previous checkpoint stays
        forget_groups()  # a message may be in flight: [Note: process groups are reused] in parallel/group_cache.py
        if self._faults is not None:
            self._faults.on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._faults is not None and not self._faults.failed:
            self.wait_for_checkpoint()  # the last save of the run is in place before the run ends
        teardown_pipeline(self)
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
