"""What a launched rank can run: scenario name -> (case type, function), one module per family.

A test builds typed cases (frozen dataclasses), ``launcher.launch`` writes them as JSON (``dataclasses.asdict``),
and ``worker`` rebuilds each with its scenario's case type (an unknown field fails there, loudly) and runs it.
Results are TypedDicts (plain dicts on the wire); a case with ``expect_error=True`` that raises gives a ``Failure``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypedDict

from tests.distributed.scenarios import (
    checkpoint,
    cluster_memory,
    expert_parallel,
    features,
    frozen,
    fsdp,
    hardening,
    hf,
    moe,
    pipedream,
    planner,
    probe,
    rebalance,
    recipe,
    rng,
    soak,
    syncs,
    trace,
    training,
)
from tests.distributed.scenarios.checkpoint import CheckpointCase
from tests.distributed.scenarios.trace import TraceCase
from tests.distributed.scenarios.training import TrainingCase

Case = (TrainingCase | CheckpointCase | TraceCase | hardening.HardeningCase | planner.SlowRankCase | hf.HFCase
        | rebalance.RebalanceCase | fsdp.FsdpCountCase | frozen.FrozenCase | recipe.RecipeCase | rng.RngCase
        | soak.SoakCase | soak.RefitCase | syncs.SyncCase | moe.AuxCase | moe.MoECase | expert_parallel.ExpertCase
        | probe.ProbeCase | cluster_memory.ClusterMemoryCase | features.FeatureCase)


class Scenario(NamedTuple):
    case_type: type[Any]
    run: Callable[[Any], Any]


class Failure(TypedDict):
    """A case that raised where it was expected to: the message every rank must agree on."""

    ok: Literal[False]
    error: str  # "<ExceptionType>: <message>"


SCENARIOS: dict[str, Scenario] = {
    "training": Scenario(TrainingCase, training.run_pipeline),
    "ckpt_train": Scenario(CheckpointCase, checkpoint.run_train),
    "ckpt_resume": Scenario(CheckpointCase, checkpoint.run_resume),
    "ckpt_crash": Scenario(CheckpointCase, checkpoint.run_crash),
    "ckpt_full": Scenario(CheckpointCase, checkpoint.run_disk_full),  # issue 23: a full disk mid-save
    "trace": Scenario(TraceCase, trace.run_trace),
    "hardening": Scenario(hardening.HardeningCase, hardening.run_pipeline),  # issue 14: test_hardening.py
    "planner_slow_rank": Scenario(planner.SlowRankCase, planner.run_slow_rank),  # issue 15: test_planner.py
    "hf": Scenario(hf.HFCase, hf.run_pipeline),  # issue 13: test_hf_parity.py
    "pipedream": Scenario(TrainingCase, pipedream.run_pipedream),  # issue 11: test_pipedream.py
    "rebalance": Scenario(rebalance.RebalanceCase, rebalance.run_rebalance),  # issue 15.8: test_rebalance.py
    "fsdp_counts": Scenario(fsdp.FsdpCountCase, fsdp.run_counts),  # issue 12: test_fsdp.py
    "frozen": Scenario(frozen.FrozenCase, frozen.run_frozen),  # issue 23: test_frozen.py
    "recipe": Scenario(recipe.RecipeCase, recipe.run_recipe),  # issue 23: tests/recipes/test_every_schedule.py
    "rng": Scenario(rng.RngCase, rng.run_pipeline),  # issue 23: test_random_streams.py
    "soak": Scenario(soak.SoakCase, soak.run_soak),  # issue 23: test_soak.py
    "refit": Scenario(soak.RefitCase, soak.run_refit),  # test_soak.py: process groups reused across fits
    "syncs": Scenario(syncs.SyncCase, syncs.run_syncs),  # issue 22.4: test_sync_points.py
    "aux_toy": Scenario(moe.AuxCase, moe.run_toy),  # issue 25: test_aux_losses.py
    "moe": Scenario(moe.MoECase, moe.run_moe),  # issue 25: test_aux_losses.py
    # issue 25: test_expert_parallel.py
    "expert_parallel": Scenario(expert_parallel.ExpertCase, expert_parallel.run_expert_parallel),
    "probe": Scenario(probe.ProbeCase, probe.run_probe),  # test_launcher.py: a rank's state before any Trainer
    "cluster_memory": Scenario(cluster_memory.ClusterMemoryCase, cluster_memory.run_cluster_memory),  # test_cluster_memory.py
    "features": Scenario(features.FeatureCase, features.run_pipeline),  # test_features.py
}

__all__ = ["Case", "CheckpointCase", "Failure", "SCENARIOS", "Scenario", "TraceCase", "TrainingCase"]
