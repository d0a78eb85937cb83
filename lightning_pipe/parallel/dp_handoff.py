"""What the engine hands Lightning after an overlapped data-parallel sync: which gradients are replica-averaged.

[Note: what the overlapped sync averages]
With data parallelism the fresh gradients of an optimizer-step batch are averaged during the schedule
([Note: overlapped data-parallel sync] in dp_overlap.py). The optimizer must see the replica average of *every*
contribution since the last step, so the engine tracks whether ``.grad`` may hold a local, not yet averaged part
(:attr:`DataParallelHandoff.grads_averaged`): fresh gradients added
without averaging (the old path, accumulation batches) make it local.
On a step batch that follows accumulation batches, Lightning's ``zero_grad`` does not run (it runs on the first
batch of a window), so the accumulated part is averaged too, launched before the schedule (the "carry"), and used
only if Lightning left those very tensors untouched (identity and in-place version). Averaging is idempotent on
values the replicas share, so whenever anything is in doubt — a carry touched by ``zero_grad``, a batch that turned
out to step without overlap — ``PipelineEngine.sync_gradients`` falls back to one coalesced all-reduce of everything: exact in
every case, only the hints (``optimizer_step_follows``, ``zero_grad_follows`` of the ``StepHints`` the adapter
hands the engine with each batch, from Lightning's rules) decide how much is overlapped. The token-weighted factor ([Note: token-weighted loss]) multiplies the
averaged fresh gradients after the wait, which is exact only if it is the same on every replica: with overlap its
``N`` is the replicas' mean target count (one scalar all-reduce before the schedule), not each replica's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.parallel.dp_overlap import Carry, DataParallelOverlap
from lightning_pipe.parallel.topology import ProcessGroups


@dataclass(frozen=True)
class OverlapStart:
    """A batch whose fresh gradients are averaged during the schedule (:meth:`DataParallelHandoff.begin`)."""

    overlap: DataParallelOverlap
    microbatches: int
    """The backwards after which a stage's gradients are final."""
    carry: list[Tensor | None] | None
    """The gradients earlier batches accumulated, averaged alongside ([Note: what the overlapped sync averages])."""


class DataParallelHandoff:
    """The data-parallel hand-off state of one engine ([Note: what the overlapped sync averages]):
    whether this batch's fresh gradients are being averaged during the schedule, and whether ``.grad`` holds only
    replica-averaged values. ``PipelineEngine`` holds one (``engine.dp_handoff``).

    Args:
        overlap: the rank's :class:`DataParallelOverlap`, or ``None`` (no replicas, FSDP / tensor-parallel stages,
            PipeDream: nothing is averaged here).
        microbatches_per_stage: the backwards after which a stage's gradients are final.
    """

    def __init__(self, overlap: DataParallelOverlap | None, microbatches_per_stage: int) -> None:
        self.overlap = overlap
        self.enabled = True
        """Average during the schedule; off: one all-reduce after it (``engine.overlap_dp_sync``; the bench)."""
        self.microbatches_per_stage = microbatches_per_stage
        self.grads_averaged = True  # every .grad is the replica average (nothing local since the last sync)
        self.overlapped = False  # this batch's fresh gradients are being averaged
        self.counts = {"overlapped": 0, "after_schedule": 0}
        """Batches averaged each way (``engine.dp_sync_counts``; tests, bench)."""

    def begin(self, saved: list[Tensor | None], *, optimizer_step_follows: bool,
              zero_grad_follows: bool) -> OverlapStart | None:
        """Before the schedule: whether this batch's gradients are averaged during it (what :meth:`launch` starts),
        or ``None``. The hints are the adapter's (``StepHints``): a batch that ends in an optimizer step overlaps, and
        one after accumulation batches without Lightning's ``zero_grad`` averages the accumulated ``saved`` too."""
        overlap = self.overlap
        if self.overlapped and overlap is not None:  # a batch whose gradients were never handed over
            overlap.wait()
        self.overlapped = False
        if overlap is None or not self.enabled or not optimizer_step_follows:
            return None
        carry = not self.grads_averaged and not zero_grad_follows
        return OverlapStart(overlap, self.microbatches_per_stage, saved if carry else None)

    def launch(self, start: OverlapStart) -> None:
        """Right before the schedule (after ``N`` is agreed: its all-reduce must not queue behind the carry's)."""
        self.overlapped = True
        start.overlap.begin(start.microbatches, carry=start.carry)

    def abandon(self, overlap: DataParallelOverlap) -> None:
        """The schedule failed: nothing waits on its collectives (the run stops)."""
        overlap.abandon()
        self.overlapped = False

    def hand_over(self, params: Sequence[nn.Parameter], pending: list[Tensor | None]) -> list[Tensor | None]:
        """When Lightning hands the gradients over: the fresh gradients to add (averaged, if they were being), with
        earlier batches' settled ([Note: what the overlapped sync averages])."""
        if self.overlapped and self.overlap is not None:
            self.overlapped = False
            pending, carry = self.overlap.wait()
            self.counts["overlapped"] += 1
            self.grads_averaged = settle(params, carry, self.grads_averaged)
        elif any(fresh is not None for fresh in pending):
            self.grads_averaged = False
        return pending

    def synced(self) -> None:
        """After the gradient sync before the optimizer step (which averaged over replicas unless
        ``grads_averaged``): everything is averaged now."""
        if not self.grads_averaged and self.overlap is not None:  # (FSDP averages in its reduce-scatter)
            self.counts["after_schedule"] += 1
        self.grads_averaged = True


def global_mean_count(elements: float, groups: ProcessGroups, overlapped: bool, device: torch.device
                      ) -> float | Tensor:
    """``N`` of [Note: token-weighted loss], decided here once per training step: this replica's own target count
    ``elements``, unless several data ranks' gradients mix before the factor ``N * dp / (global count)`` multiplies
    them. Then ``N`` must be the same on every data rank (padded batches hold different numbers of targets), and it
    is their mean (a device value: one scalar all-reduce before the schedule). They mix where

    * the overlapped sync averages the fresh gradients during the schedule (``overlapped``: [Note: what the
      overlapped sync averages]);
    * FSDP averages every data rank's gradients in its reduce-scatter ([Note: FSDP under the pipeline schedule]);
    * an expert's gradient sums several replicas' losses ([Note: expert parallelism]).
    """
    if groups.dp is None or not (overlapped or groups.shard is not None or groups.experts is not None):
        return elements
    return mean_count(elements, groups.dp, groups.topology.dp_degree, device)


def mean_count(elements: float | Tensor, group: dist.ProcessGroup | None, ranks: int, device: torch.device
               ) -> Tensor:
    """The mean of ``elements`` over the ``ranks`` data ranks of ``group``. Kept on the device (a 0-d float64): only
    ever multiplied into the loss and the gradient factor."""
    total = torch.as_tensor(elements, dtype=torch.float64, device=device).reshape(1).clone()
    dist.all_reduce(total, group=group)
    return total[0] / ranks


def settle(params: Sequence[nn.Parameter], carry: Carry | None, averaged: bool) -> bool:
    """After Lightning's ``zero_grad``, before this batch's averaged fresh gradients are added: put the averaged
    carry in place of every untouched carried gradient, and say whether every ``.grad`` is now replica-averaged
    (``averaged``: whether what earlier batches left was). See [Note: what the overlapped sync averages]."""
    clean = True
    for i, p in enumerate(params):
        grad = p.grad
        if grad is None:
            continue
        if carry is not None and carry.untouched(i, grad):
            p.grad = carry.averaged[i]
        elif not averaged:
            clean = False
    return clean
