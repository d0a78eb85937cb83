"""Training batches whose rows do not divide into the micro-batches (the short last batch of an epoch).

[Note: ragged batches]
A batch of ``R`` rows with ``R % m != 0`` (a loader with ``drop_last=False``, an IterableDataset's short last batch)
is cut as ``torch.tensor_split`` cuts it: the first ``R % m`` micro-batches one row longer (10 rows in 4: 3, 3, 2,
2). They run as the module's own micro-batches do ([Note: micro-batches of their own length] in microbatches.py):
each one's shapes are planned, so only layouts with a shape planner can ([Note: shapes without re-inference]).
One device computes the batch's mean loss over ``R`` rows, which is the micro-batches' means weighted by their rows:
each micro-batch's loss is scaled by ``m * r_i / R`` on top of the usual ``1 / (m * accumulate)`` ([Note: loss
scaling] in engine.py), and the logged loss is the same weighted mean. A ``(sum, count)`` loss needs nothing: it is
the global sum over the global count already. Fewer rows than micro-batches would leave a micro-batch empty, and a
layout without a planner cannot run micro-batches of different shapes: both are refused with the rule, before the
first step where the loader's size tells (lightning/preflight.py), else at that batch, naming ``drop_last``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pipe.config import PipelineConfigError
from lightning_pipe.layers.batches import leaves
from lightning_pipe.layers.stages import LayerContractError
from lightning_pipe.runtime.microbatches import Microbatches, cut_rows


def why_ragged_cannot_run(rows: int, m: int, planner_why_not: str | None) -> str | None:
    """Why a training batch of ``rows`` rows cannot be cut into ``m`` micro-batches here (``None``: it can).
    ``planner_why_not``: why this layout plans no shapes (``None``: it plans them)."""
    if rows % m == 0:
        return None
    if rows < m:
        return f"{rows} rows cannot fill {m} micro-batches (one would be empty)"
    if planner_why_not is not None:
        return (f"micro-batches of unequal rows need planned shapes ([Note: shapes without re-inference]), which "
                f"this run has not: {planner_why_not}")
    return None


def refusal(what: str, rows: int, m: int, why: str) -> PipelineConfigError:
    """The error for a ragged training batch that cannot run ([Note: ragged batches])."""
    return PipelineConfigError(
        f"A training batch of {rows} rows ({what}) does not divide into microbatches={m}, and {why}. Rule: a batch "
        "whose rows do not divide into the micro-batches is cut unevenly (torch.tensor_split), with the loss weighted "
        "by each micro-batch's rows, where shapes are planned and every micro-batch gets a row. Use "
        f"DataLoader(drop_last=True), or a batch size that leaves a multiple of {m} rows (microbatches is "
        "PipelineStrategy(microbatches=...), Hydra schedule.microbatches).")


def split_ragged(args: tuple[Tensor, ...], target: Any, m: int, owner: str) -> Microbatches:
    """The batch cut into ``m`` micro-batches of unequal rows, its target with them ([Note: ragged batches])."""
    rows = args[0].shape[0]
    bad = [tuple(t.shape) for t in leaves(target) if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != rows]
    if target is None or bad:
        raise LayerContractError(
            f"{owner}.split_batch returned a training target whose tensors do not all hold the batch's {rows} rows in "
            f"dim 0 (got {bad or 'None'}). Rule: the target is cut into micro-batches along dim 0 like the inputs.")
    pieces = [torch.tensor_split(a, m) for a in args]
    return Microbatches([tuple(p[i] for p in pieces) for i in range(m)], cut_rows(target, m))


def row_weights(mbs: Microbatches) -> list[float]:
    """Each micro-batch's weight ``m * r_i / R`` in the mean loss (1.0 each for equal rows)."""
    rows = [mb[0].shape[0] for mb in mbs.args]
    total = sum(rows)
    return [len(rows) * r / total for r in rows]


__all__ = ["refusal", "row_weights", "split_ragged", "why_ragged_cannot_run"]
