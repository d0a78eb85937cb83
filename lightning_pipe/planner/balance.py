"""``partition="time"`` / ``"memory"``: the split of a fixed schedule (pipeline size, v, m and replicas kept) that
the cost model predicts fastest, or with the smallest peak memory on the busiest rank.

Only the contiguous split is chosen here; :func:`~lightning_pipe.planner.search.search` chooses everything. The
answer is a :class:`~lightning_pipe.planner.search.SearchResult` (the chosen split first, then the uniform split
for comparison), so it is written, explained and replayed like any plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_pipe.config import MEASURED_PARTITIONS, PipelineConfig, PipelineConfigError, config_error
from lightning_pipe.layers.partition import uniform_counts
from lightning_pipe.planner.model import ActivationPolicy, Candidate, CostModel, Prediction, predict
from lightning_pipe.planner.profile import ModelProfile
from lightning_pipe.planner.search import (
    SearchResult,
    _neighbours,
    best_split,
    compositions,
    parse_bytes,
    slowness_per_pipeline_rank,
)
from lightning_pipe.schedules import SchedulePlan, compute_order
from lightning_pipe.schedules.simulate import CompiledOrder, compile_order


def _least_memory(model: CostModel, compiled: CompiledOrder, n: int, dp: int,
                  limit: int) -> tuple[tuple[int, ...], Prediction, int]:
    """The split with the smallest peak on its busiest rank (ties: the faster step): every split when they are at
    most ``limit``, else a descent by one- and two-layer boundary moves from the uniform split."""
    def key(pred: Prediction) -> tuple[int, float]:
        return max(pred.peak_memory), pred.step_time

    stages = compiled.num_stages
    if math.comb(n - 1, stages - 1) <= limit:
        scored = [(c, predict(model, compiled, c, dp)) for c in compositions(n, stages)]
        counts, pred = min(scored, key=lambda cp: key(cp[1]))
        return counts, pred, len(scored)
    counts = tuple(uniform_counts(n, stages))
    pred, seen = predict(model, compiled, counts, dp), 1
    improved = True
    while improved:
        improved = False
        for nb in _neighbours(counts):
            alt = predict(model, compiled, nb, dp)
            seen += 1
            if key(alt) < key(pred):
                counts, pred, improved = nb, alt, True
    return counts, pred, seen


def balance_split(profile: ModelProfile, plan: SchedulePlan, batch_size: int, by: str, data_parallel_size: int = 1,
                  speeds: Sequence[float] | None = None, memory_budget: int | str | None = None,
                  exhaustive_limit: int = 2000, activations: ActivationPolicy | None = None) -> SearchResult:
    """The best split of ``plan``'s stages by ``by`` (``"time"`` or ``"memory"``) for a per-replica batch of
    ``batch_size`` samples; ``speeds``: slowness per global rank (1.0 = the fastest). Raises
    :class:`~lightning_pipe.config.PipelineConfigError` when no split fits ``memory_budget`` (time only)."""
    if by not in MEASURED_PARTITIONS:
        raise ValueError(f"balance_split(by={by!r}): one of {MEASURED_PARTITIONS}")
    pp, dp, n = plan.pipeline_size, data_parallel_size, profile.num_layers
    if plan.num_stages > n:
        raise config_error("Every pipeline stage needs at least one layer.", f"{plan.num_stages} stages for {n} "
                           "layers", "stages_per_rank", also=("data_parallel_size", "devices"))
    compiled = compile_order(compute_order(plan), plan.num_stages)
    model = CostModel(profile, batch_size / plan.microbatches, slowness_per_pipeline_rank(speeds, pp, dp),
                      activations=activations)
    budget = parse_bytes(memory_budget)
    if by == "time":
        counts, pred, replayed, min_peak = best_split(model, compiled, n, dp, budget, exhaustive_limit)
        if pred is None:
            exhaustive = math.comb(n - 1, plan.num_stages - 1) <= exhaustive_limit
            levers = _memory_levers(plan, activations)
            advice = ["raise it"] + ([] if exhaustive else ["use partition='memory' (its search reaches splits this "
                                                            "one did not)"])
            advice += [f"enable {lever}" for lever in levers] or ["choose a schedule that keeps fewer activations"]
            seen = f"memory_budget={budget:,} bytes; the smallest predicted peak is {min_peak:,} bytes"
            raise config_error("No split of this schedule fits the per-device memory budget.",
                               seen + (" over every split" if exhaustive else ""), "memory_budget",
                               ", ".join(advice[:-1]) + " or " + advice[-1],
                               also=tuple(levers) or ("schedule",))
    else:
        counts, pred, replayed = _least_memory(model, compiled, n, dp, exhaustive_limit)

    def cand(c: Sequence[int]) -> Candidate:
        return Candidate(pp, dp, plan.spec.name, plan.stages_per_rank, plan.microbatches, tuple(c))

    ranked = [(cand(counts), pred)]
    uniform = tuple(uniform_counts(n, plan.num_stages))
    if uniform != tuple(counts):
        ranked.append((cand(uniform), predict(model, compiled, uniform, dp)))
    return SearchResult(ranked, [], budget, replayed)


def _memory_levers(plan: SchedulePlan, activations: ActivationPolicy | None) -> list[str]:
    """The settings that could lower the peak and are not on yet: recompute and offload, each unless the schedule's
    own rules refuse it (the weight-versioned ones refuse recomputation, PipeMare offload too). A schedule whose rules
    cannot be replayed from the plan alone (custom action lists live in options) keeps both."""
    policy = activations or ActivationPolicy()
    resolve = plan.spec.resolve

    def accepted(**lever: str) -> bool:
        if resolve is None:  # the standard rules take both
            return True
        config = PipelineConfig(schedule=plan.spec.name, microbatches=plan.microbatches,
                                stages_per_rank=plan.stages_per_rank, **lever)  # type: ignore[arg-type]
        try:
            resolve(plan.spec, config, plan.pipeline_size)
        except PipelineConfigError:
            return False
        return True

    replayable = accepted()
    return [key for key, on in (("recompute", bool(policy.recompute)), ("offload", bool(policy.offload)))
            if not on and (not replayable or accepted(**{key: "all"}))]
