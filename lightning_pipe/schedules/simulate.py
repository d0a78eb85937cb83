"""Schedules as plain data: replay per-rank compute-action lists, find deadlocks, measure the ideal bubble.

Used by the ``custom`` schedule's checks, the tests (orders as data), the benchmarks and the planner
(:func:`replay`: per-stage costs, per-link communication, per-rank activation peaks); no process group, no model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def flatten(action: Any) -> tuple[Any, ...]:
    """An action's compute parts: itself, or the sub-actions of an OVERLAP_F_B (run in order)."""
    return tuple(action.sub_actions) if action.sub_actions else (action,)


def dependencies(action: Any, num_stages: int) -> list[tuple[int, str, int]]:
    """The actions (stage, type, micro-batch) this compute action needs done first; a backward needs one of
    ``B``/``I`` of the next stage, written here as the B key (see :func:`_finished`)."""
    s, kind, m = action.stage_index, action.computation_type.value, action.microbatch_index
    if kind == "F":
        return [] if s == 0 else [(s - 1, "F", m)]
    if kind in ("B", "I"):
        return [(s, "F", m)] + ([] if s == num_stages - 1 else [(s + 1, "B", m)])
    if kind == "W":
        return [(s, "I", m)]
    raise ValueError(f"not a compute action: {action}")


def _finished(done: dict[tuple[int, str, int], float], key: tuple[int, str, int]) -> float | None:
    if key[1] == "B":  # the input gradient of a stage comes from its full backward or its input-backward
        times = [done[k] for k in ((key[0], "B", key[2]), (key[0], "I", key[2])) if k in done]
        return min(times) if times else None
    return done.get(key)


class ScheduleDeadlock(ValueError):
    """Action lists in which every rank's next action waits for another rank's (or a later own) action."""

    def __init__(self, stuck: dict[int, tuple[int, Any, tuple[int, str, int]]]) -> None:
        self.stuck = stuck  # rank -> (step, action, the (stage, type, mb) it waits for)
        parts = [f"rank {r}, step {step}: '{a}' waits for '{w[0]}{w[1]}{w[2]}'" for r, (step, a, w) in stuck.items()]
        super().__init__("; ".join(parts))


@dataclass(frozen=True)
class SimulatedStep:
    """One batch of a schedule run with fixed costs per action (see :func:`simulate`)."""

    makespan: float
    busy: dict[int, float]

    @property
    def bubble(self) -> float:
        """Idle fraction of the ranks over the step."""
        ranks = len(self.busy)
        return 1.0 - sum(self.busy.values()) / (ranks * self.makespan) if self.makespan else 0.0


def simulate(order: dict[int, list[Any]], num_stages: int, f: float = 1.0, b: float = 2.0,
             w: float | None = None) -> SimulatedStep:
    """Replay per-rank compute-action lists with costs F=f, B=b, I=b-w, W=w and free communication: every rank
    runs its actions in list order, each one starting once its inputs exist. Plain data.

    With the default ``w = b / 2`` (F = I = W, the zero-bubble papers' model) ``bubble`` is the ideal idle fraction
    of the schedule as ordered (``None`` entries are ignored: idle time comes from dependencies only). Raises
    :class:`ScheduleDeadlock` when the ranks' orders wait on each other in a cycle.
    """
    w = b / 2 if w is None else w
    cost = {"F": f, "B": b, "I": b - w, "W": w}
    queues = {r: [(i, a) for i, a in enumerate(acts) if a is not None] for r, acts in order.items()}
    pos = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    done: dict[tuple[int, str, int], float] = {}  # (stage, type, mb) -> finish time
    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for rank, queue in queues.items():
            while pos[rank] < len(queue):
                t = free[rank]
                finished: list[tuple[tuple[int, str, int], float]] = []
                blocked = False
                local = dict(done)
                for a in flatten(queue[pos[rank]][1]):
                    ready = [_finished(local, d) for d in dependencies(a, num_stages)]
                    if any(r is None for r in ready):
                        blocked = True
                        break
                    t = max([t, *(r for r in ready if r is not None)]) + cost[a.computation_type.value]
                    key = (a.stage_index, a.computation_type.value, a.microbatch_index)
                    local[key] = t
                    finished.append((key, cost[a.computation_type.value]))
                if blocked:
                    break
                for key, c in finished:
                    done[key] = local[key]
                    busy[rank] += c
                free[rank] = t
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {}
            for rank, queue in queues.items():
                if pos[rank] < len(queue):
                    step, action = queue[pos[rank]]
                    local = dict(done)
                    for a in flatten(action):
                        missing = [d for d in dependencies(a, num_stages) if _finished(local, d) is None]
                        if missing:
                            stuck[rank] = (step, action, missing[0])
                            break
                        local[(a.stage_index, a.computation_type.value, a.microbatch_index)] = 0.0
            raise ScheduleDeadlock(stuck)
    return SimulatedStep(max(free.values()) if free else 0.0, busy)


# ----------------------------------------------------------------------------------- costed replay (the planner)
Part = tuple[int, str, int]  # (stage, kind, micro-batch) of one compute part


@dataclass(frozen=True)
class CompiledOrder:
    """Per-rank compute orders reduced to tuples, built once per (schedule, p, v, m) and replayed many times."""

    num_stages: int
    ranks: tuple[tuple[tuple[Part, ...], ...], ...]
    """``ranks[r][i]``: the parts of rank r's i-th action (one, or the sub-actions of an OVERLAP_F_B)."""
    stage_rank: tuple[int, ...]
    """Which rank runs each stage (read from the order itself)."""

    @property
    def microbatches(self) -> int:
        """How many micro-batches the order runs (one more than the largest index)."""
        return 1 + max((mb for queue in self.ranks for parts in queue for _, _, mb in parts), default=-1)


def compile_order(order: dict[int, list[Any]], num_stages: int) -> CompiledOrder:
    ranks, stage_rank = [], [-1] * num_stages
    for rank in sorted(order):
        actions = []
        for a in order[rank]:
            if a is None:
                continue
            parts = tuple((x.stage_index, x.computation_type.value, x.microbatch_index) for x in flatten(a))
            for stage, _, _ in parts:
                stage_rank[stage] = rank
            actions.append(parts)
        ranks.append(tuple(actions))
    return CompiledOrder(num_stages, tuple(ranks), tuple(stage_rank))


@dataclass(frozen=True)
class Replay:
    """One batch replayed with given costs: the step's span and each rank's busy time (seconds, or cost units)."""

    makespan: float
    busy: tuple[float, ...]

    @property
    def bubble(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def replay(compiled: CompiledOrder, cost: Mapping[tuple[int, str], float],
           comm: Sequence[float] | None = None) -> Replay:
    """List-schedule the compiled order: each rank runs its actions in order, an action starts when the rank is
    free and its inputs exist. ``cost[(stage, kind)]`` is the compute time of one part; ``comm[s]`` the time for
    stage s's output (forward) or its input gradient (backward, same shape) to reach the neighbouring stage when
    that stage sits on another rank (links are independent and never queue). Raises :class:`ScheduleDeadlock`."""
    n, stage_rank = compiled.num_stages, compiled.stage_rank
    link = [0.0] * n
    if comm is not None:
        for s in range(n - 1):
            link[s] = comm[s] if stage_rank[s] != stage_rank[s + 1] else 0.0
    arrived = _Arrivals({}, {}, {})
    queues = compiled.ranks
    pos = [0] * len(queues)
    free = [0.0] * len(queues)
    busy = [0.0] * len(queues)
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for rank, queue in enumerate(queues):
            while pos[rank] < len(queue):
                done = _run_action(queue[pos[rank]], free[rank], cost, link, n, arrived)
                if done is None:  # an input is not there yet: this rank waits, the others go on
                    break
                free[rank], spent = done
                busy[rank] += spent
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise _deadlock(queues, pos, arrived, n)
    return Replay(max(free) if free else 0.0, tuple(busy))


@dataclass(frozen=True)
class _Arrivals:
    """When the data of each ``(stage, micro-batch)`` exists where it is needed during a replay."""

    fwd: dict[tuple[int, int], float]
    """Its output, on the next stage's rank."""
    grad: dict[tuple[int, int], float]
    """Its input gradient, on the previous stage's rank."""
    inp: dict[tuple[int, int], float]
    """Its input-gradient part done (a split backward's W waits for it)."""


def _run_action(parts: Sequence[Part], start: float, cost: Mapping[tuple[int, str], float],
                link: Sequence[float], n: int, arrived: _Arrivals) -> tuple[float, float] | None:
    """Run one action's parts (an OVERLAP_F_B has two) from ``start``: its end and compute time, what it produces
    recorded in ``arrived``; ``None``, and nothing recorded, where a part cannot start yet."""
    t, spent = start, 0.0
    fwd, grad, inp = arrived.fwd, arrived.grad, arrived.inp
    undo: list[tuple[dict[tuple[int, int], float], tuple[int, int], float | None]] = []
    for stage, kind, mb in parts:
        key = (stage, mb)
        if kind == "F":
            ready = 0.0 if stage == 0 else fwd.get((stage - 1, mb))
        elif kind == "W":
            ready = inp.get(key)
        else:  # B or I: the gradient from the next stage (the loss on the last), and this stage's own forward
            ready = fwd.get(key) if stage == n - 1 else grad.get((stage + 1, mb))
            own = fwd.get(key)
            ready = None if ready is None or own is None else max(ready, own - link[stage])
        if ready is None:  # a part of an OVERLAP_F_B is not ready: forget its earlier parts, retry later
            for table, written, old in reversed(undo):
                if old is None:
                    del table[written]
                else:
                    table[written] = old
            return None
        c = cost[(stage, kind)]
        t = max(t, ready) + c
        spent += c
        writes = [(fwd, t + link[stage])] if kind == "F" else \
            [(grad, t + (link[stage - 1] if stage else 0.0)), (inp, t)] if kind in "BI" else []
        for table, value in writes:
            undo.append((table, key, table.get(key)))
            table[key] = value
    return t, spent


def _deadlock(queues: Sequence[Sequence[Sequence[Part]]], pos: Sequence[int], arrived: _Arrivals, n: int) -> ScheduleDeadlock:
    """No rank can run its next action: each blocked rank's position, action and the part it waits for."""
    stuck = {}
    for r, q in enumerate(queues):
        if pos[r] < len(q):
            stage, kind, mb = q[pos[r]][0]
            wanted = (stage - 1, "F", mb) if kind == "F" else (stage, "I", mb) if kind == "W" else \
                (stage, "F", mb) if (stage, mb) not in arrived.fwd or stage == n - 1 else (stage + 1, "B", mb)
            stuck[r] = (pos[r], "+".join(f"{s}{k}{m}" for s, k, m in q[pos[r]]), wanted)
    return ScheduleDeadlock(stuck)


def peak_activations(compiled: CompiledOrder, held: Sequence[float]) -> list[float]:
    """Per rank, the most activation memory held at once: stage s's ``held[s]`` (per micro-batch) from its F until
    its full backward B, or its weight-gradient W when the backward is split (W still needs the saved inputs)."""
    peaks = []
    for queue in compiled.ranks:
        live = peak = 0.0
        for parts in queue:
            for stage, kind, _ in parts:
                live += held[stage] if kind == "F" else -held[stage] if kind in "BW" else 0.0
                peak = max(peak, live)
        peaks.append(peak)
    return peaks
