"""The planner: profile the layers, simulate schedules with measured costs, search the layout, save it as data.

``python -m lightning_pipe.planner profile|search|explain|validate`` from the shell; from Python
:func:`profile_model` -> :func:`search` -> :func:`to_plan` / :func:`save_plan`, and
``PipelineStrategy(**apply_plan("plan.json"))`` (or ``PipelineStrategy(plan="plan.json")``) to train with it.
Plain torch: no Lightning here.
"""

from lightning_pipe.planner.balance import balance_split
from lightning_pipe.planner.calibrate import measure_action_overhead
from lightning_pipe.planner.drift import Drift, calibrate, drift_by_kind
from lightning_pipe.planner.model import Candidate, CostModel, Prediction, predict
from lightning_pipe.planner.plan import apply_plan, explain, layout_line, load_plan, save_plan, to_plan
from lightning_pipe.planner.profile import LayerCost, ModelProfile, measure_link, profile_model, rank_speeds
from lightning_pipe.planner.search import SearchResult, parse_bytes, search

__all__ = [
    "Candidate",
    "CostModel",
    "Drift",
    "LayerCost",
    "ModelProfile",
    "Prediction",
    "SearchResult",
    "apply_plan",
    "balance_split",
    "calibrate",
    "drift_by_kind",
    "explain",
    "layout_line",
    "load_plan",
    "measure_action_overhead",
    "measure_link",
    "parse_bytes",
    "predict",
    "profile_model",
    "rank_speeds",
    "save_plan",
    "search",
    "to_plan",
]
