"""Data-parallel gradient averaging overlapped with the schedule's backward (plain replicated data parallelism).

[Note: overlapped data-parallel sync]
Without overlap, one coalesced all-reduce averages every gradient after the whole schedule (``GradientSync.sync``):
all of it is exposed. A stage's gradients are final once its last backward of the batch has run — its m-th full
backward (B), or its m-th weight backward (W) under a split I/W schedule; ``I`` computes input gradients only. So
:class:`DataParallelOverlap` counts each local stage's B and W calls during a step and, at the last one, launches
asynchronous all-reduces (``async_op=True``) of flat buckets over the data-parallel group, while later stages of this
rank (V / interleaved placements) and earlier stages of the pipeline still compute. Within that last backward,
buckets are launched even earlier, layer by layer, from post-accumulate-grad hooks (only on a full backward: torch's
W accumulates ``.grad`` by hand, so there the stage's buckets start when the W returns). Everything launched is
waited for when Lightning hands the gradients over (``PipelineEngine.apply_pending_grads``): the exposed part is
only that wait.

Bucket order is static (per stage, reverse parameter order, cut at ``bucket_bytes`` and at dtype changes) and each
stage launches its buckets strictly in that order; stages finish in the order of the schedule's action list. So the
replicas of one pipeline rank issue the same collectives in the same order. A hook says "final" only for a parameter
that appears once in its stage: one held under two names (a tie inside a stage) may be accumulated twice in one
backward when layers are recomputed by reentrant checkpointing, so it waits for the end of its stage's backward. A parameter held by two local stages
(a tie with both ends on one rank, V placement) is complete only when both stages have finished: such parameters
form buckets of their own, launched when the last of their stages finishes. Each bucket is divided by the replica
count before the sum (exact for a power of two) and the averaged gradients are views into the bucket: no copy
back. Stage order and shapes are the same on every replica; a stage whose backward never completes in a step
(none today) is launched at the end of the schedule.

What goes into a bucket is only this batch's *fresh* gradients, and the engine decides whether that is all that
needs averaging ([Note: what the overlapped sync averages] in dp_handoff.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe._compat import torch as _compat

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: the last layer's gradients are ready first; start early


@dataclass
class _Bucket:
    indices: list[int]  # positions in the engine's parameter list
    remaining: int = 0  # parameters not final yet (this step)
    flat: Tensor | None = None
    work: Any = None
    launched: bool = False
    members: list[tuple[int, int, int]] = field(default_factory=list)  # (index, offset, numel) of launched grads


@dataclass
class _Queue:
    """Buckets launched strictly in list order (the same order on every replica)."""

    buckets: list[_Bucket]
    next: int = 0


def _cut(indices: Sequence[int], params: Sequence[nn.Parameter], cap: int, first_cap: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    current: list[int] = []
    size, limit = 0, first_cap
    for i in indices:
        p = params[i]
        if current and (size >= limit or p.dtype != params[current[-1]].dtype):
            buckets.append(_Bucket(current))
            current, size, limit = [], 0, cap
        current.append(i)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(_Bucket(current))
    return buckets


def _is_full(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False)``."""
    return bool(kwargs.get("full_backward", args[1] if len(args) > 1 else True))


class DataParallelOverlap:
    """Launches this rank's data-parallel all-reduces during the schedule ([Note: overlapped data-parallel sync]).

    Args:
        stages: this rank's pipeline stages; hooks go around their ``backward_one_chunk`` /
            ``backward_weight_one_chunk`` (``add_call_hook``; a pass-through unless a step is running with overlap).
        params: the engine's deduplicated parameter list (the order the averaged gradients are returned in).
        group: the data-parallel process group.
    """

    def __init__(self, stages: Sequence[Any], params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
        self.params = list(params)
        self.group = group
        self.world = dist.get_world_size(group)
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        """Bucket size cap; read when a step begins (a bench may change it between steps)."""
        position = {id(p): i for i, p in enumerate(self.params)}
        self._stage_params: dict[int, list[int]] = {}
        holders: dict[int, int] = {}
        self._hooked: set[int] = set()  # parameters whose post-accumulate-grad hook says "final"
        for stage in stages:
            names = Counter(position[id(p)] for _, p in stage.submod.named_parameters(remove_duplicate=False))
            idx = list(names)
            self._stage_params[stage.stage_index] = idx
            for i in idx:
                holders[i] = holders.get(i, 0) + 1
            # [Note: overlapped data-parallel sync]: a parameter under two names in one stage could be accumulated
            # twice in one backward (layers recomputed by reentrant checkpointing): only its stage's end says final
            self._hooked.update(i for i in idx if names[i] == 1)
        self._hooked.difference_update(i for i, n in holders.items() if n > 1)
        self._holders = holders
        self._shared = sorted(i for i, n in holders.items() if n > 1)
        self._plan_key: int | None = None
        self._queues: dict[int | None, _Queue] = {}  # stage index -> its queue; None -> parameters of several stages
        self._bucket_of: dict[int, _Bucket] = {}
        self._queue_of: dict[int, int | None] = {}
        self._active = False
        self._carry: Carry | None = None
        self._microbatches = 0
        self._counts: dict[int, int] = {}
        self._holders_left: dict[int, int] = {}
        self._done: set[int] = set()
        for stage in stages:
            self._wrap(stage)

    # ------------------------------------------------------------------ plan
    def _plan(self) -> None:
        if self._plan_key == self.bucket_bytes:
            return
        shared = set(self._shared)
        first = min(FIRST_BUCKET_BYTES, self.bucket_bytes)
        self._queues = {s: _Queue(_cut([i for i in reversed(idx) if i not in shared], self.params, self.bucket_bytes,
                                       first)) for s, idx in self._stage_params.items()}
        if self._shared:
            self._queues[None] = _Queue(_cut(self._shared, self.params, self.bucket_bytes, self.bucket_bytes))
        self._bucket_of, self._queue_of = {}, {}
        for key, queue in self._queues.items():
            for bucket in queue.buckets:
                for i in bucket.indices:
                    self._bucket_of[i], self._queue_of[i] = bucket, key
        self._plan_key = self.bucket_bytes

    # ------------------------------------------------------------------ one step
    def begin(self, microbatches: int, carry: Sequence[Tensor | None] | None = None) -> None:
        """Before ``schedule.step``: every stage's gradients start from ``None`` (the engine moved them aside).

        ``carry``: gradients accumulated by earlier batches (aligned with ``params``) that also need averaging; they
        are launched now, in one queue of their own, and checked untouched in :func:`settle`.
        """
        self._plan()
        self._carry = None if carry is None else Carry.launch(carry, self.group, self.world, self.bucket_bytes)
        self._microbatches = microbatches
        self._counts = dict.fromkeys(self._stage_params, 0)
        self._holders_left = dict(self._holders)
        self._done = set()
        for queue in self._queues.values():
            queue.next = 0
            for bucket in queue.buckets:
                bucket.remaining, bucket.flat, bucket.work, bucket.launched = len(bucket.indices), None, None, False
                bucket.members = []
        self._active = True

    def end_schedule(self) -> None:
        """After ``schedule.step``: launch whatever a stage did not (all stages' gradients are final now)."""
        if not self._active:
            return
        for s in self._stage_params:
            if s not in self._done:
                self._stage_finished(s)
        self._active = False

    def abandon(self) -> None:
        """The schedule failed: forget this step (what was launched completes on its own or fails with the run)."""
        self._active, self._carry = False, None

    def wait(self) -> tuple[list[Tensor | None], Carry | None]:
        """Wait for every bucket: the averaged fresh gradients, aligned with ``params`` (``None``: no gradient),
        and the averaged carry, if one was launched."""
        carry, self._carry = self._carry, None
        if carry is not None:
            carry.wait()
        out: list[Tensor | None] = [None] * len(self.params)
        for queue in self._queues.values():
            for bucket in queue.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                flat = bucket.flat
                for i, offset, numel in bucket.members:
                    assert flat is not None
                    out[i] = flat[offset:offset + numel].view_as(self.params[i])
                bucket.flat, bucket.work, bucket.members = None, None, []
        return out, carry

    # ------------------------------------------------------------------ readiness
    def _ready(self, i: int) -> None:
        bucket = self._bucket_of[i]
        bucket.remaining -= 1
        if bucket.remaining == 0:
            self._launch_ready(self._queues[self._queue_of[i]])

    def _launch_ready(self, queue: _Queue) -> None:
        while queue.next < len(queue.buckets) and queue.buckets[queue.next].remaining == 0:
            self._launch(queue.buckets[queue.next])
            queue.next += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        grads = [(i, g) for i in bucket.indices if (g := self.params[i].grad) is not None]
        if not grads:
            return
        with torch.no_grad():
            flat = torch.cat([g.detach().reshape(-1) for _, g in grads])
            flat.div_(self.world)  # average: divide first, then sum (exact for a power-of-two replica count)
        offset = 0
        for i, g in grads:
            bucket.members.append((i, offset, g.numel()))
            offset += g.numel()
        bucket.flat = flat
        bucket.work = dist.all_reduce(flat, group=self.group, async_op=True)

    def _stage_finished(self, s: int) -> None:
        self._done.add(s)
        for i in self._stage_params[s]:
            if i in self._holders_left and self._holders[i] > 1:
                self._holders_left[i] -= 1
                if self._holders_left[i] == 0:
                    self._ready(i)
        queue = self._queues[s]
        for bucket in queue.buckets:  # parameters no hook reported (no gradient, or accumulated by hand)
            bucket.remaining = 0
        self._launch_ready(queue)

    @contextlib.contextmanager
    def _hooks(self, s: int) -> Iterator[None]:
        """During a stage's last full backward: each parameter held by this stage alone is final once autograd has
        accumulated its gradient."""
        handles = []
        reported: set[int] = set()

        def hook_for(i: int) -> Callable[[Tensor], None]:
            def hook(_: Tensor) -> None:
                if i not in reported:
                    reported.add(i)
                    self._ready(i)
            return hook

        for i in self._stage_params[s]:
            if i in self._hooked and self.params[i].requires_grad:
                handles.append(self.params[i].register_post_accumulate_grad_hook(hook_for(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------------------------ stage hooks
    def _wrap(self, stage: Any) -> None:
        """Hook the stage's backward entry points ([Note: stage call hooks] in runtime/stage.py); for good."""
        s = stage.stage_index

        def backward_one_chunk(run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self._active or not _is_full(args, kwargs):
                return run()
            return self._counted(s, run)

        def backward_weight_one_chunk(run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self._active:
                return run()
            return self._counted(s, run)

        stage.add_call_hook("backward_one_chunk", backward_one_chunk)
        stage.add_call_hook("backward_weight_one_chunk", backward_weight_one_chunk)

    def _counted(self, s: int, run: Callable[[], Any]) -> Any:
        self._counts[s] += 1
        if self._counts[s] < self._microbatches:
            return run()
        with self._hooks(s):
            result = run()
        self._stage_finished(s)
        return result


class Carry:
    """Earlier batches' gradients, averaged while this batch's schedule runs; valid only if nothing touched them."""

    def __init__(self, saved: Sequence[Tensor | None], versions: list[int]) -> None:
        self.saved = list(saved)
        self.versions = versions
        self.averaged: list[Tensor | None] = [None] * len(saved)
        self._works: list[tuple[Any, Tensor, list[tuple[int, int, int]]]] = []

    @classmethod
    def launch(cls, saved: Sequence[Tensor | None], group: dist.ProcessGroup, world: int, cap: int) -> Carry:
        carry = cls(saved, [_compat.tensor_version(g) if g is not None else -1 for g in saved])
        present = [i for i, g in enumerate(saved) if g is not None]
        start = 0
        while start < len(present):
            members: list[tuple[int, int, int]] = []
            size, offset, dtype = 0, 0, saved[present[start]].dtype  # type: ignore[union-attr]
            while start < len(present) and (not members or size < cap):
                g = saved[present[start]]
                assert g is not None
                if g.dtype != dtype:
                    break
                members.append((present[start], offset, g.numel()))
                offset += g.numel()
                size += g.numel() * g.element_size()
                start += 1
            with torch.no_grad():
                flat = torch.cat([saved[i].detach().reshape(-1) for i, _, _ in members])  # type: ignore[union-attr]
                flat.div_(world)
            carry._works.append((dist.all_reduce(flat, group=group, async_op=True), flat, members))
        return carry

    def wait(self) -> None:
        for work, flat, members in self._works:
            work.wait()
            for i, offset, numel in members:
                saved = self.saved[i]
                assert saved is not None
                self.averaged[i] = flat[offset:offset + numel].view_as(saved)
        self._works = []

    def untouched(self, i: int, grad: Tensor) -> bool:
        saved = self.saved[i]
        return saved is grad and _compat.tensor_version(grad) == self.versions[i]
