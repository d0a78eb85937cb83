"""V-Half and V-Min: V-shape schedules with a cap on activation memory (Qi et al., "Pipeline Parallelism with
Controllable Memory", 2024), built as per-rank action lists for torch's action-list runtime.

[Note: memory-capped V schedules]
Placement is ZB-V's: 2p stages, rank r holds stage r (first leg) and stage 2p-1-r (second leg), so a rank's
activations per micro-batch are those of two half-size stages. A *unit* below is one stage's activations for one
micro-batch, half of what a 1F1B rank keeps per micro-batch (A); 1F1B's first rank keeps p micro-batches, p*A =
2p units. The backward is split (I: input gradient, W: weight gradient) and a micro-batch's saved tensors live
until its W (I runs with ``retain_graph=True`` for W), so a unit is held from F to W: what
:func:`~lightning_pipe.schedules.simulate.peak_activations` counts on the list order, independent of timing.

The cap is the schedule: ``v_half``: p units (half of 1F1B's peak); ``v_min``: max(2, ceil(2p/3)) units (a third,
rounded up to whole units: 0.375 at p = 4; two units, the least a V order runs with, serialise rank 0). Under it we
take the order with the least simulated bubble (F = I = W = 1, :func:`~lightning_pipe.schedules.simulate.simulate`)
among these candidates, each a plain list order:

- *Building block repeated* (the paper's construction): one micro-batch's 6p actions placed in time slots with
  period T: F of stages 0, 1, ..., 2p-1, then I of 2p-1, ..., 0, then each W, every action at the earliest slot
  after its dependency whose residue mod T is still free on its rank; micro-batch j runs the block shifted by j*T.
  With T = 6 every rank is busy in the steady state (its 6 actions fill the period), the lifespans are the
  dependency chains (4p + 4 slots per rank and micro-batch) and the peak comes out at p units: V-Half. A longer T
  leaves T - 6 idle slots per period and fewer micro-batches overlap: the points between V-Half and V-Min.
- *Greedy with the cap as a rule*: unit time steps; each free rank runs the first ready one of an I (oldest
  micro-batch first), an F while it holds fewer than ``cap`` units (its first-leg stage only while fewer than
  ``cap - 1``: the last unit is kept for a second-leg forward, without which a rank full of first-leg
  micro-batches waits on itself), a W (oldest first). It never exceeds the cap, so a candidate always exists.

Candidates whose peak exceeds the cap are dropped; among the rest the least bubble wins, then the least peak, then
the least peak of rank 0 with the last stage weighing ``HEAVY_LAST_STAGE`` (1.5) units. *Why the last tie-break*:
rank 0 holds the first stage and the last, whose head, logits and loss weigh more than a block (bench/memory.py's
GPT: 1.376 units). The greedy order holds two first-stage units next to the last stage's (3.376 units: 0.42 of
1F1B's peak there, measured 0.425); a repeated block of equal bubble holds one (2.376: 0.30). A search over 24
greedy variants (priority of I / F / W, leg order, the reserve, W order) found no order with less bubble under the
caps at p = 2..8, m = 8..32 than these candidates give.

*Weighted units* (``schedule.options.last_stage_weight``, default 1): the last stage counts that many units in the
cap itself (greedy rule and filter), for a model whose head outweighs a block. It may cost bubble (V-Half, p = 4,
m = 8, weight 1.376: 18.6 % -> 36.0 %, rank 0 within p units); rank 0 needs room for 1 + weight units.

At p = 4, m = 8 this gives V-Half 18.6 % bubble (1F1B 27.3 %,
ZB-V 5.9 %) and V-Min 48.9 %: the memory/bubble trade-off of the paper; V-Min only pays off against 1F1B at larger p
and m (numbers: tests/unit/test_controllable.py, docs/schedules.md). Every order is checked like a custom
schedule's (placement, completeness, no deadlock: ``simulate``; torch's ``_validate_schedule`` and send/receive
lowering) before any rank starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec

HEAVY_LAST_STAGE = 1.5
"""Between orders of equal bubble and peak, prefer the one whose rank 0 would peak lowest if the last stage (head,
logits, loss) weighed this many times what ``weights`` say ([Note: memory-capped V schedules])."""


def memory_cap(name: str, pipeline_size: int) -> int:
    """Units (one stage's activations of one micro-batch) a rank may hold at once under ``name``."""
    p = pipeline_size
    return p if name == "v_half" else max(2, math.ceil(2 * p / 3))


def repeated_block_order(pipeline_size: int, microbatches: int, period: int) -> tuple[tuple[str, ...], ...]:
    """Per-rank compute actions of one micro-batch's V block repeated every ``period`` slots ([Note:
    memory-capped V schedules]); ``period`` >= 6 (each rank runs 6 actions per micro-batch)."""
    p, T = pipeline_size, period
    if T < 6:
        raise ValueError(f"a rank runs 6 actions per micro-batch: the period must be >= 6, got {T}")
    last = 2 * p - 1
    used: list[set[int]] = [set() for _ in range(p)]

    def place(stage: int, earliest: int) -> int:
        rank, t = (stage if stage < p else last - stage), earliest
        while t % T in used[rank]:
            t += 1
        used[rank].add(t % T)
        return t

    slot: dict[tuple[str, int], int] = {}
    t = -1
    for s in range(2 * p):
        t = slot[("F", s)] = place(s, t + 1)
    for s in reversed(range(2 * p)):
        t = slot[("I", s)] = place(s, t + 1)
    for s in range(2 * p):
        slot[("W", s)] = place(s, slot[("I", s)] + 1)
    timed: list[list[tuple[int, str]]] = [[] for _ in range(p)]
    for (kind, s), t0 in slot.items():
        for j in range(microbatches):
            timed[s if s < p else last - s].append((t0 + T * j, f"{s}{kind}{j}"))
    return tuple(tuple(a for _, a in sorted(row)) for row in timed)


def stage_weights(pipeline_size: int, last_stage_weight: float = 1.0) -> tuple[float, ...]:
    """Units per micro-batch of each of the 2p stages: 1, and ``last_stage_weight`` for the last ([Note:
    memory-capped V schedules], *Weighted units*)."""
    return (1.0,) * (2 * pipeline_size - 1) + (float(last_stage_weight),)


@lru_cache(maxsize=64)
def capped_v_order(pipeline_size: int, microbatches: int, cap: float,
                   weights: tuple[float, ...] | None = None) -> tuple[tuple[str, ...], ...]:
    """The order with the least simulated bubble among the candidates whose peak is at most ``cap`` units
    (``weights``: units per micro-batch of each stage, default 1 each)."""
    from lightning_pipe.schedules.simulate import compile_order, peak_activations, simulate

    p, m = pipeline_size, microbatches
    held = list(weights) if weights is not None else [1.0] * (2 * p)
    candidates = [greedy_v_order(p, m, cap, weights)]
    candidates += [repeated_block_order(p, m, period) for period in range(6, 6 + 2 * p + 1)]
    heavy = [*held[:-1], held[-1] * HEAVY_LAST_STAGE]  # the tie-break's weights
    best: tuple[tuple[float, float, float], tuple[tuple[str, ...], ...]] | None = None
    for rows in candidates:
        order = {r: [_compat.parse_action(a) for a in row] for r, row in enumerate(rows)}
        compiled = compile_order(order, 2 * p)
        peak = max(peak_activations(compiled, held))
        if peak > cap + 1e-9:
            continue
        # least bubble, then least peak, then least peak of rank 0 if the last stage weighs more than assumed
        key = (round(simulate(order, 2 * p).bubble, 9), peak, peak_activations(compiled, heavy)[0])
        if best is None or key < best[0]:
            best = (key, rows)
    assert best is not None, "the greedy candidate never exceeds the cap"
    return best[1]


def greedy_v_order(pipeline_size: int, microbatches: int, cap: float,
                   weights: tuple[float, ...] | None = None) -> tuple[tuple[str, ...], ...]:
    """Per-rank compute actions (``"<stage><F|I|W><mb>"``) of the greedy order under the cap ([Note: memory-capped
    V schedules]). Raises ``ValueError`` unless every rank has room for one micro-batch of both its stages (then
    the rule always makes progress)."""
    p, m = pipeline_size, microbatches
    w = list(weights) if weights is not None else [1.0] * (2 * p)
    last = 2 * p - 1
    need = max(w[r] + w[last - r] for r in range(p))
    if cap < need - 1e-9:
        raise ValueError(f"a V order needs room for one micro-batch of both stages of a rank ({need:g} units, two "
                         f"units when every stage weighs one), got cap={cap:g}")
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> finish time
    nxt = {(k, s): 0 for k in "FIW" for s in range(2 * p)}  # next micro-batch per (kind, stage)
    live = [0.0] * p
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
                    room = cap - (w[second] if s == first else 0.0)
                    if j < m and live[r] + w[s] <= room + 1e-9 and (s == 0 or ready(("F", s - 1, j), t)):
                        pick = ("F", s, j)
                        break
            if pick is None:
                waiting = [(nxt[("W", s)], s) for s in (first, second) if nxt[("W", s)] < nxt[("I", s)]
                           and ready(("I", s, nxt[("W", s)]), t)]
                if waiting:
                    j, s = min(waiting)
                    pick = ("W", s, j)
            if pick is not None:
                started.append((r, pick))
        if not started:  # every action lasts one step: nothing is in flight, nothing will become ready
            raise ValueError(f"capped V order stalls at p={p}, m={m}, cap={cap}, time {t}")
        for r, (kind, s, j) in started:
            done[(kind, s, j)] = t + 1
            nxt[(kind, s)] += 1
            live[r] += w[s] if kind == "F" else -w[s] if kind == "W" else 0.0
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
    cap, weight = memory_cap(spec.name, pipeline_size), last_stage_weight(spec, config)
    if 1.0 + weight > cap:
        raise config_error(
            f"Schedule '{spec.name}' at pipeline size {pipeline_size} caps a rank at {cap} units; rank 0 must hold "
            "one micro-batch of its first stage (1 unit) and of the last stage (last_stage_weight units) at once.",
            f"last_stage_weight={weight:g}, cap={cap}", "schedule_options",
            f"set schedule.options.last_stage_weight <= {cap - 1}, or choose v_half / a larger pipeline")
    rows = capped_v_order(pipeline_size, m, cap, stage_weights(pipeline_size, weight) if weight != 1.0 else None)
    actions = [[_compat.parse_action(a) for a in row] for row in rows]
    validate_actions(actions, pipeline_size, m, "v", 2)
    return SchedulePlan(spec, pipeline_size, 2, m, actions=tuple(tuple(row) for row in actions))


def last_stage_weight(spec: ScheduleSpec, config: PipelineConfig) -> float:
    """``schedule.options.last_stage_weight``: the last stage's activations per micro-batch in units of another
    stage's (default 1)."""
    value = config.schedule_options.get("last_stage_weight", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise config_error(
            f"Schedule '{spec.name}' reads last_stage_weight as a positive number: the last stage's activations per "
            "micro-batch relative to another stage's (its head, logits and loss weigh more).",
            f"schedule_options last_stage_weight={value!r}", "schedule_options",
            "e.g. schedule.options.last_stage_weight=1.4")
    return float(value)


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
                        options=("last_stage_weight",), needs="any m",
                        # the runtime, the action kinds and the V placement of zbv / custom (verified with TP)
                        tensor_parallel=True)


V_HALF = _spec("v_half", "V-Half (Qi et al. 2024): V placement, split backward, half of 1F1B's activation memory")
V_MIN = _spec("v_min", "V-Min (Qi et al. 2024): V placement, split backward, a third of 1F1B's activation memory")
