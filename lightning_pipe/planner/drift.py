"""A plan's prediction against a recorded timeline: the drift per action kind, and a profile calibrated from it.

The plan (``to_plan``) carries, per stage, the predicted time of one action of each kind (``predicted_action_ms``:
layer compute times the rank's slowness, plus the runtime's per-action cost) and the predicted schedule step and
bubble. The timeline (``PipelineTimeline``'s ``records.json``) holds what each rank really ran. Compared:

- F, B, I, W: the mean recorded duration of the actions of that kind against the mean predicted duration of the
  *same* actions (the loss ``L`` recorded after the last stage's forward counts as part of that forward: the
  profile times the last layer with its loss);
- idle: per rank and step, the schedule step minus its compute (waiting for peers, posting and waiting on P2P,
  bookkeeping) against the predicted makespan minus the rank's predicted busy time;
- post, wait (send/recv): per rank and step, the time spent posting P2P operations and waiting for them, shown
  with no prediction of their own (posting is in the per-action cost, waiting is idle time);
- step and bubble: the slowest rank's schedule step and the ranks' mean bubble, against the prediction.

:func:`calibrate` scales a profile's per-layer F / B / I / W times by the measured-to-predicted ratio of their kind
(the per-action cost kept as measured), so a later search plans with in-run costs.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_pipe.planner.profile import LayerCost, ModelProfile
from lightning_pipe.trace.records import COMPUTE_KINDS, StepRecord, by_step

FIELDS = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad"}


@dataclass(frozen=True)
class Drift:
    """One row: ``what`` measured against predicted (milliseconds, or a fraction for the bubble)."""

    what: str
    count: int
    measured: float
    predicted: float

    @property
    def drift(self) -> float:
        """``measured / predicted - 1`` (``+0.25``: 25 % slower than predicted)."""
        return self.measured / self.predicted - 1.0 if self.predicted else float("nan")


def _durations(records: Sequence[StepRecord]) -> dict[tuple[int, str, int | None], list[float]]:
    """(stage, kind, micro-batch) -> each recorded step's milliseconds for that action; a loss slice is added to
    its stage's forward."""
    out: dict[tuple[int, str, int | None], list[float]] = {}
    for rec in records:
        for sl in rec.slices:
            if sl.kind not in COMPUTE_KINDS or sl.stage is None:
                continue
            ms = (sl.end_ns - sl.start_ns) / 1e6
            key = (sl.stage, "F" if sl.kind == "L" else sl.kind, sl.mb)
            rows = out.setdefault(key, [])
            if sl.kind == "L" and rows:
                rows[-1] += ms  # the loss follows its forward on the last stage
            else:
                rows.append(ms)
    return out


def drift_by_kind(plan: Mapping[str, Any], records: Sequence[StepRecord], least: bool = False) -> list[Drift]:
    """The rows described in the module docstring, for every kind the records hold. ``least``: each action's
    fastest recorded duration over the steps instead of every duration (on a shared machine contention only adds
    time; the profile reads its layers the same way)."""
    predicted = plan.get("predicted_action_ms")
    if not predicted:
        raise ValueError("this plan carries no per-action prediction (written before predicted_action_ms existed); "
                         "search it again")
    rows = []
    measured = _durations(records)
    for kind in FIELDS:
        meas, pred = [], []
        for (stage, k, _), values in measured.items():
            if k == kind and stage < len(predicted) and kind in predicted[stage]:
                taken = [min(values)] if least else values
                meas += taken
                pred += [predicted[stage][kind]] * len(taken)
        if meas:
            rows.append(Drift(kind, len(meas), statistics.fmean(meas), statistics.fmean(pred)))
    busy = plan.get("predicted_busy_ms", [])
    makespan = float(plan.get("predicted_schedule_ms", plan["predicted_step_ms"]))
    idle_meas, idle_pred = [], []
    for rec in records:
        idle_meas.append((rec.wall_ns - rec.busy_ns()) / 1e6)
        if rec.pp_rank < len(busy):
            idle_pred.append(makespan - busy[rec.pp_rank])
    if idle_meas and idle_pred:
        rows.append(Drift("idle", len(idle_meas), statistics.fmean(idle_meas), statistics.fmean(idle_pred)))
    for kind in ("post", "wait"):
        spent = [sum(sl.end_ns - sl.start_ns for sl in rec.slices if sl.kind == kind) / 1e6 for rec in records]
        if any(spent):
            rows.append(Drift(kind, len(spent), statistics.fmean(spent), 0.0))
    steps = by_step(records)
    walls = [max(r.wall_ns for r in recs) / 1e6 for recs in steps.values()]
    bubbles = [statistics.fmean(r.bubble() for r in recs) for recs in steps.values()]
    rows.append(Drift("step", len(walls), statistics.median(walls), makespan))
    rows.append(Drift("bubble", len(bubbles), statistics.median(bubbles), float(plan["predicted_bubble"])))
    return rows


def format_drift(rows: Sequence[Drift]) -> str:
    lines = ["kind      actions   measured   predicted   drift"]
    for r in rows:
        if not r.predicted:
            lines.append(f"{r.what:<8} {r.count:>8} {r.measured:>7.3f}ms {'-':>10}   (per rank and step)")
        elif r.what == "bubble":
            lines.append(f"{r.what:<8} {r.count:>8} {r.measured:>9.1%} {r.predicted:>10.1%}   "
                         f"{r.measured - r.predicted:+.1%} (points)")
        else:
            lines.append(f"{r.what:<8} {r.count:>8} {r.measured:>7.3f}ms {r.predicted:>8.3f}ms   "
                         f"{r.drift:+.1%}")
    return "\n".join(lines)


def calibrate(profile: ModelProfile, rows: Sequence[Drift]) -> ModelProfile:
    """A copy of ``profile`` whose per-layer F / B / I / W times are scaled by their kind's measured / predicted
    ratio, taken on the layer part only (the per-action cost is the profile's own measurement). Kinds without a
    row keep their times; with no B recorded (zero-bubble schedules) B takes W's ratio."""
    overhead_ms = profile.action_overhead * 1e3
    ratios = {}
    for r in rows:
        if r.what in FIELDS and r.predicted > overhead_ms:
            ratios[r.what] = max(r.measured - overhead_ms, 0.0) / (r.predicted - overhead_ms)
    ratios.setdefault("B", ratios.get("W", 1.0))
    return scale_layers(profile, ratios)


def scale_layers(profile: ModelProfile, ratios: Mapping[str, float], **changes: Any) -> ModelProfile:
    """A copy of ``profile`` with each layer's F / B / I / W time times its kind's ratio (1 for a kind not given),
    the ratios noted in ``meta["calibrated"]``, and any other field replaced (``changes``)."""

    def scaled(c: LayerCost) -> LayerCost:
        return dataclasses.replace(c, **{f: getattr(c, f) * ratios.get(k, 1.0) for k, f in FIELDS.items()})

    layers = {n: [scaled(c) for c in costs] for n, costs in profile.layers.items()}
    meta = {**profile.meta, "calibrated": {k: round(v, 4) for k, v in ratios.items()}}
    return dataclasses.replace(profile, layers=layers, meta=meta, **changes)


def merge(*tables: Sequence[Drift]) -> list[Drift]:
    """Rows of several recorded runs (e.g. a 1F1B and a zero-bubble probe), per kind, weighted by their counts."""
    out: dict[str, Drift] = {}
    for rows in tables:
        for r in rows:
            old = out.get(r.what)
            if old is None:
                out[r.what] = r
            else:
                n = old.count + r.count
                out[r.what] = Drift(r.what, n, (old.measured * old.count + r.measured * r.count) / n,
                                    (old.predicted * old.count + r.predicted * r.count) / n)
    return list(out.values())
