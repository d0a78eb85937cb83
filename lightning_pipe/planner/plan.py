"""A plan is data: the chosen layout as JSON (schedule, m, v, pp x dp, stage -> rank, layer boundaries, a one-line
layout, the prediction and the runners-up), and what ``PipelineStrategy(plan=...)`` needs to replay it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_pipe.config import PipelineConfig, PipelineConfigError, config_error
from lightning_pipe.planner.model import Candidate, Prediction, bounds_of
from lightning_pipe.planner.search import SearchResult
from lightning_pipe.schedules import plan_schedule

FORMAT = "lightning_pipe.plan/1"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def stage_ranks(cand: Candidate) -> list[int]:
    plan = plan_schedule(PipelineConfig(schedule=cand.schedule, microbatches=cand.microbatches,
                                        stages_per_rank=cand.stages_per_rank), cand.pipeline_size)
    return [plan.stage_to_rank(s) for s in range(plan.num_stages)]


def layout_line(cand: Candidate) -> str:
    """``1f1b m=8 v=1 pp=2 x dp=1 | rank 0: L0-3 | rank 1: L4-6``."""
    owner = stage_ranks(cand)
    bounds = bounds_of(cand.counts)
    parts = [f"{cand.schedule} m={cand.microbatches} v={cand.stages_per_rank} "
             f"pp={cand.pipeline_size} x dp={cand.data_parallel_size}"]
    for r in range(cand.pipeline_size):
        spans = [f"L{lo}-{hi - 1}" if hi - lo > 1 else f"L{lo}" for s, (lo, hi) in enumerate(bounds) if owner[s] == r]
        parts.append(f"rank {r}: " + " + ".join(spans))
    return " | ".join(parts)


def _entry(cand: Candidate, pred: Prediction) -> dict[str, Any]:
    return {"schedule": cand.schedule, "microbatches": cand.microbatches, "stages_per_rank": cand.stages_per_rank,
            "pipeline_size": cand.pipeline_size, "data_parallel_size": cand.data_parallel_size,
            "partition": list(cand.counts), "layout": layout_line(cand),
            "predicted_step_ms": round(pred.step_time * 1e3, 3), "predicted_bubble": round(pred.bubble, 4),
            "predicted_schedule_ms": round(pred.schedule_time * 1e3, 3),
            "predicted_peak_memory_bytes": list(pred.peak_memory)}


def to_plan(result: SearchResult, batch_size: int, top_k: int = 3, **extra: Any) -> dict[str, Any]:
    """The best layout of a search, with the next ``top_k - 1`` as runners-up."""
    cand, pred = result.best
    bounds = bounds_of(cand.counts)
    plan = {"format": FORMAT, **_entry(cand, pred),
            "world_size": cand.pipeline_size * cand.data_parallel_size,
            "batch_size": batch_size // cand.data_parallel_size,
            "stage_ranks": stage_ranks(cand),
            "layers": [[lo, hi - 1] for lo, hi in bounds],
            "predicted_busy_ms": [round(b * 1e3, 3) for b in pred.busy],
            # per stage, one action of each kind (what `validate --records` compares with a recorded timeline)
            "predicted_action_ms": [{k: round(pred.costs[(s, k)] * 1e3, 4) for k in "FBIW" if (s, k) in pred.costs}
                                    for s in range(len(bounds))],
            "predicted_comm_ms": [round(c * 1e3, 4) for c in pred.comm],
            "runners_up": [_entry(c, p) for c, p in result.ranked[1:top_k]],
            "memory_budget_bytes": result.memory_budget,
            "refused_over_budget": [{"layout": f"{r.candidate.schedule} m={r.candidate.microbatches} "
                                               f"v={r.candidate.stages_per_rank} pp={r.candidate.pipeline_size}",
                                     "min_peak_memory_bytes": r.peak_memory} for r in result.refused],
            "splits_replayed": result.considered}
    plan.update(extra)
    return plan


def save_plan(plan: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan, indent=2) + "\n")


def load_plan(plan: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(plan, Mapping):
        data = dict(plan)
    else:
        try:
            data = json.loads(Path(plan).read_text())
        except (OSError, ValueError) as err:  # (ValueError: not JSON, or not even text)
            raise config_error("A plan is a JSON file written by `python -m lightning_pipe.planner search`.",
                               f"plan={str(plan)!r} ({err})", "plan") from None
    missing = [k for k in ("schedule", "microbatches", "stages_per_rank", "pipeline_size", "data_parallel_size",
                           "partition") if k not in data]
    if data.get("format") != FORMAT or missing:
        raise config_error(f"A plan file has format {FORMAT!r} and the keys of a layout.",
                           f"format={data.get('format')!r}, missing {missing}", "plan")
    return data


def plan_name(plan: str | os.PathLike[str] | Mapping[str, Any]) -> str:
    """How errors name a plan: its file, or its one-line layout for a plan given as a dict."""
    if isinstance(plan, Mapping):
        return f"the plan {plan.get('layout', '(a dict)')!r}"
    return f"the plan file {str(plan)!r}"


def apply_plan(plan: str | os.PathLike[str] | Mapping[str, Any], world_size: int | None = None,
               num_layers: int | None = None, name: str | None = None) -> dict[str, Any]:
    """The ``PipelineStrategy`` settings that replay a saved plan: schedule, micro-batches, stages per rank,
    replicas and the explicit per-stage layer counts. Checks the plan against the world and the model when given
    (``name``: how the errors name the plan; default :func:`plan_name`)."""
    name = name or plan_name(plan)
    data = load_plan(plan)
    pp, dp = int(data["pipeline_size"]), int(data["data_parallel_size"])
    if world_size is not None and pp * dp != world_size:
        raise config_error("A plan is made for one world size (pipeline size x data-parallel size).",
                           f"{name}, for {pp} x {dp} = {pp * dp} ranks, on a world of {world_size}", "devices",
                           "run on that many devices, or search a new plan for this world")
    counts = [int(c) for c in data["partition"]]
    if num_layers is not None and sum(counts) != num_layers:
        raise config_error("A plan is made for one model: its partition must cover the model's layers exactly.",
                           f"{name} with partition {counts} (sum {sum(counts)}) for a model of {num_layers} layers",
                           "plan", "search a new plan for this model (python -m lightning_pipe.planner search), "
                           "or pass the plan made for it")
    kwargs = {"schedule": data["schedule"], "microbatches": int(data["microbatches"]),
              "stages_per_rank": int(data["stages_per_rank"]), "data_parallel_size": dp, "partition": counts}
    try:
        plan_schedule(PipelineConfig(**kwargs), pp)
    except PipelineConfigError as err:
        raise config_error("A plan must be a layout the strategy accepts; its layout breaks this rule:",
                           f"{name} with {kwargs}: {str(err).rstrip('.')}", "plan",
                           "search a new plan (python -m lightning_pipe.planner search)") from None
    return kwargs


def explain(plan: Mapping[str, Any]) -> str:
    """A human-readable summary: the layout, the prediction per rank, the runners-up."""
    layout = plan.get("layout") or (f"pp {plan['pipeline_size']} x dp {plan['data_parallel_size']}, "
                                    f"{plan['schedule']}, v={plan['stages_per_rank']}, m={plan['microbatches']}, "
                                    f"partition {plan['partition']}")
    lines = [f"plan: {layout}"]
    if "predicted_step_ms" not in plan:  # written by hand: a layout without a prediction
        return "\n".join(lines + ["  (no prediction: not written by `python -m lightning_pipe.planner search`)"])
    lines.append(f"  predicted step {plan['predicted_step_ms']:.1f} ms (schedule "
                 f"{plan.get('predicted_schedule_ms', plan['predicted_step_ms']):.1f} ms), bubble "
                 f"{plan.get('predicted_bubble', 0.0):.1%}, per-replica batch {plan.get('batch_size', '?')}")
    for r, (mem, busy) in enumerate(zip(plan.get("predicted_peak_memory_bytes", []),
                                        plan.get("predicted_busy_ms", []))):
        lines.append(f"  rank {r}: busy {busy:.1f} ms, peak memory {_mib(mem)}")
    if plan.get("runners_up"):
        lines.append("  runners-up:")
        for alt in plan["runners_up"]:
            lines.append(f"    {alt['predicted_step_ms']:8.1f} ms  bubble {alt['predicted_bubble']:.1%}  "
                         f"{alt['layout']}")
    for ref in plan.get("refused_over_budget", [])[:3]:
        lines.append(f"  over budget: {ref['layout']} (smallest peak {_mib(ref['min_peak_memory_bytes'])})")
    return "\n".join(lines)
