"""V-Half and V-Min: V-shape schedules with a cap on activation memory (Qi et al., "Pipeline Parallelism with
Controllable Memory", 2024), built as per-rank action lists for torch's action-list runtime.

[Note: memory-capped V schedules]
Placement is ZB-V's: 2p stages, rank r holds stage r (first leg) and stage 2p-1-r (second leg), so the whole model's
activations per micro-batch on a rank are those of two half-size stages. A *unit* below is one stage's activations
for one micro-batch, i.e. half of what a 1F1B rank keeps per micro-batch (A); 1F1B's first rank keeps p micro-batches,
p*A = 2p units. The backward is split (I: input gradient, W: weight gradient) and torch keeps every saved tensor of
a micro-batch until its W has run, so a unit is held from F to W (what
:func:`~lightning_pipe.schedules.simulate.peak_activations` counts).

The paper builds V-Half and V-Min from a repeated building block whose lifespan sets the memory. We get the same
memory points from a greedy list scheduler with the cap as a hard rule, which is simpler to state and to prove:
time advances in unit steps (F = I = W = 1, the zero-bubble papers' cost model); at each step every free rank runs
the first ready action of

1. an input backward ``I`` (it is on the critical path; the older micro-batch first, the second leg on a tie),
2. a forward ``F``, only while the rank holds fewer than ``cap`` units, and for its first-leg stage only while it
   holds fewer than ``cap - 1`` (the last unit is kept for a second-leg forward: without that reserve, a rank full
   of first-leg micro-batches waits for its own second-leg forwards and the pipeline deadlocks); second leg first,
3. a weight backward ``W`` (filler; it frees a unit), oldest first;

and stays idle when none is ready. Each stage runs its micro-batches' F, I and W in micro-batch order. The cap is
the schedule: ``v_half``: p units (p/2 micro-batches of 1F1B's, half of its peak); ``v_min``: max(2, ceil(2p/3))
units (a third, rounded up to whole units: at p = 4 that is 3 units = 0.375 of 1F1B; two units, the least any V
order can run with, idles rank 0 most of the step). Without a cap (2m units) the rule gives a ZB-V-like order.
The bubble grows as the cap shrinks: at p = 4, m = 8 (F = I = W) V-Half idles about as much as ZB-H1, V-Min
about as much as 1F1B (measured by ``simulate`` in tests/unit/test_controllable.py, quoted in docs/schedules.md),
the paper's trade-off. The orders are plain data, checked like a custom schedule's (no deadlock: ``simulate``;
torch's ``_validate_schedule`` and send/receive lowering) before any rank starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec


def memory_cap(name: str, pipeline_size: int) -> int:
    """Units (one stage's activations of one micro-batch) a rank may hold at once under ``name``."""
    p = pipeline_size
    return p if name == "v_half" else max(2, math.ceil(2 * p / 3))


@lru_cache(maxsize=64)
def capped_v_order(pipeline_size: int, microbatches: int, cap: int) -> tuple[tuple[str, ...], ...]:
    """Per-rank compute actions (``"<stage><F|I|W><mb>"``) of the capped greedy V order ([Note: memory-capped V
    schedules]). Raises ``ValueError`` when the rule stops making progress (it does not for cap >= 2)."""
    p, m = pipeline_size, microbatches
    if cap < 2:
        raise ValueError(f"a V order needs room for two units per rank, got cap={cap}")
    last = 2 * p - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> finish time
    nxt = {(k, s): 0 for k in "FIW" for s in range(2 * p)}  # next micro-batch per (kind, stage)
    live = [0] * p
    orders: list[list[str]] = [[] for _ in range(p)]

    def ready(key: tuple[str, int, int], t: int) -> bool:
        return key in done and done[key] <= t

    t, remaining = 0, 3 * 2 * p * m
    while remaining:
        started = []
        for r in range(p):
            first, second = r, last - r
            pick: tuple[str, int, int] | None = None
            cands = []
            for s in (first, second):
                j = nxt[("I", s)]
                if j < m and ready(("F", s, j), t) and (s == last or ready(("I", s + 1, j), t)):
                    cands.append((j, -s, s))
            if cands:
                _, _, s = min(cands)
                pick = ("I", s, nxt[("I", s)])
            if pick is None:
                for s in (second, first):
                    j = nxt[("F", s)]
                    room = cap - (1 if s == first else 0)
                    if j < m and live[r] < room and (s == 0 or ready(("F", s - 1, j), t)):
                        pick = ("F", s, j)
                        break
            if pick is None:
                cands = [(nxt[("W", s)], s) for s in (first, second) if nxt[("W", s)] < nxt[("I", s)]
                         and ready(("I", s, nxt[("W", s)]), t)]
                if cands:
                    j, s = min(cands)
                    pick = ("W", s, j)
            if pick is not None:
                started.append((r, pick))
        if not started:  # every action lasts one step: nothing is in flight, nothing will become ready
            raise ValueError(f"capped V order stalls at p={p}, m={m}, cap={cap}, time {t}")
        for r, (kind, s, j) in started:
            done[(kind, s, j)] = t + 1
            nxt[(kind, s)] += 1
            live[r] += 1 if kind == "F" else -1 if kind == "W" else 0
            orders[r].append(f"{s}{kind}{j}")
            remaining -= 1
        t += 1
    return tuple(tuple(o) for o in orders)


def resolve(spec: ScheduleSpec, config: PipelineConfig, pipeline_size: int) -> SchedulePlan:
    """Two stages per rank in V placement, m >= 1 (default 2 * stages), the capped order checked as data."""
    from lightning_pipe.schedules.custom import validate_actions  # the custom schedule's checks, same data

    v = config.stages_per_rank if config.stages_per_rank is not None else 2
    if v != 2:
        raise config_error(f"Schedule '{spec.name}' needs stages_per_rank in [2] (V placement).",
                           f"stages_per_rank={v}", "stages_per_rank")
    m = config.microbatches if config.microbatches is not None else 4 * pipeline_size
    if m < 1:
        raise config_error(f"Schedule '{spec.name}' needs at least one micro-batch.", f"microbatches={m}",
                           "microbatches")
    rows = capped_v_order(pipeline_size, m, memory_cap(spec.name, pipeline_size))
    actions = [[_compat.parse_action(a) for a in row] for row in rows]
    validate_actions(actions, pipeline_size, m, "v", 2)
    return SchedulePlan(spec, pipeline_size, 2, m, actions=tuple(tuple(row) for row in actions))


def build(plan: SchedulePlan, stages: list[Any], loss_fn: Callable[..., Any]) -> Any:
    assert plan.actions is not None, "resolve() sets the action lists"
    return _compat.action_list_schedule(stages, plan.microbatches, loss_fn,
                                        {rank: list(row) for rank, row in enumerate(plan.actions)})


def _bubble(name: str) -> Callable[[int, int, int], float]:
    def bubble(p: int, v: int, m: int) -> float:
        from lightning_pipe.schedules.simulate import simulate

        rows = capped_v_order(p, m, memory_cap(name, p))
        order = {r: [_compat.parse_action(a) for a in row] for r, row in enumerate(rows)}
        return simulate(order, 2 * p).bubble
    return bubble


def _spec(name: str, what: str) -> ScheduleSpec:
    return ScheduleSpec(name, _compat.PipelineScheduleRuntime, what, multi_stage=True, placement="v",
                        default_stages_per_rank=2, allowed_stages_per_rank=(2,), min_microbatches="none",
                        resolve=resolve, build=build, theory_bubble=_bubble(name), split_backward=True,
                        # the runtime, the action kinds and the V placement of zbv / custom (verified with TP)
                        tensor_parallel=True)


V_HALF = _spec("v_half", "V-Half (Qi et al. 2024): V placement, split backward, half of 1F1B's activation memory")
V_MIN = _spec("v_min", "V-Min (Qi et al. 2024): V placement, split backward, a third of 1F1B's activation memory")
