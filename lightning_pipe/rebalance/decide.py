"""Pure: measured per-layer times -> per-rank speeds, per-layer costs, and the split predicted to be fastest.

No torch.distributed here: every rank runs :func:`decide` on the same gathered measurements and gets the same answer
(same inputs, same floating-point operations, same order), so no rank has to broadcast the decision.

[Note: layer cost versus rank speed]
A time measured for layer ``i`` on pipeline rank ``r`` is modelled as ``w_i * s_r``: the layer's own cost times the
rank's slowness (a throttled device, a shared host). One measurement per layer cannot separate the two, so we use
one structural prior: layers of the same *kind* (class and parameter shapes, e.g. the transformer blocks) cost the
same on an equally fast rank. A rank's slowness is then the median, over its layers whose kind also lives on another
rank, of ``t_i / median_k`` (``median_k``: the median time of that kind over all ranks; the lower median per rank,
so that one slow layer among two is still the layer's); a rank without such layers counts as 1. The median keeps one unusually slow layer (extra compute) a property of the layer, not of its rank,
while a delay on every layer of a rank is read as the rank being slow. ``w_i = t_i / s_r``. Limitation: when every
layer of a kind on one rank is slow for reasons of its own, it is read as a slow rank.

[Note: the predicted step time]
The objective is the busiest stage, ``max_s s_rank(s) * sum(w_i for i in stage s)``: in steady state a pipeline
step is paced by its slowest stage (the bubble scales with it too), and the prediction needs nothing but the
measurements. The split minimising it is found exactly by a dynamic programme over contiguous splits (each stage
keeps at least one layer and stays on the rank it is on: only the layer ranges change, never the schedule's
placement). The predicted gain is ``1 - new / current`` of that objective; a rebalance happens above the threshold.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_pipe.layers.partition import balanced_counts, ranges_of


@dataclass(frozen=True)
class LayerTime:
    """One layer's measured time per training batch (forward + backward), on the pipeline rank that holds it."""

    index: int
    pp_rank: int
    kind: str
    seconds: float


@dataclass(frozen=True)
class Move:
    layer: int
    src: int
    """Pipeline rank the layer leaves."""
    dst: int
    """Pipeline rank it goes to."""


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded; ``moves`` is empty when the current split stays."""

    current: tuple[int, ...]
    """Layers per stage now."""
    proposed: tuple[int, ...]
    """Layers per stage of the best split (the current one when nothing beats it)."""
    current_time: float
    proposed_time: float
    """Predicted busiest-stage time per batch, seconds ([Note: the predicted step time])."""
    speeds: tuple[float, ...]
    """Slowness per pipeline rank (1.0 = the fastest)."""
    gain: float
    """``1 - proposed_time / current_time``."""
    threshold: float
    moves: tuple[Move, ...]
    costs: tuple[float, ...] = ()
    """Per layer, its time on a rank of slowness 1 (seconds per batch): what the split was chosen from."""

    @property
    def rebalance(self) -> bool:
        """The split changes (``moves`` can still be empty: a layer between two stages of one rank)."""
        return self.proposed != self.current


def rank_slowness(times: Sequence[LayerTime], pipeline_size: int) -> list[float]:
    """Slowness per pipeline rank, 1.0 for the fastest ([Note: layer cost versus rank speed])."""
    by_kind: dict[str, list[LayerTime]] = {}
    for t in times:
        by_kind.setdefault(t.kind, []).append(t)
    ratios: dict[int, list[float]] = {r: [] for r in range(pipeline_size)}
    for same in by_kind.values():
        if len({t.pp_rank for t in same}) < 2:
            continue  # a kind on one rank only says nothing about speeds
        reference = statistics.median(t.seconds for t in same)
        if reference <= 0:
            continue
        for t in same:
            ratios[t.pp_rank].append(t.seconds / reference)
    # The lower median: a rank holding two layers of a kind, one of them slow, is not read as a slow rank.
    raw = [statistics.median_low(ratios[r]) if ratios[r] else 1.0 for r in range(pipeline_size)]
    fastest = min(raw)
    return [v / fastest if fastest > 0 else 1.0 for v in raw]


def busiest_stage(costs: Sequence[float], counts: Sequence[int], stage_speed: Sequence[float]) -> float:
    """The objective of [Note: the predicted step time] for one split."""
    out, start = 0.0, 0
    for c, speed in zip(counts, stage_speed):
        out = max(out, speed * sum(costs[start:start + c]))
        start += c
    return out


def best_counts(costs: Sequence[float], stage_speed: Sequence[float]) -> tuple[int, ...]:
    """Contiguous split minimising the busiest stage, stage ``s`` running ``stage_speed[s]`` times slower.

    Exact (:func:`lightning_pipe.layers.partition.balanced_counts`); ties go to the split whose earlier stages are larger.
    """
    return tuple(balanced_counts(costs, len(stage_speed), stage_speed))


def moves_between(current: Sequence[int], proposed: Sequence[int], stage_rank: Sequence[int]) -> tuple[Move, ...]:
    """Layers whose pipeline rank changes, in layer order (a move between two stages of one rank is no move)."""
    old, new = ranges_of(current), ranges_of(proposed)
    out = []
    for s_old, r_old in enumerate(old):
        for i in r_old:
            s_new = next(s for s, r in enumerate(new) if i in r)
            if stage_rank[s_old] != stage_rank[s_new]:
                out.append(Move(i, stage_rank[s_old], stage_rank[s_new]))
    return tuple(sorted(out, key=lambda m: m.layer))


def decide(times: Sequence[LayerTime], current: Sequence[int], stage_rank: Sequence[int], pipeline_size: int,
           threshold: float) -> Decision:
    """The split to move to (or the current one), from one batch's measured layer times."""
    by_layer: Mapping[int, LayerTime] = {t.index: t for t in times}
    n = sum(current)
    missing = [i for i in range(n) if i not in by_layer]
    if missing:
        raise ValueError(f"rebalance: no measured time for layers {missing[:8]}")
    speeds = rank_slowness(times, pipeline_size)
    costs = [by_layer[i].seconds / speeds[by_layer[i].pp_rank] for i in range(n)]
    stage_speed = [speeds[r] for r in stage_rank]
    now = busiest_stage(costs, current, stage_speed)
    proposed = best_counts(costs, stage_speed)
    then = busiest_stage(costs, proposed, stage_speed)
    gain = 1.0 - then / now if now > 0 else 0.0
    if gain <= threshold:
        proposed, then = tuple(current), now
    moves = moves_between(current, proposed, stage_rank) if tuple(proposed) != tuple(current) else ()
    return Decision(tuple(current), tuple(proposed), now, then, tuple(speeds), gain, threshold, moves, tuple(costs))


def describe(decision: Decision, step: int) -> list[str]:
    """Log lines for one rebalance: the step, old -> new split, predicted gain, every layer moved."""
    lines = [f"PipelineStrategy rebalance at step {step}: split {list(decision.current)} -> "
             f"{list(decision.proposed)} (predicted busiest stage {decision.current_time * 1e3:.2f} -> "
             f"{decision.proposed_time * 1e3:.2f} ms per batch, gain {decision.gain:.1%} > threshold "
             f"{decision.threshold:.1%}; rank slowness {[round(s, 2) for s in decision.speeds]})"]
    lines += [f"  layer {m.layer}: pipeline rank {m.src} -> {m.dst}" for m in decision.moves]
    return lines
