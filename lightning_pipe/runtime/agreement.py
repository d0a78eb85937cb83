"""One collective per training step: the step's loss, the replicas' target count and the adapter's step flags.

[Note: one collective at the step's end]
A training step needs three results from other ranks: the loss from the last stage (a broadcast over the pipeline
group), the target count summed over the replicas (token-weighted loss), and the adapter's step flags set on any
rank of the world (SIGTERM, SLURM requeue, "last batch here" / "more here": lightning/faults.py). Each collective is
a synchronisation point that costs a round trip and any skew between the ranks, so the three are one SUM all-reduce
over the world of a small float64 vector:

* one (value, count) slot per pipeline, i.e. per (data-parallel index, tensor rank): written by that pipeline's
  last stage only, zeros everywhere else. A sum of one value and zeros is that value, bit for bit, so every rank
  reads exactly what a broadcast would give it (a mean loss has count -1);
* the replicas' target count is the sum of the count column over the data-parallel indices at this rank's tensor
  rank: the sum the count all-reduce computed;
* the flags, as 0 / 1: a sum > 0 is "set on some rank", what the MAX computed;
* where every tie group is the world, the tied copies' fresh gradients ([Note: tie sums in the agreement] in
  parallel/grads.py).

Every rank of the world runs the same training steps (that is what the flags check), so every rank reaches this
all-reduce at the same point of the step. The agreed flags stay a tensor until the adapter reads them, after the
step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.parallel.topology import Topology


@dataclass(frozen=True)
class StepAgreement:
    """What every rank reads from the step's one all-reduce (:func:`agree_step`)."""

    pipeline: Tensor
    """This rank's pipeline's ``(value, count)`` (float64; count -1 for a mean loss), as its last stage holds it."""
    replicas_count: Tensor
    """The count column summed over the data-parallel replicas (0-d float64)."""
    flags: Tensor
    """The step flags, each set on some rank of the world (bool, one per flag)."""


def agree_step(local: Tensor, is_last: bool, flags: Sequence[bool], topology: Topology,
               extra: Tensor | None = None) -> StepAgreement:
    """``local``: this rank's ``(value, count)`` (float64; read only where ``is_last``). ``extra`` (float64, 1-D,
    the same length on every rank) rides along: summed over the world, in place.

    The vector: ``2 * slots`` for the pipelines' ``(value, count)`` pairs (slot ``dp_rank * tp + tp_rank``), then the
    flags, then ``extra``."""
    tp = topology.tensor_parallel_size
    slots = topology.dp_degree * tp
    mine = topology.dp_rank * tp + topology.tp_rank
    flags_end = 2 * slots + len(flags)
    packed = torch.zeros(flags_end + (0 if extra is None else extra.numel()), dtype=torch.float64,
                         device=local.device)
    if is_last:
        packed[2 * mine:2 * mine + 2] = local
    if flags:
        packed[2 * slots:flags_end] = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64,
                                                   device=local.device)
    if extra is not None:
        packed[flags_end:] = extra
    dist.all_reduce(packed)
    if extra is not None:
        extra.copy_(packed[flags_end:])
    pairs = packed[:2 * slots].view(topology.dp_degree, tp, 2)
    return StepAgreement(pipeline=pairs[topology.dp_rank, topology.tp_rank].clone(),
                         replicas_count=pairs[:, topology.tp_rank, 1].sum(), flags=packed[2 * slots:flags_end] > 0)


__all__ = ["StepAgreement", "agree_step"]
