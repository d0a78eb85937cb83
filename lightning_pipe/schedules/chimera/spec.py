"""Chimera (Li & Hoefler, SC'21, "Chimera: Efficiently Training Large-Scale Neural Networks with Bidirectional
Pipelines"): two synchronous pipelines over the same ranks, in opposite directions.

[Note: Chimera placement and semantics]
With p even, the layer list is cut into p stages as usual. The *down* pipeline places stage s on rank s, the *up*
pipeline places it on rank p-1-s ("mirror" placement), so rank r holds two stages, r and p-1-r: two different
layer ranges, so two stages' weights per rank. Of each batch's m micro-batches (m even) the down pipeline runs
0..m/2-1 and the up pipeline m/2..m-1, each micro-batch loss scaled by 1/m as everywhere ([Note: loss scaling] in
engine.py). The two copies of stage s (ranks s and p-1-s) start identical and *sum* their gradients over the pair's
own process group before the optimizer step, which gives every copy the gradient of the batch-mean loss over all m
micro-batches; both copies then take the same optimizer step and stay identical. So a step equals plain mini-batch
training (parity with one device), like every synchronous schedule. Data parallelism averages on top, ties sum
once over every rank holding a copy (both pipelines), and the global-norm clip counts each stage once.

[Note: the merged order]
Both pipelines run from one thread, so each rank needs one order over its two stages' actions.
:func:`chimera_order` builds it by list scheduling both pipelines' actions in the ideal cost model (F = 1, B = 2):
whenever a rank is free it starts the earliest ready action, ties broken by one of three rules (longest remaining
path first; backwards first, then that; oldest micro-batch first), and the rule whose order the simulator finds
shortest wins (no rule is best for every p and m). Each stage runs its micro-batches' forwards and backwards in order
(P2P messages carry no tag: the order of sends must be the order of receives), and at most p - s forwards are in
flight on stage s of a pipeline (1F1B's memory bound; allowing p in flight reaches the paper's bubble at p = 4,
m = 8 but holds up to 2p micro-batches' activations on the middle ranks). The order is plain data: actions are
torch ``_Action`` with the *global* micro-batch index, so ``compute_order`` and the simulator
(:func:`~lightning_pipe.schedules.simulate.simulate`, whose deadlock check accepts it) read it like any schedule's;
the up pipeline is the one with micro-batches >= m/2.

Bubble: the paper's basic schedule has (p - 2) / (2m + p - 2) (Table 2; D = p stages, N = m micro-batches), against
1F1B's (p - 1) / (m + p - 1); that is what ``theoretical_bubble`` reports (as for ZeroBubble, the paper's estimate;
the measured ``pipeline/bubble`` tells the truth). Our order simulates above it (F = 1, B = 2: p = 4, m = 4: 0.25
against 0.2 in the paper and 0.43 for 1F1B; m = 8: 0.172 / 0.111 / 0.273); p = 2 has no bubble.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec
from lightning_pipe.schedules.chimera.engine import ChimeraEngine
from lightning_pipe.schedules.chimera.runtime import DOWN, UP, ChimeraRuntime
from lightning_pipe.schedules.simulate import simulate


def stage_rank(pipeline: int, stage: int, p: int) -> int:
    """Where a pipeline places a stage: down on rank ``stage``, up on rank ``p - 1 - stage``."""
    return stage if pipeline == DOWN else p - 1 - stage


# Tie-breaks among actions ready at the same time, tried in turn (see [Note: the merged order]): the longest
# remaining path first, the same with backwards before forwards, the oldest micro-batch first.
PRIORITIES: dict[str, Callable[[str, int, int, int, float, float], tuple[float, ...]]] = {
    # (kind, p, stage, index of the micro-batch in its pipeline, F cost, B cost) -> sort key
    "critical_path": lambda kind, p, s, i, f, b: (_remaining(kind, p, s, f, b),),
    "backward_first": lambda kind, p, s, i, f, b: (kind == "F", _remaining(kind, p, s, f, b)),
    "oldest_first": lambda kind, p, s, i, f, b: (i, kind == "F"),
}


def _remaining(kind: str, p: int, s: int, f: float, b: float) -> float:
    """Minus the work left on the micro-batch's path after this action starts (longest first)."""
    return -((p - 1 - s) * f + p * b) if kind == "F" else -(s * b)


def chimera_order(p: int, m: int, f: float = 1.0, b: float = 2.0) -> dict[int, list[Any]]:
    """Per-rank merged compute order of both pipelines ([Note: the merged order]); global micro-batch indices.
    The best of :data:`PRIORITIES` in the simulator (F = ``f``, B = ``b``); ties go to the first."""
    best: tuple[float, dict[int, list[Any]]] | None = None
    for rule in PRIORITIES:
        order = list_schedule(p, m, rule, f, b)
        span = simulate(order, p, f, b).makespan
        if best is None or span < best[0] - 1e-9:
            best = (span, order)
    assert best is not None
    return best[1]


def list_schedule(p: int, m: int, rule: str, f: float = 1.0, b: float = 2.0) -> dict[int, list[Any]]:
    """Both pipelines' actions list-scheduled with one tie-break rule of :data:`PRIORITIES`."""
    priority, half = PRIORITIES[rule], m // 2
    next_f = {(q, s): 0 for q in (DOWN, UP) for s in range(p)}
    next_b = dict(next_f)
    finish: dict[tuple[int, str, int], float] = {}
    free = [0.0] * p
    order: dict[int, list[Any]] = {r: [] for r in range(p)}
    for _ in range(4 * p * half):
        best: tuple[Any, ...] | None = None
        for q in (DOWN, UP):
            for s in range(p):
                rank, i, j = stage_rank(q, s, p), next_f[(q, s)], next_b[(q, s)]
                candidates = []
                if i < half and i - j < p - s:  # the next forward, within 1F1B's in-flight bound
                    mb = q * half + i
                    ready = 0.0 if s == 0 else finish.get((s - 1, "F", mb))
                    if ready is not None:
                        candidates.append((max(free[rank], ready), priority("F", p, s, i, f, b), q, s, "F", mb))
                if j < i:  # the next backward, once its forward ran and the next stage's backward did
                    mb = q * half + j
                    ready = finish[(s, "F", mb)] if s == p - 1 else finish.get((s + 1, "B", mb))
                    if ready is not None:
                        start = max(free[rank], ready, finish[(s, "F", mb)])
                        candidates.append((start, priority("B", p, s, j, f, b), q, s, "B", mb))
                for c in candidates:
                    best = c if best is None or c < best else best
        assert best is not None, "list_schedule: no action is ready (cannot happen: each pipeline is a 1F1B)"
        start, _, q, s, kind, mb = best
        rank = stage_rank(q, s, p)
        free[rank] = finish[(s, kind, mb)] = start + (f if kind == "F" else b)
        (next_f if kind == "F" else next_b)[(q, s)] += 1
        order[rank].append(_compat.parse_action(f"{s}{kind}{mb}"))
    return order


def bubble_chimera(p: int, v: int, m: int) -> float:
    """The Chimera paper's bubble ratio of its basic bidirectional schedule: (p - 2) / (2m + p - 2)."""
    return (p - 2) / (2 * m + p - 2)


def resolve(spec: ScheduleSpec, config: PipelineConfig, pipeline_size: int) -> SchedulePlan:
    """p even (each rank pairs stage r with stage p-1-r), one stage per rank per pipeline, m even (two halves)."""
    p = pipeline_size
    if p % 2 or p < 2:
        raise config_error(
            "Schedule 'chimera' needs an even pipeline size: rank r holds stage r of the down pipeline and stage "
            "p-1-r of the up pipeline, which must be different stages.",
            f"pipeline size={p}", "devices", "an even number of pipeline ranks (devices / data_parallel_size)",
            also=("data_parallel_size", "schedule"))
    if config.stages_per_rank not in (None, 1):
        raise config_error("Schedule 'chimera' runs one stage per rank in each of its two pipelines.",
                           f"stages_per_rank={config.stages_per_rank}", "stages_per_rank", "leave it unset or 1")
    m = config.microbatches if config.microbatches is not None else 2 * p
    if m % 2 or m < 2:
        raise config_error("Schedule 'chimera' splits each batch's micro-batches in two halves (one per pipeline), "
                           "so it needs an even micro-batch count.", f"microbatches={m}", "microbatches",
                           f"e.g. {m + 1 if m % 2 else 2}")
    return SchedulePlan(spec, p, 1, m)


def order(plan: SchedulePlan) -> dict[int, list[Any]]:
    return chimera_order(plan.pipeline_size, plan.microbatches)


CHIMERA = ScheduleSpec(
    "chimera", ChimeraRuntime,
    "Chimera: two synchronous 1F1B pipelines in opposite directions on the same ranks (p even)",
    placement="mirror", theory_bubble=bubble_chimera, resolve=resolve, order=order, engine=ChimeraEngine,
    tensor_parallel=True, needs="p even, m even")
