"""What the strategy decides and checks before any engine exists: the settings a plan file or ``schedule="auto"``
resolves to, the module contract, and the layout report on rank 0."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from lightning_pipe._compat import lightning as _compat
from lightning_pipe._compat import torch as _compat_torch
from lightning_pipe.config import MEASURED_PARTITIONS, PartitionSpec, PipelineConfig, config_error
from lightning_pipe.layers.partition import counts_of
from lightning_pipe.layers.stages import find_layers
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.planner.auto import balance_on_ranks, plan_on_ranks
from lightning_pipe.planner.model import ActivationPolicy
from lightning_pipe.planner.plan import apply_plan, explain, load_plan, plan_name
from lightning_pipe.rebalance import check_rebalance
from lightning_pipe.runtime.build import check_expert_settings
from lightning_pipe.runtime.ragged import refusal, why_ragged_cannot_run
from lightning_pipe.schedules import (
    SchedulePlan,
    check_schedule_settings,
    check_split_backward,
    check_torch_runs,
    plan_schedule,
    split_backward_actions,
)


@dataclasses.dataclass(frozen=True)
class ResolvedSettings:
    """The strategy's arguments after a plan file / ``schedule="auto"`` had its say."""

    config: PipelineConfig
    auto: bool
    """``schedule="auto"``: the planner replaces ``config``'s layout at setup (a 1F1B placeholder until then)."""
    memory_budget: int | str | None
    plan: dict[str, Any] | None
    """The saved plan, read once (its world size is checked when the world is known, its layer count at setup)."""
    plan_name: str | None = None
    """How errors name that plan (its file)."""


def resolve_settings(schedule: str, microbatches: int | None, data_parallel_size: int, partition: PartitionSpec,
                     stages_per_rank: int | None, layers_attr: str, recompute: str | int,
                     schedule_options: dict[str, Any] | None, plan: str | os.PathLike | dict[str, Any] | None,
                     memory_budget: int | str | None, **settings: Any) -> ResolvedSettings:
    """Fold a saved plan and ``schedule="auto"`` into one :class:`PipelineConfig`; checked before any rank starts.
    ``settings``: the other :class:`PipelineConfig` fields (FSDP, rebalancing), which no plan replaces."""
    plan_data = None if plan is None else load_plan(plan)
    name = None if plan is None else plan_name(plan)
    if plan_data is not None:
        # A saved plan (python -m lightning_pipe.planner search) replaces the layout settings; its world size is
        # checked in set_world_ranks, once the world is known.
        planned = apply_plan(plan_data, name=name)
        schedule, microbatches, stages_per_rank = (planned["schedule"], planned["microbatches"],
                                                   planned["stages_per_rank"])
        data_parallel_size, partition = planned["data_parallel_size"], planned["partition"]
    options = dict(schedule_options or {})
    auto = str(schedule).lower() == "auto"
    budget = memory_budget if memory_budget is not None else options.pop("memory_budget", None)
    if auto:
        schedule, microbatches, stages_per_rank, partition, options = "1f1b", None, None, "uniform", {}
    config = PipelineConfig(schedule=schedule, microbatches=microbatches, data_parallel_size=data_parallel_size,
                            partition=partition, stages_per_rank=stages_per_rank, layers_attr=layers_attr,
                            recompute=recompute, schedule_options=options, **settings)
    measured = config.partition in MEASURED_PARTITIONS
    if budget is not None and not (auto or measured):  # only the planner reads it: never silently ignored
        raise config_error("memory_budget limits what the planner picks: it applies with schedule='auto' or "
                           "partition='time' / 'memory' only.",
                           f"memory_budget={budget!r} with schedule={config.schedule!r}, "
                           f"partition={config.partition!r}" + (" from a plan file" if plan_data is not None else ""),
                           "memory_budget", "to None, or plan with schedule='auto'", also=("schedule", "partition"))
    if config.fsdp_size > 1 and (auto or plan_data is not None or measured):
        used = ("a plan file" if plan_data is not None else "schedule='auto'" if auto
                else f"partition={config.partition!r}")
        raise config_error("The planner does not model FSDP yet: schedule='auto', plan files and partition='time' / "
                           "'memory' take fsdp_size=1.", f"fsdp_size={config.fsdp_size} with {used}",
                           "fsdp_size", also=("schedule", "plan", "partition"))
    if config.tensor_parallel_size > 1 and (auto or plan_data is not None or measured
                                            or config.rebalance_every_n_steps is not None):
        used = ("a plan file" if plan_data is not None else "schedule='auto'" if auto
                else f"partition={config.partition!r}" if measured else "rebalance_every_n_steps")
        raise config_error("The planner does not model tensor parallelism yet: schedule='auto', plan files, "
                           "partition='time' / 'memory' and rebalancing take tensor_parallel_size=1.",
                           f"tensor_parallel_size={config.tensor_parallel_size} with {used}", "tensor_parallel_size",
                           also=("schedule", "plan", "partition", "rebalance_every_n_steps"))
    if config.compile is not False and auto:
        raise config_error("schedule='auto' plans from eager layer timings and may pick a split-backward schedule, "
                           "which compiled layers cannot run ([Note: compiled layers]).",
                           f"compile={config.compile!r} with schedule='auto'", "compile", also=("schedule",))
    # Unknown schedule names and options the schedule does not take fail here, not on the ranks after launch; so
    # does a schedule whose split backward this torch computes wrongly (custom lists: at set_world_ranks).
    if check_schedule_settings(config).split_backward:
        check_split_backward(f"schedule={config.schedule!r}")
    return ResolvedSettings(config, auto, budget, plan_data, name)


def plan_for_world(config: PipelineConfig, topology: Topology, plan_file: dict[str, Any] | None,
                   plan_file_name: str | None) -> SchedulePlan:
    """The one plan of a run, resolved when the world is known (``set_world_ranks``), with every rule on the world's
    shape checked before any process waits on another."""
    if plan_file is not None:
        apply_plan(plan_file, world_size=topology.world_size, name=plan_file_name)  # for one world size
    plan = plan_schedule(config, topology.pipeline_size)
    check_torch_runs(plan)  # what this torch would compute wrongly ([Note: torch versions])
    check_compiled_plan(config, plan)  # [Note: compiled layers]: no split backward
    check_rebalance(config, plan)  # before any rank waits on another
    check_expert_settings(plan, topology, config.expert_parallel_size)
    return plan


def check_compiled_plan(config: PipelineConfig, plan: SchedulePlan) -> None:
    """Refuse compiled layers under a split input/weight backward ([Note: compiled layers]): built-in, custom and
    extension schedules alike, by their actions; and under a schedule with its own stage class or engine (not
    verified). Every rank, before any communication."""
    if config.compile is False:
        return
    options = config.compile_options or {}
    mode = options.get("mode")
    modes = _compat_torch.compile_modes() if mode is not None else None
    if modes is not None and options.get("backend", "inductor") == "inductor" and mode not in modes:
        raise config_error(f"compile's mode is one of torch.compile's: {', '.join(modes)}.",
                           f"compile={config.compile!r}", "compile")
    split = split_backward_actions(plan)
    if plan.spec.split_backward or split:
        actions = f", whose actions include {', '.join(split[:4])}, ..." if split else ""
        raise config_error(
            "Compiled layers cannot run a split input/weight backward: a compiled layer's backward is one fused "
            "node, which torch's separate input- and weight-gradient passes would either fail on (donated buffers) "
            "or run twice.", f"compile={config.compile!r} with schedule={plan.spec.name!r}{actions}", "compile",
            "or choose a schedule with a full backward (gpipe, 1f1b, interleaved_1f1b, looped_bfs, custom lists of "
            "F/B actions)", also=("schedule",))
    own = plan.spec.stage_class or plan.spec.engine
    if own is not None:
        raise config_error(
            "Compiled layers are verified with the standard pipeline stage and engine (gpipe, 1f1b, interleaved_1f1b, "
            "looped_bfs, custom lists); a schedule with its own stage class or engine (weight versions, two "
            "pipelines) is not verified with them yet.",
            f"compile={config.compile!r} with schedule={plan.spec.name!r} ({own.__name__})", "compile",
            "or choose one of those schedules", also=("schedule",))


def check_plan_fits(plan: dict[str, Any] | None, name: str | None, module: LightningModule, layers_attr: str) -> None:
    """A saved plan against the model it is used on, at setup (the first moment the layer list is known), so the
    error names the plan rather than the ``partition`` it replaced. Every rank holds the same module: all refuse."""
    if plan is None or getattr(module, "_pipeline_layout", None) is not None:
        return  # no plan, or a module this process already split (its split was checked then)
    apply_plan(plan, num_layers=len(find_layers(module, layers_attr)), name=name)


def plan_automatically(trainer: Trainer, module: LightningModule, config: PipelineConfig,
                       memory_budget: int | str | None, world_size: int,
                       device: torch.device) -> tuple[dict[str, Any], PipelineConfig]:
    """``schedule="auto"``: every rank profiles the layers on one training batch, rank 0 searches (planner), all
    adopt the same plan; rank 0 logs it with the runners-up. Collective."""
    if trainer.state.fn != TrainerFn.FITTING:
        raise config_error("schedule='auto' plans from a training batch, so it needs trainer.fit first.",
                           f"trainer.{getattr(trainer.state.fn, 'value', None)}() with schedule='auto'", "schedule",
                           "pass plan=<a plan file> (python -m lightning_pipe.planner search) to evaluate")
    batch = next(iter(_compat.train_dataloader(trainer)))
    auto_plan = plan_on_ranks(module, batch, config.data_parallel_size, memory_budget, config.layers_attr, device,
                              activations=ActivationPolicy.of(config))
    config = dataclasses.replace(config, **apply_plan(auto_plan, world_size=world_size))
    rank_zero_info("PipelineStrategy(schedule='auto') chose, from measured costs:\n" + explain(auto_plan))
    return auto_plan, config


def balance_partition(trainer: Trainer, module: LightningModule, config: PipelineConfig, plan: SchedulePlan,
                      memory_budget: int | str | None, world_size: int,
                      device: torch.device) -> tuple[dict[str, Any] | None, PipelineConfig]:
    """``partition="time"`` / ``"memory"``: every rank profiles the layers on one training batch, rank 0 picks the
    split of the configured schedule (v, m and replicas kept) with the fastest predicted step / the smallest
    predicted peak, all adopt it; rank 0 logs it next to the uniform split. Collective. A module this process
    already split (e.g. ``trainer.validate`` after ``fit``) keeps its split (and there is no prediction)."""
    layout = getattr(module, "_pipeline_layout", None)
    if layout is not None:
        return None, dataclasses.replace(config, partition=list(counts_of(layout.ranges)))
    if trainer.state.fn != TrainerFn.FITTING:
        raise config_error(f"partition={config.partition!r} measures the layers on a training batch, so it needs "
                           "trainer.fit first.", f"trainer.{getattr(trainer.state.fn, 'value', None)}() with "
                           f"partition={config.partition!r}", "partition",
                           "pass the per-stage layer counts (or a plan file) to evaluate")
    batch = next(iter(_compat.train_dataloader(trainer)))
    by = str(config.partition)
    chosen = balance_on_ranks(module, batch, plan, by, config.data_parallel_size, memory_budget, config.layers_attr,
                              device, activations=ActivationPolicy.of(config))
    config = dataclasses.replace(config, partition=apply_plan(chosen, world_size=world_size)["partition"])
    rank_zero_info(f"PipelineStrategy(partition={by!r}) chose, from measured costs:\n" + explain(chosen))
    return chosen, config


def check_module(module: LightningModule) -> None:
    """The layer-list contract, before anything is split."""
    missing = [name for name in ("loss_fn", "split_batch", "compute_loss") if not hasattr(module, name)]
    if missing:
        raise TypeError(
            f"PipelineStrategy needs a layer-list module: {type(module).__name__} lacks {missing}. Derive it "
            "from `lightning_pipe.PipelineModule` (it provides split_batch/compute_loss) and implement "
            "`loss_fn(output, target)`; see docs/module-contract.md."
        )


def check_last_batch(trainer: Trainer, microbatches: int, planner_why_not: str | None) -> None:
    """When training starts: a training loader whose last, partial batch of each epoch cannot run is refused now,
    not when the epoch gets there (hours later in a long epoch): fewer rows than micro-batches, or rows that do not
    divide where shapes are not planned ([Note: ragged batches] in runtime/ragged.py; ``planner_why_not``: why this
    layout plans no shapes, ``None`` where it does). Only where the run reaches that batch (``limit_train_batches``
    or ``max_steps`` may stop before it), and only for a plain ``DataLoader`` with a batch size and a sized sampler;
    any other loader meets the per-batch check."""
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader) or loader.batch_size is None or loader.drop_last:
        return
    try:
        rows = len(loader.sampler)  # type: ignore[arg-type]  # a sized sampler (an iterable one raises TypeError)
    except TypeError:
        return
    last, batches = rows % loader.batch_size, -(-rows // loader.batch_size)
    why = why_ragged_cannot_run(last, microbatches, planner_why_not) if last else None
    if why is None or trainer.num_training_batches < batches:
        return
    if trainer.max_steps != -1 and trainer.max_steps * trainer.accumulate_grad_batches < batches:
        return
    raise refusal(f"the last of each epoch, batch_idx {batches - 1}: {rows} samples per rank in batches of "
                  f"{loader.batch_size}; refused as training starts", last, microbatches, why)


def check_callbacks(trainer: Trainer) -> None:
    """Callbacks that cannot work on a split module, refused before anything is split (on every rank alike)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # Trainer.callbacks: list[Callback]
        if isinstance(callback, StochasticWeightAveraging):
            raise TypeError(
                "StochasticWeightAveraging cannot run under PipelineStrategy: it averages into a copy of the whole "
                "module made before the strategy splits it, and pairs that copy's parameters with this rank's "
                "stages by position (rank 1's first layer with the model's first, shapes permitting, silently). "
                "Remove the StochasticWeightAveraging callback from Trainer(callbacks=...); to average weights, "
                "keep a torch.optim.swa_utils.AveragedModel of the model on one device after training, or average "
                "checkpoints."
            )


def log_layout(plan: SchedulePlan, topology: Topology, ranges: list[range], local_ids: list[int],
               n_params: int) -> None:
    """One table on rank 0: which layers and how many parameters each stage holds (Lightning's model summary only
    sees rank 0's stage). Collective."""
    rows: list[Any] = [None] * topology.world_size
    dist.all_gather_object(rows, (topology.dp_rank, topology.tp_rank, topology.pp_rank, local_ids, n_params))
    lines = [f"PipelineStrategy: schedule={plan.spec.name}, microbatches={plan.microbatches}, "
             f"{plan.num_stages} stages on {topology.pipeline_size} ranks x {topology.data_parallel_size} replica(s)"
             + (f" x {topology.fsdp_size} FSDP shards" if topology.fsdp_size > 1 else "")
             + (f" x {topology.tensor_parallel_size} tensor ranks" if topology.tensor_parallel_size > 1 else "")
             + (" (the counts are whole stages)" if topology.fsdp_size * topology.tensor_parallel_size > 1 else "")]
    for dp_rank, tp_rank, pp_rank, stages, count in rows:
        if dp_rank == 0 and tp_rank == 0:
            spans = ", ".join(f"stage {s}: layers {ranges[s].start}-{ranges[s].stop - 1}" for s in stages)
            lines.append(f"  pipeline rank {pp_rank}: {spans} ({count:,} parameters)")
    rank_zero_info("\n".join(lines))
