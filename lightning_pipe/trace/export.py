"""Turn recorded pipeline steps into a Chrome/Perfetto trace, a PNG timeline, a text summary (and the CLI).

Records come from :mod:`lightning_pipe.trace` (``StepRecord``, ``records.json``)::

    python -m lightning_pipe.trace plot records.json timeline.png [--steps 2]
    python -m lightning_pipe.trace chrome records.json trace.json
    python -m lightning_pipe.trace summary records.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_pipe.trace.records import (
    COMM_KINDS,
    COMPUTE_KINDS,
    DISPATCH_KINDS,
    KIND_NAMES,
    StepRecord,
    by_step,
    load_records,
    pipeline_bubble,
)


def chrome_trace(records: Sequence[StepRecord], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Trace-event JSON (chrome://tracing, https://ui.perfetto.dev): one process per rank, one slice per action.

    Times are microseconds from the earliest recorded step start. Each recorded step is a slice that encloses its
    actions on the same track.
    """
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": meta or {}}
    t0 = min(r.start_ns for r in records)
    events: list[dict[str, Any]] = []
    for rank in sorted({r.rank for r in records}):
        rec = next(r for r in records if r.rank == rank)
        stages = ",".join(map(str, rec.stages))
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} (pp {rec.pp_rank}, dp {rec.dp_rank}, stages {stages})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "pipeline"}})

    def us(ns: int) -> float:
        return round((ns - t0) / 1000.0, 3)

    for r in records:
        events.append({"ph": "X", "name": f"step {r.step}", "cat": "step", "pid": r.rank, "tid": 0,
                       "ts": us(r.start_ns), "dur": round(r.wall_ns / 1000.0, 3),
                       "args": {"bubble": round(r.bubble(), 4), "busy_ms": r.busy_ns() / 1e6,
                                "comm_ms": r.comm_ns() / 1e6, "dispatch_ms": r.dispatch_ns() / 1e6}})
        for s in r.slices:
            args: dict[str, Any] = {"step": r.step}
            if s.stage is not None:
                args["stage"] = s.stage
            if s.mb is not None:
                args["microbatch"] = s.mb
            if s.label:
                args["carries"] = s.label
            events.append({"ph": "X", "name": s.name, "cat": KIND_NAMES[s.kind], "pid": r.rank, "tid": 0,
                           "ts": us(s.start_ns), "dur": max(round((s.end_ns - s.start_ns) / 1000.0, 3), 0.001),
                           "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}


def write_chrome_trace(records: Sequence[StepRecord], path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(records, meta)))
    return path


COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#8DCB9B", "W": "#DD8452", "L": "#8172B2",
          "post": "#B0B0B0", "wait": "#D9D9D9", "dispatch": "#C44E52"}


def plot_timeline(records: Sequence[StepRecord], path: str | Path, steps: int | None = 2,
                  meta: dict[str, Any] | None = None, dpi: int = 110) -> Path:
    """A PNG timeline: one row per rank, compute slices coloured by kind, communication grey, idle white.

    ``steps``: the last N recorded steps (``None``: all).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    grouped = by_step(records)
    if not grouped:
        raise ValueError("no records to plot")
    chosen = list(grouped)[-steps:] if steps else list(grouped)
    recs = [r for k in chosen for r in grouped[k]]
    ranks = sorted({r.rank for r in recs})
    axis = _StepAxis.of(grouped, chosen)
    fig, ax = plt.subplots(figsize=(12, 1.3 + 0.7 * len(ranks)))
    for k in chosen[1:]:
        ax.axvline(axis.offset_ms[k] - axis.gap_ms / 2, color="#666666", linestyle="--", linewidth=0.8)
    for r in recs:
        _draw_record(ax, r, ranks.index(r.rank), axis)
    labels = []
    for rank in ranks:
        rec = next(r for r in recs if r.rank == rank)
        labels.append(f"rank {rank}\nstage{'s' if len(rec.stages) > 1 else ''} {','.join(map(str, rec.stages))}")
    ax.set_yticks(range(len(ranks)), labels)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, axis.span_ms * 1.01)
    ax.set_xlabel("time in step (ms)" + ("; steps side by side, time between steps cut" if axis.gap_ms else ""))
    _legend(ax, {s.kind for r in recs for s in r.slices})
    measured = sum(pipeline_bubble(grouped[k]) for k in chosen) / len(chosen)
    ax.set_title(_title(meta or {}, len(ranks), measured, chosen), fontsize=10, pad=22)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class _StepAxis:
    """Steps side by side on one time axis (ms): each starts at its earliest rank's start; what ran between steps
    (optimizer, data, logging) is cut out and shown as a dashed separator, ``gap_ms`` wide."""

    offset_ms: dict[int, float]
    start_ns: dict[int, int]
    gap_ms: float
    span_ms: float

    @classmethod
    def of(cls, grouped: dict[int, list[StepRecord]], chosen: Sequence[int]) -> _StepAxis:
        spans = {k: (min(r.start_ns for r in grouped[k]), max(r.end_ns for r in grouped[k])) for k in chosen}
        total_ms = sum(b - a for a, b in spans.values()) / 1e6
        gap_ms = 0.03 * total_ms if len(chosen) > 1 else 0.0
        offset_ms: dict[int, float] = {}
        x = 0.0
        for k in chosen:
            offset_ms[k] = x
            x += (spans[k][1] - spans[k][0]) / 1e6 + gap_ms
        return cls(offset_ms, {k: a for k, (a, _) in spans.items()}, gap_ms, x - gap_ms)

    def at(self, step: int, ns: int) -> float:
        return self.offset_ms[step] + (ns - self.start_ns[step]) / 1e6


def _draw_record(ax: Any, r: StepRecord, y: int, axis: _StepAxis) -> None:
    """One rank's step in row ``y``: its extent (idle inside it shows as white on a thin frame), then its slices."""
    ax.broken_barh([(axis.at(r.step, r.start_ns), r.wall_ns / 1e6)], (y - 0.4, 0.8), facecolors="white",
                   edgecolors="#999999", linewidth=0.6)
    for s in r.slices:
        x0, w = axis.at(r.step, s.start_ns), (s.end_ns - s.start_ns) / 1e6
        comm = s.kind in COMM_KINDS or s.kind in DISPATCH_KINDS  # (dispatch: a thin bar over its compute)
        height = 0.3 if comm else 0.8
        ax.broken_barh([(x0, w)], (y - height / 2, height), facecolors=COLORS[s.kind],
                       edgecolors="none" if comm else "black", linewidth=0 if comm else 0.3)
        if not comm and s.kind != "L" and w > axis.span_ms / 80:
            ax.text(x0 + w / 2, y, str(s.mb), ha="center", va="center", fontsize=7, color="white")


def _legend(ax: Any, present: set[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLORS[k], edgecolor="black" if k in COMPUTE_KINDS else "none", label=KIND_NAMES[k])
               for k in (*COMPUTE_KINDS, *COMM_KINDS, *DISPATCH_KINDS) if k in present]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle"))
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), fontsize=8,
              frameon=False)


def _title(meta: dict[str, Any], ranks: int, measured: float, chosen: Sequence[int]) -> str:
    title = f"{meta.get('schedule', 'pipeline')}: p={meta.get('p', ranks)}"
    if meta.get("v", 1) not in (None, 1):
        title += f", v={meta['v']}"
    if "m" in meta:
        title += f", m={meta['m']}"
    title += f" | measured bubble {measured:.1%}"
    if meta.get("theoretical_bubble") is not None:
        title += f" (theory {meta['theoretical_bubble']:.1%})"
    return title + f" | steps {chosen[0]}" + (f"-{chosen[-1]}" if len(chosen) > 1 else "")


def summary(records: Sequence[StepRecord], meta: dict[str, Any] | None = None) -> str:
    lines = ["| step | rank | wall ms | busy ms | comm ms | bubble |", "|---|---|---|---|---|---|"]
    for k, recs in by_step(records).items():
        for r in recs:
            lines.append(f"| {k} | {r.rank} | {r.wall_ns / 1e6:.2f} | {r.busy_ns() / 1e6:.2f} | "
                         f"{r.comm_ns() / 1e6:.2f} | {r.bubble():.3f} |")
    bubbles = [pipeline_bubble(v) for v in by_step(records).values()]
    if bubbles:
        lines.append(f"mean measured bubble: {sum(bubbles) / len(bubbles):.3f}")
    theory = (meta or {}).get("theoretical_bubble")
    if theory is not None and not (isinstance(theory, float) and math.isnan(theory)):
        lines.append(f"theoretical bubble: {theory:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.trace",
                                     description="Turn saved pipeline trace records (records.json) into pictures.")
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="PNG timeline (ranks as rows)")
    plot.add_argument("records")
    plot.add_argument("out")
    plot.add_argument("--steps", type=int, default=2, help="last N recorded steps (0: all)")
    chrome = sub.add_parser("chrome", help="Chrome/Perfetto trace-event JSON")
    chrome.add_argument("records")
    chrome.add_argument("out")
    summ = sub.add_parser("summary", help="per step and rank: wall, busy, comm, bubble")
    summ.add_argument("records")
    args = parser.parse_args(argv)
    records, meta = load_records(args.records)
    if args.command == "plot":
        print(plot_timeline(records, args.out, steps=args.steps or None, meta=meta))
    elif args.command == "chrome":
        print(write_chrome_trace(records, args.out, meta))
    else:
        print(summary(records, meta))
