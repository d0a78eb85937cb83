"""The schedule registry: schedule name -> :class:`~lightning_pipe.runtime.spec.ScheduleSpec`, the rules that resolve a
config into a :class:`~lightning_pipe.runtime.spec.SchedulePlan`, and each plan's compute order as data.

Adding a schedule is one :class:`ScheduleSpec` (registered here, or by ``register_schedule``): its torch class, how
many stages a rank holds and where they go, and which micro-batch counts it accepts. Everything else (stage building,
the strategy) reads the spec. A schedule that is not a torch class with the usual constructor (``custom``: per-rank
action lists) gives its own ``resolve`` (config -> plan) and ``build`` (plan -> torch schedule) hooks; see
``schedules/custom.py``; one that needs its own stages or engine names their classes (``schedules/pipedream/``,
``schedules/chimera/``).

Every check here is plain data: it runs identically on every rank before any process group exists, so a bad
setting fails on all ranks at once instead of leaving peers waiting in a receive.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec


def bubble_flush(p: int, v: int, m: int) -> float:
    """The theoretical bubble of a schedule that flushes once per batch (GPipe, 1F1B and their asynchronous
    variants): ``(p - 1) / (m + p - 1)``."""
    return (p - 1) / (m + p - 1)


def _bubble_interleaved(p: int, v: int, m: int) -> float:
    return ((p - 1) / v) / (m + (p - 1) / v)


def _bubble_zero(p: int, v: int, m: int) -> float:
    # ZB-H1 / ZB-V (Qi et al. 2023): with F = B = W the bubble shrinks to about a third of 1F1B's; ZB-V close to 0
    # when m >= 2p. We report the paper's H1 estimate for both; the measured metric tells the truth.
    return ((p - 1) / 3) / (m + (p - 1) / 3)


def _order_gpipe(plan: SchedulePlan) -> dict[int, list[Any]]:
    m = plan.microbatches
    return {r: [_compat.compute_action(r, "F", i) for i in range(m)] + [_compat.compute_action(r, "B", i) for i in range(m)]
            for r in range(plan.pipeline_size)}


def order_1f1b(plan: SchedulePlan) -> dict[int, list[Any]]:
    """What ``Schedule1F1B._step_microbatches`` runs: min(m, p - r) warm-up forwards on rank r, then backward /
    forward pairs, then the remaining backwards. (Torch 2.13's ``Schedule1F1B.pipeline_order`` IR, which the
    schedule does not execute, numbers the last rank's micro-batches from 1; we do not use it.)"""
    p, m = plan.pipeline_size, plan.microbatches
    order = {}
    for r in range(p):
        warmup = min(m, p - r)
        acts = [(r, "F", i) for i in range(warmup)]
        f, b = warmup, 0
        while f < m:
            acts += [(r, "B", b), (r, "F", f)]
            b, f = b + 1, f + 1
        acts += [(r, "B", i) for i in range(b, m)]
        order[r] = [_compat.compute_action(*a) for a in acts]
    return order


_SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", torch_schedules.ScheduleGPipe, "all forwards, then all backwards (GPipe)",
                     min_microbatches="none", tensor_parallel=True, theory_bubble=bubble_flush, order=_order_gpipe),
        ScheduleSpec("1f1b", torch_schedules.Schedule1F1B, "one-forward-one-backward (PipeDream-Flush)",
                     tensor_parallel=True, theory_bubble=bubble_flush, order=order_1f1b),
        ScheduleSpec("interleaved_1f1b", torch_schedules.ScheduleInterleaved1F1B,
                     "Megatron interleaved 1F1B over virtual stages", multi_stage=True,
                     default_stages_per_rank=2, allowed_stages_per_rank=None, min_stages_per_rank=2,
                     rounds_divisible=True, tensor_parallel=True, theory_bubble=_bubble_interleaved),
        ScheduleSpec("looped_bfs", torch_schedules.ScheduleLoopedBFS, "breadth-first looping over virtual stages",
                     multi_stage=True, default_stages_per_rank=2, allowed_stages_per_rank=None,
                     min_stages_per_rank=2, tensor_parallel=True, theory_bubble=_bubble_interleaved),
        ScheduleSpec("zb_h1", torch_schedules.ScheduleInterleavedZeroBubble,
                     "ZeroBubble with split input/weight gradients (interleaved)", multi_stage=True,
                     default_stages_per_rank=2, allowed_stages_per_rank=None, rounds_divisible=True,
                     tensor_parallel=True, theory_bubble=_bubble_zero, split_backward=True),
        ScheduleSpec("zbv", torch_schedules.ScheduleZBVZeroBubble, "ZeroBubble V schedule",
                     multi_stage=True, placement="v", default_stages_per_rank=2, allowed_stages_per_rank=(2,),
                     tensor_parallel=True, theory_bubble=_bubble_zero, split_backward=True),
        ScheduleSpec("dualpipev", torch_schedules.ScheduleDualPipeV, "DualPipeV (DeepSeek), V placement",
                     multi_stage=True, placement="v", default_stages_per_rank=2, allowed_stages_per_rank=(2,),
                     min_microbatches="stages", tensor_parallel=True, theory_bubble=_bubble_zero, split_backward=True),
    )
}


def available_schedules() -> list[str]:
    return sorted(_SCHEDULES)


def get_schedule_spec(name: str) -> ScheduleSpec:
    spec = _SCHEDULES.get(str(name).lower())
    if spec is None:
        raise config_error(f"Unknown pipeline schedule; known schedules are {available_schedules()}, and 'auto' "
                           "(the planner picks one).",
                           f"schedule={name!r}", "schedule")
    return spec


def check_schedule_settings(config: PipelineConfig) -> ScheduleSpec:
    """The config's schedule spec, after refusing an unknown name, an option the schedule does not take, or tensor
    parallelism under a schedule that does not declare it.

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
    if config.tensor_parallel_size > 1 and not spec.tensor_parallel:
        verified = [name for name, s in sorted(_SCHEDULES.items()) if s.tensor_parallel]
        raise config_error(
            f"Tensor parallelism runs with the schedules {verified}; '{spec.name}' is not verified with DTensor "
            "layers (its ScheduleSpec does not declare tensor_parallel=True).",
            f"schedule={spec.name!r}, tensor_parallel_size={config.tensor_parallel_size}", "schedule",
            also=("tensor_parallel_size",))
    return spec


def check_split_backward(seen: str) -> None:
    """Refuse torch's split input/weight backward on a torch that gets it wrong ([Note: torch versions]).

    Called where training will run it (the strategy's constructor, the engine's assembly), not where schedules are
    only planned, simulated or drawn: those compute no gradient and work on every torch.
    """
    refusal = _compat.torch_gap("split_backward")
    if refusal is not None:
        raise config_error(refusal, seen, "schedule",
                           "a schedule without a split backward (gpipe, 1f1b, interleaved_1f1b, looped_bfs, "
                           "pipedream, pipedream_2bw, chimera, custom lists of F/B actions) or torch >= 2.13")


def register_schedule(spec: ScheduleSpec) -> None:
    """Make a schedule available by name (for extensions; the built-in ones are registered above)."""
    _SCHEDULES[spec.name] = spec


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


def compute_order(plan: SchedulePlan, lowered: bool = True) -> dict[int, list[Any]]:
    """The compute actions (F, B, I, W, OVERLAP_F_B; ``None`` = a planned idle step) each pipeline rank runs per
    batch, as plain data: what torch's schedule computes for this plan, without a process group or a model.
    ``lowered=False``: the same order without torch's lowering to sends / receives (fast at thousands of ranks x
    micro-batches; the cluster planner's)."""
    if plan.actions is not None:
        order = {rank: list(actions) for rank, actions in enumerate(plan.actions)}
    elif plan.spec.order is not None:
        order = plan.spec.order(plan)
    else:
        local = [plan.stages_of_rank(r) for r in range(plan.pipeline_size)]
        order = _compat.torch_pipeline_order(plan.spec.torch_class, plan.spec.multi_stage, plan.pipeline_size,
                                             plan.num_stages, local, plan.microbatches, lowered)
    return {rank: [a for a in actions if a is None or _compat.is_compute(a)] for rank, actions in order.items()}


def split_backward_actions(plan: SchedulePlan) -> list[str]:
    """The plan's split input / weight backward actions (I / W) as sorted strings, read from its compute order:
    built-in, custom and extension schedules alike."""
    return _compat.split_backward_actions(compute_order(plan))


def check_torch_runs(plan: SchedulePlan) -> None:
    """Refuse a plan whose actions this torch would run wrongly ([Note: torch versions] in ``_compat/torch_release.py``).

    Called by the strategy once the plan is resolved (every rank, before any communication): it covers built-in,
    custom and extension schedules alike, by their actions rather than their names.
    """
    if _compat.torch_gap("split_backward") is None:
        return
    split = split_backward_actions(plan)
    if split:
        check_split_backward(f"schedule={plan.spec.name!r}, whose actions include {', '.join(split[:4])}, ...")
