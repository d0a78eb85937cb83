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
every case, only the hints (``optimizer_step_follows``, ``zero_grad_follows``, set by the strategy from Lightning's
rules) decide how much is overlapped. The token-weighted factor ([Note: token-weighted loss]) multiplies the
averaged fresh gradients after the wait, which is exact only if it is the same on every replica: with overlap its
``N`` is the replicas' mean target count (one scalar all-reduce before the schedule), not each replica's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.parallel.dp_overlap import DataParallelOverlap, _Carry


class DataParallelHandoff:
    """The data-parallel hand-off state of one engine ([Note: what the overlapped sync averages]):
    whether this batch's fresh gradients are being averaged during the schedule, whether ``.grad`` holds only
    replica-averaged values, and the strategy's two hints. ``PipelineEngine`` holds one (``engine.dp_handoff``).

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
        self.optimizer_step_follows = True
        """Hint set by the strategy before each training batch: this batch ends in an optimizer step."""
        self.zero_grad_follows = True
        """Hint set by the strategy: Lightning's ``zero_grad`` runs after this batch's ``training_step``."""
        self.grads_averaged = True  # every .grad is the replica average (nothing local since the last sync)
        self.overlapped = False  # this batch's fresh gradients are being averaged
        self.counts = {"overlapped": 0, "after_schedule": 0}
        """Batches averaged each way (``engine.dp_sync_counts``; tests, bench)."""

    def begin(self, saved: list[Tensor | None], elements: float, group: dist.ProcessGroup | None, replicas: int,
              device: torch.device) -> tuple[DataParallelOverlap | None, float | Tensor]:
        """Before the schedule: average this batch's gradients during it? (the overlap to drive, or ``None``). Also
        ``N`` of [Note: token-weighted loss]: with overlap, the replicas' mean, so that the factor applied after
        averaging is the same on every replica (padded batches hold different numbers of targets)."""
        overlap = self.overlap
        if self.overlapped and overlap is not None:  # a batch whose gradients were never handed over
            overlap.wait()
        self.overlapped = bool(overlap is not None and self.enabled and self.optimizer_step_follows)
        if not self.overlapped or overlap is None:
            return None, elements
        elements_mean = mean_count(elements, group, replicas, device)
        carry = not self.grads_averaged and not self.zero_grad_follows
        overlap.begin(self.microbatches_per_stage, carry=saved if carry else None)
        return overlap, elements_mean

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


def mean_count(elements: float | Tensor, group: dist.ProcessGroup | None, ranks: int, device: torch.device
               ) -> Tensor:
    """``N`` of [Note: token-weighted loss] where gradients are averaged before its factor: the mean over the
    ``ranks`` data ranks of ``group``. Kept on the device (a 0-d float64): only ever multiplied into the loss and the
    gradient factor."""
    total = torch.as_tensor(elements, dtype=torch.float64, device=device).reshape(1).clone()
    dist.all_reduce(total, group=group)
    return total[0] / ranks


def settle(params: Sequence[nn.Parameter], carry: _Carry | None, averaged: bool) -> bool:
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
