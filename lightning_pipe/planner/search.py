"""Search the layouts: pipeline size x replicas, every valid (schedule, stages per rank, micro-batches) of the
registry, and the contiguous splits of the layers; drop those over the memory budget; rank by predicted step time.

Splits: when a combination has at most ``exhaustive_limit`` splits, all are considered, in order of a lower bound
(the busiest rank's compute plus the gradient all-reduce and the optimizer step: no step can be shorter), and
replayed until the bound passes the best replayed step, so the result is the exact optimum of the model. Beyond
that, a beam search over one- and two-layer boundary moves from several seeds (time-balanced with the ranks'
speeds, uniform, parameter-balanced): a single seed with greedy moves missed the optimum in half the cases tried.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from lightning_pipe._compat.torch import torch_gap
from lightning_pipe.config import PipelineConfig, PipelineConfigError, config_error
from lightning_pipe.layers.partition import balanced_counts, uniform_counts
from lightning_pipe.planner.model import (
    ActivationPolicy,
    Candidate,
    CostModel,
    Prediction,
    action_counts,
    bounds_of,
    predict,
)
from lightning_pipe.planner.profile import ModelProfile
from lightning_pipe.schedules import (
    SchedulePlan,
    available_schedules,
    check_split_backward,
    compute_order,
    get_schedule_spec,
    plan_schedule,
)
from lightning_pipe.schedules.simulate import CompiledOrder, compile_order, peak_activations

SEARCHABLE = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev", "v_half", "v_min")


@dataclass(frozen=True)
class Refused:
    candidate: Candidate
    peak_memory: int
    """The smallest predicted peak (bytes, busiest rank) over the combination's splits."""


@dataclass
class SearchResult:
    ranked: list[tuple[Candidate, Prediction]]
    """The best split of every (pipeline size, schedule, v, m) that fits, fastest first."""
    refused: list[Refused] = field(default_factory=list)
    memory_budget: int | None = None
    considered: int = 0
    """Splits replayed."""

    @property
    def best(self) -> tuple[Candidate, Prediction]:
        return self.ranked[0]


def parse_bytes(value: int | float | str | None) -> int | None:
    """``20GiB`` / ``512MB`` / ``1e9`` / ``None`` -> bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    text = str(value).strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    number, scale = text, 1
    for unit, factor in units.items():
        if text.lower().endswith(unit):
            number, scale = text[: -len(unit)], factor
            break
    try:
        return int(float(number) * scale)
    except ValueError:
        raise config_error("A memory budget is a number of bytes or a size such as '20GiB' / '512MB'.",
                           f"memory_budget={value!r}", "memory_budget") from None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def compositions(n: int, parts: int) -> Iterable[tuple[int, ...]]:
    """Every way to cut n layers into ``parts`` contiguous non-empty runs (as counts)."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        yield tuple(b - a for a, b in zip(edges, edges[1:]))


def combinations(world_size: int, batch_size: int, num_layers: int, schedules: Sequence[str] | None = None,
                 stages_per_rank: Sequence[int] = (1, 2), microbatches: Sequence[int] | None = None,
                 pipeline_sizes: Sequence[int] | None = None, max_microbatches: int = 32
                 ) -> Iterator[tuple[int, int, SchedulePlan]]:
    """Yield (pp, dp, plan) for every layout the registry accepts. ``batch_size`` is the global batch of a step:
    each replica gets ``batch_size / dp`` samples, cut into m micro-batches of equal size."""
    split_backward_refused = torch_gap("split_backward") is not None
    for pp in pipeline_sizes or [d for d in divisors(world_size) if d >= 2]:
        dp = world_size // pp
        if pp * dp != world_size or batch_size % dp:
            continue
        per_replica = batch_size // dp
        for name in schedules or [s for s in SEARCHABLE if s in available_schedules()]:
            spec = get_schedule_spec(name)
            if spec.split_backward and split_backward_refused:
                if schedules:  # asked for by name: say why it cannot be
                    check_split_backward(f"schedules={list(schedules)}")
                continue  # this torch computes it wrongly ([Note: torch versions]): not a candidate
            for v in stages_per_rank:
                if pp * v > num_layers:
                    continue
                for m in microbatches or [d for d in divisors(per_replica) if d <= max_microbatches]:
                    if per_replica % m:
                        continue
                    try:
                        plan = plan_schedule(PipelineConfig(schedule=spec.name, microbatches=m, stages_per_rank=v),
                                             pp)
                    except PipelineConfigError:
                        continue  # the schedule's rules refuse this (v, m) at this pipeline size
                    yield pp, dp, plan


def _seeds(model: CostModel, stage_rank: Sequence[int], n: int, stages: int) -> list[tuple[int, ...]]:
    time = [c.forward + c.backward for c in model.layers]
    params = [c.param_bytes for c in model.layers]
    seeds = {tuple(uniform_counts(n, stages)), tuple(balanced_counts(time, stages)),
             tuple(balanced_counts([p + 1 for p in params], stages))}
    # speed-aware: stage s gets a share of the total time inversely proportional to its rank's slowness
    share = [1.0 / model.slowness[stage_rank[s]] for s in range(stages)]
    total, acc, counts, start = sum(time), 0.0, [], 0
    targets = list(itertools.accumulate(x / sum(share) * total for x in share))
    for s in range(stages - 1):
        end = start + 1
        while end < n - (stages - 1 - s) and acc + time[end - 1] + time[end] / 2 <= targets[s]:
            acc += time[end - 1]
            end += 1
        acc += time[end - 1]
        counts.append(end - start)
        start = end
    counts.append(n - start)
    seeds.add(tuple(counts))
    return sorted(seeds)


def _neighbours(counts: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    for i in range(len(counts) - 1):
        for step in (1, 2, -1, -2):
            a, b = counts[i] - step, counts[i + 1] + step
            if a >= 1 and b >= 1:
                yield counts[:i] + (a, b) + counts[i + 2:]


def best_split(model: CostModel, compiled: CompiledOrder, n_layers: int, dp: int, budget: int | None,
               exhaustive_limit: int = 2000, beam_width: int = 8) -> tuple[tuple[int, ...], Prediction, int, int]:
    """The fastest split within the budget: (counts, prediction, splits replayed, smallest peak seen). Every split
    when there are at most ``exhaustive_limit`` of them (cheapest lower bound first), else a beam search from seeds."""
    search = _SplitSearch(model, compiled, dp, budget)
    if math.comb(n_layers - 1, compiled.num_stages - 1) <= exhaustive_limit:
        _search_all(search, n_layers)
    else:
        _search_beam(search, n_layers, beam_width)
    min_peak = int(search.min_peak) if search.min_peak < math.inf else 0
    if search.best is None:
        return (), None, search.replayed, min_peak  # type: ignore[return-value]
    return search.best[0], search.best[1], search.replayed, min_peak


class _SplitSearch:
    """The splits :func:`best_split` tried: the best one that fits, how many were replayed, the smallest peak."""

    def __init__(self, model: CostModel, compiled: CompiledOrder, dp: int, budget: int | None) -> None:
        self.model, self.compiled, self.dp, self.budget = model, compiled, dp, budget
        self.best: tuple[tuple[int, ...], Prediction] | None = None
        self.replayed, self.min_peak = 0, math.inf

    def fits(self, counts: tuple[int, ...]) -> bool:
        """Its static memory and peak activations within the budget (no replay needed)."""
        if self.budget is None:
            return True
        bounds, compiled = bounds_of(counts), self.compiled
        peak = max(a + b for a, b in zip(self.model.static_memory(bounds, compiled.stage_rank, len(compiled.ranks)),
                                         peak_activations(compiled, self.model.held(bounds))))
        self.min_peak = min(self.min_peak, peak)
        return peak <= self.budget

    def consider(self, counts: tuple[int, ...]) -> Prediction | None:
        """Replay it; kept if it fits and beats the best so far. ``None`` where it does not fit."""
        pred = predict(self.model, self.compiled, counts, self.dp)
        self.replayed += 1
        if self.budget is not None and max(pred.peak_memory) > self.budget:
            return None
        if self.best is None or pred.step_time < self.best[1].step_time:
            self.best = (counts, pred)
        return pred

    def step_time(self, counts: tuple[int, ...]) -> float:
        """Its predicted step time (replayed if it fits), infinite where it does not fit."""
        pred = self.consider(counts) if self.fits(counts) else None
        return pred.step_time if pred else math.inf


def _search_all(search: _SplitSearch, n_layers: int) -> None:
    """Every split, cheapest lower bound first (the busiest rank's compute plus the collectives), until no remaining
    bound can beat the best replayed split."""
    model, compiled = search.model, search.compiled
    stages, ranks, per_rank = compiled.num_stages, len(compiled.ranks), action_counts(compiled)
    heap = []
    for counts in compositions(n_layers, stages):
        bounds = bounds_of(counts)
        cost = model.stage_costs(bounds, compiled.stage_rank)
        busy = max(sum(k * cost[key] for key, k in n.items()) for n in per_rank)
        heap.append((busy + model.allreduce(bounds, compiled.stage_rank, ranks, search.dp)
                     + model.optimizer(bounds, compiled.stage_rank, ranks), counts))
    heapq.heapify(heap)
    while heap:
        bound, counts = heapq.heappop(heap)
        if search.best is not None and bound >= search.best[1].step_time:
            break  # no remaining split can beat the best replayed one
        if search.fits(counts):
            search.consider(counts)


def _search_beam(search: _SplitSearch, n_layers: int, beam_width: int) -> None:
    """From the seed splits, move a layer or two across each boundary while the best split improves."""
    seen: dict[tuple[int, ...], float] = {}
    beam = []
    for counts in _seeds(search.model, search.compiled.stage_rank, n_layers, search.compiled.num_stages):
        seen[counts] = search.step_time(counts)
        beam.append(counts)
    while True:
        before = search.best[1].step_time if search.best else math.inf
        frontier = []
        for counts in beam:
            for nb in _neighbours(counts):
                if nb not in seen:
                    seen[nb] = search.step_time(nb)
                    frontier.append(nb)
        beam = sorted(set(beam) | set(frontier), key=lambda c: seen[c])[:beam_width]
        if not frontier or (search.best and search.best[1].step_time >= before):
            break


def slowness_per_pipeline_rank(speeds: Sequence[float] | None, pp: int, dp: int) -> list[float]:
    """Global rank ``d * pp + r`` is pipeline rank r of replica d; replicas wait for each other, so a pipeline
    position runs at the pace of its slowest replica."""
    if speeds is None:
        return [1.0] * pp
    return [max(speeds[d * pp + r] for d in range(dp)) for r in range(pp)]


def search(profile: ModelProfile, world_size: int, batch_size: int, memory_budget: int | str | None = None,
           schedules: Sequence[str] | None = None, stages_per_rank: Sequence[int] = (1, 2),
           microbatches: Sequence[int] | None = None, pipeline_sizes: Sequence[int] | None = None,
           speeds: Sequence[float] | None = None, action_overhead: float | None = None,
           exhaustive_limit: int = 2000, activations: ActivationPolicy | None = None) -> SearchResult:
    """Every layout for ``world_size`` ranks and a global batch of ``batch_size`` samples, fastest first.

    ``speeds``: slowness per global rank (1.0 = the fastest, see :func:`~lightning_pipe.planner.profile.rank_speeds`).
    ``activations``: the layers recomputed / offloaded (the strategy's ``recompute`` and ``offload``).
    Raises :class:`~lightning_pipe.config.PipelineConfigError` when no layout fits the budget or none is valid."""
    budget = parse_bytes(memory_budget)
    if speeds is not None and (len(speeds) != world_size or not all(s > 0 for s in speeds)):
        raise ValueError(f"speeds: one slowness per rank of the world, each > 0 (1.0 the fastest); got {list(speeds)} "
                         f"for world size {world_size} (the planner CLI: --speeds with --world).")
    n = profile.num_layers
    ranked: list[tuple[Candidate, Prediction]] = []
    refused: list[Refused] = []
    replayed = 0
    for pp, dp, plan in combinations(world_size, batch_size, n, schedules, stages_per_rank, microbatches,
                                     pipeline_sizes):
        compiled = compile_order(compute_order(plan), plan.num_stages)
        micro_batch = batch_size / dp / plan.microbatches
        model = CostModel(profile, micro_batch, slowness_per_pipeline_rank(speeds, pp, dp), action_overhead,
                          activations)
        counts, pred, k, min_peak = best_split(model, compiled, n, dp, budget, exhaustive_limit)
        replayed += k
        cand = Candidate(pp, dp, plan.spec.name, plan.stages_per_rank, plan.microbatches, counts)
        if pred is None:
            refused.append(Refused(cand, min_peak))
        else:
            ranked.append((cand, pred))
    ranked.sort(key=lambda cp: cp[1].step_time)
    if not ranked:
        if refused:
            low = min(refused, key=lambda r: r.peak_memory)
            raise config_error(
                "No pipeline layout fits the per-device memory budget.",
                f"memory_budget={budget:,} bytes; the smallest predicted peak is {low.peak_memory:,} bytes "
                f"({low.candidate.schedule}, pp={low.candidate.pipeline_size}, m={low.candidate.microbatches})",
                "memory_budget", "raise it, add devices, or enable recompute or offload", also=("recompute", "offload"))
        raise config_error("No pipeline layout is valid for this world size, batch size and layer count.",
                           f"world_size={world_size}, batch_size={batch_size}, {n} layers, schedules={schedules}",
                           "devices", "a world of at least 2 ranks and a batch divisible by the replicas")
    return SearchResult(ranked, refused, budget, replayed)
