"""The contract between a schedule and the runtime: what a schedule declares (:class:`ScheduleSpec`), the plan
every rank agrees on (:class:`SchedulePlan`), and how torch's schedule is built from it.

The registry of named specs and the rules that resolve a config into a plan are in ``lightning_pipe/schedules``;
this module knows no schedule by name, so the runtime (engine, build) imports it without importing the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lightning_pipe.config import PipelineConfig

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
    :class:`~lightning_pipe.runtime.stage.PipelineStage`); ``None``: that class. Weight versions:
    ``schedules/pipedream/``."""
    engine: type | None = None
    """A :class:`~lightning_pipe.runtime.engine.PipelineEngine` subclass that builds this rank's runtime instead
    (same arguments), for schedules that run more than one torch pipeline per rank (Chimera:
    ``schedules/chimera/engine.py``); ``None``: ``PipelineEngine``. The spec lives in its schedule's folder, above the
    runtime, so it names the class itself."""
    resume_caveat: Callable[[PipelineConfig], str | None] | None = None
    """config -> what a checkpoint of this schedule does not hold under it, so that a resumed run departs from an
    uninterrupted one (said as a warning when a run resumes); ``None`` (or a ``None`` answer): resumes are exact."""
    tensor_parallel: bool = False
    """Verified with tensor-parallel stages (tests/distributed/test_tensor_parallel.py; why the built-in ones hold:
    [Note: tensor parallel stages] in parallel/tensor_parallel.py). A schedule that does not declare it is refused
    with ``tensor_parallel_size > 1`` before any rank starts (``check_schedule_settings``)."""
    split_backward: bool = False
    """Runs torch's split input/weight backward (I/W actions): refused on a torch that computes it wrongly
    ([Note: torch versions] in ``_compat/torch_release.py``). Custom action lists are checked by their actions."""
    needs: str = ""
    """What a schedule with its own ``resolve`` needs (the rules above are not applied to it), as the schedule table
    of docs/schedules.md says it."""


def placed_rank(placement: str, stage: int, pipeline_size: int) -> int:
    """The pipeline rank a rule places ``stage`` on: ``v``: r and 2p-1-r; ``loop`` (and ``mirror``'s first pipeline):
    ``stage % p``."""
    p = pipeline_size
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


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
        if self.stage_ranks is not None:
            return self.stage_ranks[stage]
        return placed_rank(self.spec.placement, stage, self.pipeline_size)

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


def build_torch_schedule(plan: SchedulePlan, stages: list[Any], loss_fn: Callable[..., Any]) -> Any:
    """Instantiate torch's schedule. Gradients are *not* scaled by torch (see [Note: loss scaling] in engine)."""
    if plan.spec.build is not None:
        return plan.spec.build(plan, stages, loss_fn)
    if plan.spec.multi_stage:
        return plan.spec.torch_class(stages, n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
    (stage,) = stages
    return plan.spec.torch_class(stage, n_microbatches=plan.microbatches, loss_fn=loss_fn, scale_grads=False)
