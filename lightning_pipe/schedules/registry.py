"""Schedule name -> how to place stages and build torch's schedule; the rules each schedule imposes.

Adding a schedule is one :class:`ScheduleSpec` entry in ``_SCHEDULES``: its torch class, how many stages a rank holds
and where they go, and which micro-batch counts it accepts. Everything else (stage building, the strategy) reads
the spec. A schedule that is not a torch class with the usual constructor (``custom``: per-rank action lists) gives
its own ``resolve`` (config -> plan) and ``build`` (plan -> torch schedule) hooks; see ``schedules/custom.py``.

Every check here is plain data: it runs identically on every rank before any process group exists, so a bad
setting fails on all ranks at once instead of leaving peers waiting in a receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import PipelineConfig, config_error

Placement = Literal["loop", "v", "given", "mirror"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule the strategy can run."""

    name: str
    torch_class: type
    description: str
    multi_stage: bool = False
    """Built from a list of local stages (PipelineScheduleMulti family) rather than one stage."""
    placement: Placement = "loop"
    """``loop``: rank r holds stages r, r+p, r+2p, ...; ``v``: rank r holds r and 2p-1-r; ``mirror`` (Chimera): rank
    r holds stage r of one pipeline and stage p-1-r of a second one, so every stage lives on two ranks."""
    default_stages_per_rank: int = 1
    allowed_stages_per_rank: tuple[int, ...] | None = (1,)
    """``None``: any value >= ``min_stages_per_rank``."""
    min_stages_per_rank: int = 1
    min_microbatches: Literal["none", "pipeline", "stages"] = "pipeline"
    """``pipeline``: m >= pipeline size; ``stages``: m >= total stages; ``none``: any m >= 1."""
    rounds_divisible: bool = False
    """Torch's interleaved family needs m to be a multiple of its number of rounds, max(1, m // p)."""
    theory_bubble: Callable[[int, int, int], float] | None = None
    """(p, v, m) -> idle fraction of a step in the schedule's ideal model (equal F and B times)."""
    resolve: Callable[[ScheduleSpec, PipelineConfig, int], SchedulePlan] | None = None
    """Custom planning (config, pipeline size -> plan) instead of the rules above; ``placement="given"``."""
    build: Callable[[SchedulePlan, list, Callable[..., Any]], Any] | None = None
    """Custom construction (plan, local stages, loss fn -> torch schedule) instead of ``torch_class(...)``."""
    order: Callable[[SchedulePlan], dict[int, list[Any]]] | None = None
    """Per-rank compute order as data, where torch's ``pipeline_order`` IR is not what the schedule runs (see
    :func:`compute_order`). ``None``: read torch's IR."""
    options: tuple[str, ...] = ()
    """The ``schedule_options`` keys this schedule reads; any other key is refused (it would be ignored)."""
    stage_class: type | None = None
    """The ``PipelineStage`` subclass the engine builds this schedule's stages with (same constructor as
    ``_compat.GuardedPipelineStage``); ``None``: that class. Weight versions: ``lightning_pipe/schedules/pipedream/versioned.py``."""
    engine: str | None = None
    """``"module:Class"`` of a ``PipelineEngine`` subclass that builds this rank's runtime instead (same arguments),
    for schedules that run more than one torch pipeline per rank (Chimera: ``lightning_pipe.schedules.chimera.engine:ChimeraEngine``).
    A name, not the class: the engine imports this package, so the spec cannot import the engine."""


def _bubble_flush(p: int, v: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def _bubble_interleaved(p: int, v: int, m: int) -> float:
    return ((p - 1) / v) / (m + (p - 1) / v)


def _bubble_zero(p: int, v: int, m: int) -> float:
    # ZB-H1 / ZB-V (Qi et al. 2023): with F = B = W the bubble shrinks to about a third of 1F1B's; ZB-V close to 0
    # when m >= 2p. We report the paper's H1 estimate for both; the measured metric tells the truth.
    return ((p - 1) / 3) / (m + (p - 1) / 3)


def _order_gpipe(plan: SchedulePlan) -> dict[int, list[Any]]:
    m = plan.microbatches
    return {r: [_compat.parse_action(f"{r}F{i}") for i in range(m)] + [_compat.parse_action(f"{r}B{i}") for i in range(m)]
            for r in range(plan.pipeline_size)}


def _order_1f1b(plan: SchedulePlan) -> dict[int, list[Any]]:
    """What ``Schedule1F1B._step_microbatches`` runs: min(m, p - r) warm-up forwards on rank r, then backward /
    forward pairs, then the remaining backwards. (Torch 2.13's ``Schedule1F1B.pipeline_order`` IR, which the
    schedule does not execute, numbers the last rank's micro-batches from 1; we do not use it.)"""
    p, m = plan.pipeline_size, plan.microbatches
    order = {}
    for r in range(p):
        warmup = min(m, p - r)
        acts = [f"{r}F{i}" for i in range(warmup)]
        f, b = warmup, 0
        while f < m:
            acts += [f"{r}B{b}", f"{r}F{f}"]
            b, f = b + 1, f + 1
        acts += [f"{r}B{i}" for i in range(b, m)]
        order[r] = [_compat.parse_action(a) for a in acts]
    return order


_SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", torch_schedules.ScheduleGPipe, "all forwards, then all backwards (GPipe)",
                     min_microbatches="none", theory_bubble=_bubble_flush, order=_order_gpipe),
        ScheduleSpec("1f1b", torch_schedules.Schedule1F1B, "one-forward-one-backward (PipeDream-Flush)",
                     theory_bubble=_bubble_flush, order=_order_1f1b),
        ScheduleSpec("interleaved_1f1b", torch_schedules.ScheduleInterleaved1F1B,
                     "Megatron interleaved 1F1B over virtual stages", multi_stage=True,
                     default_stages_per_rank=2, allowed_stages_per_rank=None, min_stages_per_rank=2,
                     rounds_divisible=True, theory_bubble=_bubble_interleaved),
        ScheduleSpec("looped_bfs", torch_schedules.ScheduleLoopedBFS, "breadth-first looping over virtual stages",
                     multi_stage=True, default_stages_per_rank=2, allowed_stages_per_rank=None,
                     min_stages_per_rank=2, theory_bubble=_bubble_interleaved),
        ScheduleSpec("zb_h1", torch_schedules.ScheduleInterleavedZeroBubble,
                     "ZeroBubble with split input/weight gradients (interleaved)", multi_stage=True,
                     default_stages_per_rank=2, allowed_stages_per_rank=None, rounds_divisible=True,
                     theory_bubble=_bubble_zero),
        ScheduleSpec("zbv", torch_schedules.ScheduleZBVZeroBubble, "ZeroBubble V schedule",
                     multi_stage=True, placement="v", default_stages_per_rank=2, allowed_stages_per_rank=(2,),
                     theory_bubble=_bubble_zero),
        ScheduleSpec("dualpipev", torch_schedules.ScheduleDualPipeV, "DualPipeV (DeepSeek), V placement",
                     multi_stage=True, placement="v", default_stages_per_rank=2, allowed_stages_per_rank=(2,),
                     min_microbatches="stages", theory_bubble=_bubble_zero),
    )
}


def available_schedules() -> list[str]:
    return sorted(_SCHEDULES)


def get_schedule_spec(name: str) -> ScheduleSpec:
    spec = _SCHEDULES.get(str(name).lower())
    if spec is None:
        raise config_error(f"Unknown pipeline schedule; known schedules are {available_schedules()}.",
                           f"schedule={name!r}", "schedule")
    return spec


def check_schedule_settings(config: PipelineConfig) -> ScheduleSpec:
    """The config's schedule spec, after refusing an unknown name or an option the schedule does not take.

    Needs no world size, so the strategy calls it in its constructor: a silently ignored option is a run with
    settings the user did not get.
    """
    spec = get_schedule_spec(config.schedule)
    unknown = sorted(set(config.schedule_options) - set(spec.options))
    if unknown:
        takes = f"takes only the options {list(spec.options)}" if spec.options else "takes no options"
        raise config_error(f"Schedule '{spec.name}' {takes}; any other option would be silently ignored.",
                           f"schedule_options with {unknown}", "schedule_options",
                           "remove them, or choose the schedule that reads them", also=("schedule",))
    return spec


def register_schedule(spec: ScheduleSpec) -> None:
    """Make a schedule available by name (for extensions; the built-in ones are registered above)."""
    _SCHEDULES[spec.name] = spec


@dataclass(frozen=True)
class SchedulePlan:
    """The resolved shape of one pipeline: what every rank agrees on before any communication."""

    spec: ScheduleSpec
    pipeline_size: int
    stages_per_rank: int
    microbatches: int
    stage_ranks: tuple[int, ...] | None = None
    """Explicit placement (``placement="given"``): ``stage_ranks[s]`` is the pipeline rank holding stage ``s``."""
    actions: tuple[tuple[Any, ...], ...] | None = None
    """Explicit compute-only action lists, one per pipeline rank (torch ``_Action``; custom schedules)."""

    @property
    def num_stages(self) -> int:
        if self.stage_ranks is not None:
            return len(self.stage_ranks)
        return self.pipeline_size * self.stages_per_rank

    def stage_to_rank(self, stage: int) -> int:
        """The rank holding ``stage`` (with ``mirror`` placement: its copy in the first pipeline, see
        :meth:`ranks_of_stage`)."""
        p = self.pipeline_size
        if self.stage_ranks is not None:
            return self.stage_ranks[stage]
        if self.spec.placement == "v":
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        if self.spec.placement == "mirror":
            return sorted({pp_rank, self.pipeline_size - 1 - pp_rank})
        return [s for s in range(self.num_stages) if self.stage_to_rank(s) == pp_rank]

    def ranks_of_stage(self, stage: int) -> list[int]:
        """Every rank holding a copy of ``stage``: one, or two with ``mirror`` placement."""
        if self.spec.placement == "mirror":
            return sorted({stage, self.pipeline_size - 1 - stage})
        return [self.stage_to_rank(stage)]

    def theoretical_bubble(self) -> float | None:
        fn = self.spec.theory_bubble
        return None if fn is None else fn(self.pipeline_size, self.stages_per_rank, self.microbatches)


def plan_schedule(config: PipelineConfig, pipeline_size: int) -> SchedulePlan:
    """Resolve and check the schedule settings against the pipeline size. Raises before any process waits."""
    spec = check_schedule_settings(config)
    if spec.resolve is not None:
        return spec.resolve(spec, config, pipeline_size)
    v = config.stages_per_rank if config.stages_per_rank is not None else spec.default_stages_per_rank
    if spec.allowed_stages_per_rank is not None and v not in spec.allowed_stages_per_rank:
        raise config_error(f"Schedule '{spec.name}' needs stages_per_rank in {list(spec.allowed_stages_per_rank)}.",
                           f"stages_per_rank={v}", "stages_per_rank")
    if v < spec.min_stages_per_rank:
        raise config_error(f"Schedule '{spec.name}' needs at least {spec.min_stages_per_rank} stages per rank.",
                           f"stages_per_rank={v}", "stages_per_rank")
    m = config.microbatches if config.microbatches is not None else 2 * pipeline_size * v
    plan = SchedulePlan(spec, pipeline_size, v, m)
    if spec.min_microbatches == "pipeline" and m < pipeline_size:
        raise config_error(f"Schedule '{spec.name}' needs at least as many micro-batches as pipeline ranks.",
                           f"microbatches={m}, pipeline size={pipeline_size}", "microbatches")
    if spec.min_microbatches == "stages" and m < plan.num_stages:
        raise config_error(f"Schedule '{spec.name}' needs at least as many micro-batches as stages.",
                           f"microbatches={m}, stages={plan.num_stages}", "microbatches")
    if spec.rounds_divisible:
        rounds = max(1, m // pipeline_size)
        if m % rounds != 0:
            raise config_error(
                f"Schedule '{spec.name}' needs the micro-batch count to be a multiple of its number of rounds "
                "max(1, microbatches // pipeline size).",
                f"microbatches={m}, pipeline size={pipeline_size}, rounds={rounds}", "microbatches",
                f"e.g. a multiple of {pipeline_size}")
    return plan


def build_torch_schedule(plan: SchedulePlan, stages: list[Any], loss_fn: Callable[..., Any]) -> Any:
    """Instantiate torch's schedule. Gradients are *not* scaled by torch (see [Note: loss scaling] in engine)."""
    if plan.spec.build is not None:
        return plan.spec.build(plan, stages, loss_fn)
    if plan.spec.multi_stage:
        return plan.spec.torch_class(stages, n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = stages
    return plan.spec.torch_class(stage, n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)


def compute_order(plan: SchedulePlan) -> dict[int, list[Any]]:
    """The compute actions (F, B, I, W, OVERLAP_F_B; ``None`` = a planned idle step) each pipeline rank runs per
    batch, as plain data: what torch's schedule computes for this plan, without a process group or a model."""
    if plan.actions is not None:
        order = {rank: list(actions) for rank, actions in enumerate(plan.actions)}
    elif plan.spec.order is not None:
        order = plan.spec.order(plan)
    else:
        local = [plan.stages_of_rank(r) for r in range(plan.pipeline_size)]
        order = _compat.torch_pipeline_order(plan.spec.torch_class, plan.spec.multi_stage, plan.pipeline_size,
                                             plan.num_stages, local, plan.microbatches)
    return {rank: [a for a in actions if a is None or _compat.is_compute(a)] for rank, actions in order.items()}
