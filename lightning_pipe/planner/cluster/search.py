"""Search every layout of a cluster: tensor x pipeline x data parallel sizes, micro-batch size, stages per rank,
schedule, recomputation and ZeRO, each predicted by :class:`~lightning_pipe.planner.cluster.project.Projector`.

[Note: the cluster search's bound]
Thousands of layouts, and the replay of one with hundreds of micro-batches over dozens of ranks takes up to a second
(its compute order most of it), so layouts are replayed in order of a lower bound on their step and the search
stops once the bound passes the k-th best replayed step: the result is the model's exact top k. The bound: some
rank r must run all its actions, m x (F + B) of each of its stages, after micro-batch 0's forward has crossed the
stages before its first one, and (the backward not split) its last backward is followed by the backward of those
stages; plus what runs after the schedule (the exposed gradient reduction, the tied embedding's sum, the optimizer
step), which the prediction adds as it is.
Memory: everything but the activations is exact before the replay, and the activations have a floor from the same
schedule with few micro-batches (a compute order of pp x pp actions, not m x pp), so most layouts that cannot fit
are never replayed.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_pipe.planner.cluster.layout import FIELDS, Layout, check_layout, plan_of
from lightning_pipe.planner.cluster.memory import MemoryModel
from lightning_pipe.planner.cluster.project import Prepared, Projection, Projector, compiled_order
from lightning_pipe.planner.cluster.specs import SpecError, spec_error
from lightning_pipe.schedules import get_schedule_spec

MAX_MBS = 64
MAX_V = 8


@dataclass
class SearchOutcome:
    ranked: list[Projection]
    """The best layouts that fit, fastest first."""
    layouts: int = 0
    """Valid layouts considered."""
    replayed: int = 0
    over_memory: int = 0
    """Layouts replayed and found not to fit (their activations)."""
    seconds: float = 0.0
    best_refused: Projection | None = field(default=None)
    """The fastest layout that did not fit, when none fits."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(proj: Projector, fixed: Mapping[str, Any]) -> Iterator[Layout]:
    """Every layout of the cluster the stack runs, agreeing with the ``fixed`` fields."""
    model, cluster, stack, batch = proj.model, proj.cluster, proj.stack, proj.global_batch

    def pick(key: str, options: list[Any]) -> list[Any]:
        return [fixed[key]] if key in fixed else options

    for tp in pick("tp", [t for t in _divisors(cluster.gpus_per_node) if cluster.gpus % t == 0]):
        for pp in pick("pp", [p for p in _divisors(cluster.gpus // tp) if p <= model.layers + 3]):
            dp = cluster.gpus // (tp * pp)
            if tp * pp * dp != cluster.gpus or "dp" in fixed and fixed["dp"] != dp or batch % dp:
                continue
            for mbs in pick("mbs", [b for b in _divisors(batch // dp) if b <= MAX_MBS]):
                # one pipeline rank: every schedule runs the same forward-backward pairs
                for schedule in pick("schedule", list(stack.schedules) if pp > 1 else ["1f1b"]):
                    spec = get_schedule_spec(schedule)
                    allowed = spec.allowed_stages_per_rank or tuple(range(max(1, spec.min_stages_per_rank),
                                                                          MAX_V + 1))
                    for v in pick("v", [v for v in allowed if v == 1 or pp > 1]):
                        for recompute in pick("recompute", list(stack.recompute_modes)):
                            for zero in pick("zero", list(stack.zero_modes) if dp > 1 else [0]):
                                for split in pick("split", list(stack.splits)):
                                    yield Layout(tp, pp, dp, mbs, v, schedule, recompute, zero, split)


def lower_bound(prep: Prepared, microbatches: int, split_backward: bool) -> float:
    """[Note: the cluster search's bound]."""
    best = 0.0
    for r in set(prep.stage_rank):
        mine = [s for s, owner in enumerate(prep.stage_rank) if owner == r]
        busy = microbatches * sum(prep.cost[(s, "F")] + prep.cost[(s, "B")] for s in mine)
        before = range(min(mine))
        lead = sum(prep.cost[(s, "F")] for s in before)
        tail = 0.0 if split_backward else sum(prep.cost[(s, "B")] for s in before)
        best = max(best, lead + busy + tail)
    return best + sum(prep.extra.values())


def memory_floor(proj: Projector, prep: Prepared) -> float:
    """A floor of the fullest rank's bytes, without the layout's own compute order: everything but the activations
    exactly, and the activations the same schedule keeps with pp micro-batches when m is a multiple of pp: no
    schedule searched here keeps less on any rank with a multiple of pp (tests/unit/test_cluster_planner.py;
    between multiples torch's interleaved warm-up can hold more: those are computed at m)."""
    layout = prep.layout
    m = layout.microbatches(proj.global_batch)
    small = layout.pp if m % layout.pp == 0 and layout.pp < m and _accepts(layout, layout.pp) else m
    compiled = compiled_order(layout.schedule, layout.pp, layout.v, small)
    parts = MemoryModel(proj.model, proj.cluster, proj.stack, layout, m).per_rank(compiled, prep.stages)
    return max(sum(p.values()) for p in parts)


def _accepts(layout: Layout, microbatches: int) -> bool:
    try:
        plan_of(layout, microbatches * layout.dp * layout.mbs)
    except SpecError:
        return False
    return True


def search(proj: Projector, fixed: Mapping[str, Any] | None = None, top: int = 5,
           progress: Callable[[int, int], None] | None = None) -> SearchOutcome:
    """The ``top`` fastest layouts that fit (exact for the model: [Note: the cluster search's bound])."""
    start = time.perf_counter()
    fixed = dict(fixed or {})
    capacity = proj.cluster.memory_gib * 2**30
    heap: list[tuple[float, int, Layout]] = []
    outcome = SearchOutcome([])
    over_state: list[tuple[float, Layout]] = []
    for layout in layouts(proj, fixed):
        try:
            check_layout(layout, proj.model, proj.cluster, proj.stack, proj.global_batch)
        except SpecError:
            continue
        outcome.layouts += 1
        prep = proj.prepare(layout)
        split = get_schedule_spec(layout.schedule).split_backward
        bound = lower_bound(prep, layout.microbatches(proj.global_batch), split)
        if memory_floor(proj, prep) > capacity:
            over_state.append((bound, layout))
            continue
        heap.append((bound, outcome.layouts, layout))
    heapq.heapify(heap)
    total = len(heap)
    while heap:
        bound, _, layout = heapq.heappop(heap)
        if len(outcome.ranked) >= top and bound >= outcome.ranked[top - 1].iteration_s:
            break
        pred = proj.predict(layout, check=False)
        outcome.replayed += 1
        if progress is not None:
            progress(outcome.replayed, total)
        if not pred.fits:
            outcome.over_memory += 1
            if outcome.best_refused is None or pred.iteration_s < outcome.best_refused.iteration_s:
                outcome.best_refused = pred
            continue
        outcome.ranked.append(pred)
        outcome.ranked.sort(key=lambda p: p.iteration_s)
        del outcome.ranked[top:]
    if not outcome.ranked and outcome.best_refused is None and over_state:
        outcome.best_refused = proj.predict(min(over_state, key=lambda bl: bl[0])[1], check=False)
    outcome.seconds = time.perf_counter() - start
    if outcome.layouts == 0:
        raise spec_error("No layout of this cluster runs this model at this batch (tp x pp x dp = GPUs, tp inside a "
                         "node and dividing the heads, the batch divisible by dp x mbs, the schedule's rules).",
                         f"{proj.cluster.gpus} GPUs, global batch {proj.global_batch}, fixed "
                         f"{ {k: fixed[k] for k in FIELDS if k in fixed} }", "--layout, --global-batch or --cluster")
    return outcome
