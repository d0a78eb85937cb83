"""Schedules as plain data: replay per-rank compute-action lists, find deadlocks, measure the ideal bubble.

Used by the ``custom`` schedule's checks, the tests (orders as data) and the benchmarks; no process group, no model.
"""

from __future__ import annotations

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
                    t = max([t, *ready]) + cost[a.computation_type.value]
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
