"""Logged values and torchmetrics objects under the pipeline: reduced over the ranks that read different data.

[Note: what sync_dist reduces over]
Under the strategy every rank of one replica logs the same values: a training step's loss is the pipeline's (the last
stage's, shared with every rank) and an evaluation step sees the same outputs on every pipeline rank. Only the ranks
that read different data hold different values: the replicas and FSDP shards of one pipeline position and tensor
rank (``Topology.dp_group_ranks``, the engine's ``groups.dp``). Reduced over the whole world, as Lightning's DDP
reduces, each replica's value counts once per pipeline and tensor-parallel rank: a mean, a max and a min come out
right, a sum pipeline x tensor-parallel times too large (``self.log(..., reduce_fx="sum", sync_dist=True)`` of 10
rows gave 20 on 2 pipeline ranks; torchmetrics' ``SumMetric`` the same). So, once the engine is built:

- the strategy's ``reduce`` (what ``self.log(sync_dist=True)`` calls) reduces over that data group when no group is
  given, and leaves the value as it is with one replica (lightning/collectives.py: ``all_gather`` and
  ``broadcast`` follow the same rule);
- every torchmetrics ``Metric`` of the module gathers its states over it (its ``dist_sync_fn``), unless the user
  gave it a process group or a sync function of their own;
- decisions every rank must take alike (``reduce_boolean_decision``: early stopping, checkpoint saves) still count
  the whole world.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn


def sync_metrics_over_data(module: nn.Module, engine: Any) -> Callable[[], None]:
    """Point every torchmetrics ``Metric`` of ``module`` without a process group or sync function of its own at
    the data group ([Note: what sync_dist reduces over]); returns the undo."""
    try:
        from torchmetrics import Metric
        from torchmetrics.utilities.distributed import gather_all_tensors
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return lambda: None
    degree, data = engine.groups.topology.dp_degree, engine.groups.dp

    def gather(tensor: Tensor, group: Any = None, **kwargs: Any) -> list[Tensor]:
        # torchmetrics passes the metric's own process group, None here: the data group is ours
        return [tensor] if degree == 1 else gather_all_tensors(tensor, group=data)

    changed = [m for m in module.modules()
               if isinstance(m, Metric) and m.process_group is None and m.dist_sync_fn is None]
    for metric in changed:
        metric.dist_sync_fn = gather

    def undo() -> None:
        for metric in changed:
            metric.dist_sync_fn = None

    return undo

