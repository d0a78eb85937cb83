"""Host reads of device values in a training step: what the design allows, and the loss kind read once.

[Note: host reads in a training step]
Each read of a device value on the host (``.item()``, ``.tolist()``, ``bool`` / ``float`` / ``int`` of a tensor,
``.cpu()``, a CUDA event query or synchronize) makes the host wait until the device has run everything queued
before it: on CUDA a stall that lets the device run dry while the host then enqueues the next kernels. Per
training batch, on every rank, the step path (schedule, loss, gradient hand-over and sync, clipping, optimizer
step, for every built-in schedule) makes exactly one: the step-boundary agreement of the fault handling
(``watchdog.any_rank`` in ``lightning/faults.py``: SIGTERM, requeue, the epoch's last batch), a decision the host
must take before the next batch. The loss stays a device tensor (Lightning logs tensors; its own loggers and
progress bar read it on their interval); the gradient norm of clipping, the token count of a (sum, count) loss,
the replicas' mean target count and the gradient factor stay on the device; the loss kind is read once
([Note: the loss kind is read once]). ``tests/distributed/test_sync_points.py`` counts every such call per call
site and fails on a new one. Outside that budget, and off by default or rare: the first step (shape inference),
fp16's dynamic loss scaling (torch's ``GradScaler`` reads its found-inf flags once per optimizer step), a
rebalancing move (a step boundary, when layers move), and the timeline on recorded steps only
(``trace/recorder.py`` on CUDA: one ``synchronize`` at the step start to anchor its events to the host clock and one
event ``synchronize`` at the end, so a recorded step runs without the host running ahead of the device; record
every N steps, ``PipelineTimeline(every_n_steps=...)``, on long runs).

[Note: the loss kind is read once]
A step's loss is reduced differently for a mean and for a (sum, count) pair ([Note: token-weighted loss]), and only
the ranks holding a last stage see what ``loss_fn`` returned; the others learn it from the loss broadcast. Reading
that tensor on the host each step would make every rank wait for the device queue in the middle of the step (a
stall on CUDA). The kind cannot change during a run without a bug in ``loss_fn``, so it is read once, in the first
training step (the shape-inference step, which waits on the device anyway); afterwards each last stage compares its
own records (host data: whether ``count`` is None) with the kind learned, and raises where they differ. The other
ranks then stop through the failure watchdog ([Note: failure propagation]): no hang, no silent wrong reduction.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_pipe.layers.batches import LossParts


class LossKind:
    """The run's loss kind (``pair``: None until the first step's read) and how many micro-batch losses this rank
    records per step (``records``), for the host-side check of later steps."""

    def __init__(self) -> None:
        self.pair: bool | None = None
        self.records: int | None = None

    def learn(self, pair: Tensor, records: int) -> bool:
        """The kind: ``pair`` (a 0-d bool tensor) read on the host the first time only."""
        if self.pair is None:
            self.pair, self.records = bool(pair), records
        return self.pair

    def check(self, records: Sequence[LossParts], owner: str) -> None:
        """Later steps, on this rank's host data only: the same kind and number of micro-batch losses as the first step's."""
        if self.pair is None:
            return
        kinds = ["pair" if r.count is not None else "mean" for r in records]
        want = "pair" if self.pair else "mean"
        if len(records) != self.records or any(k != want for k in kinds):
            raise TypeError(
                f"{owner}.loss_fn must return the same kind of loss for every micro-batch of the run (a mean, or a "
                f"(sum, count) pair): the first step's were {want}s ({self.records} on this rank), this step's are "
                f"{kinds}.")
