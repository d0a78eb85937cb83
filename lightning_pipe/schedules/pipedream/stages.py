"""The stages of the PipeDream family: weight versions (PipeDream-2BW, :class:`VersionedPipelineStage`) and
weight stashing with one update per micro-batch (PipeDream, :class:`StashingPipelineStage`).

[Note: weight versions in a stage]
Every torch schedule runs a stage through ``forward_one_chunk`` / ``backward_one_chunk``, and the forward calls
``forward_maybe_with_nosync``. :class:`VersionedPipelineStage` overrides that call: with gradients enabled (a
training forward) it runs the stage module through ``torch.func.functional_call`` on *stashed* tensors — detached
copies of the parameters, leaves of their own — so autograd accumulates each micro-batch's parameter gradient into
the stash's ``.grad``. After every backward the stage moves those gradients onto the live parameters' ``.grad``,
where the engine, the data-parallel / tie sync, clipping and the user's optimizer find them as usual. So the
gradients are taken at the stashed version and applied to the live one.

Under no_grad (validation, test, predict; torch's shape inference calls the module directly) the live parameters
run: evaluation and checkpoints see the current weights. Buffers are always the live ones.

Full backward only: torch's split backward (I/W) differentiates ``submod.parameters()`` directly, which would miss
the stash; so do recomputed layers (``torch.utils.checkpoint`` re-runs the forward outside ``functional_call``).
Schedules built on this stage refuse both (``schedules/pipedream/spec.py``).

Weight stashing (PipeDream): one update per micro-batch per stage, each backward on the weights its forward used.

[Note: PipeDream weight stashing]
Narayanan et al. 2019 ("PipeDream: Generalized Pipeline Parallelism for DNN Training"): every stage applies an
optimizer update after *each* micro-batch's backward, and the backward of micro-batch j runs on exactly the weight
version its forward used (the stash), not on the live weights that have moved on since. We run it in torch's 1F1B
order (one stage per rank); the stage here applies the updates inside ``schedule.step()``:

* :meth:`StashingPipelineStage.forward_one_chunk` runs the stage through ``torch.func.functional_call`` on a stash
  of the live parameters at their current version (detached copies, leaves of their own; micro-batches that see the
  same version share one stash), and records ``(micro-batch, version)``;
* ``backward_one_chunk`` differentiates that stash, moves its gradient onto the live parameters' ``.grad`` and
  marks an update as due; the stash is freed once no micro-batch in flight uses it;
* the due update runs at the start of the stage's next compute action (or after the step):
  :class:`MicrobatchUpdate` (tied-copy sum, data-parallel mean, per-stage clipping, the user's optimizer,
  zero_grad).

[Note: PipeDream collectives]
An update with collectives must not wait on a peer that waits on this rank. A weight tied across the first and the
last stage (GPT's embedding and head) is the trap: the first stage's update j follows its backward j, which needs
the last stage's backward j; if the last stage blocked in the tie's all-reduce before firing backward j's sends,
or the first stage waited for backward j+1's gradient before joining update j, both would wait forever (they did,
in a first version). So the tie all-reduce is *launched* (``async_op=True``) inside backward j, before anything
waits, and waited for only at the stage's next compute action, when every holder has launched it. The
data-parallel mean is a plain all-reduce at that point: replicas run the same program, so their stage s reaches
update j without waiting on each other. Sum over tie holders and mean over replicas commute (both linear).

[Note: PipeDream version formula]
Version = number of updates the stage has applied. Torch's 1F1B runs ``w = min(m, p - s)`` warm-up forwards on
stage s, then alternates B, F. So forward j (0-based, batch b) comes after ``max(0, j - w + 1)`` of this batch's
backwards, each followed by its update, and after all ``m`` updates of each earlier batch::

    version(s, b, j) = b * m + max(0, j - min(m, p - s) + 1)

In steady state this is the paper's rule: the first stage trains micro-batch j on the weights before the last
``p - 1`` updates (staleness p - 1 - s at stage s, none on the last stage). Unlike the paper, torch's runtime flushes
the pipeline at every ``step()`` (nothing in flight across batches), so the first ``w`` micro-batches of a batch
all run on the batch's starting version (micro-batch j is ``min(j, w - 1)`` updates stale). Stashes alive at once on stage s: one per
distinct version in flight, ``min(w, m - w + 1)`` (:func:`pipedream_max_stashes`; at most p - s), plus the live
weights.

Full backward only (torch's I/W split differentiates ``submod.parameters()``); no recomputation (it would re-run the
forward on the live weights): the schedule refuses both (``schedules/pipedream/spec.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.parallel.dtensor import local
from lightning_pipe.parallel.grads import all_reduce_coalesced
from lightning_pipe.runtime.stage import PipelineStage

STASH_KEY = "pipedream_2bw_stash"
"""Checkpoint key of a PipeDream-2BW stage's stashed weight version ([Note: stage state in checkpoints])."""


def parameter_slots(submod: torch.nn.Module) -> tuple[list[Tensor], list[tuple[str, int]]]:
    """A stage module's distinct parameters and, per parameter name, its slot among them: a tie inside the stage
    keeps both names on one stashed tensor (``functional_call``'s ``tie_weights`` checks it)."""
    named = list(submod.named_parameters(remove_duplicate=False))
    unique = {id(p): p for _, p in named}
    slot = {key: i for i, key in enumerate(unique)}
    return list(unique.values()), [(name, slot[id(p)]) for name, p in named]


def _refuse_split_backward(full_backward: bool, stage: str, weights: str) -> None:
    if not full_backward:
        raise NotImplementedError(
            f"{stage} needs full backward: torch's input/weight split differentiates the live parameters, not "
            f"{weights}. Use a schedule without I/W actions.")


class VersionedPipelineStage(PipelineStage):
    """A stage whose training forward/backward run on one stashed version of its parameters.

    The stash starts as a copy of the live parameters (on the first training forward) and is refreshed by
    :meth:`stash_live`, which the engine calls right before each optimizer step: two versions per stage, the live
    one and the one the next batch trains on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live, self._slots = parameter_slots(self.submod)
        self._stash: list[Tensor] | None = None

    def _version(self) -> dict[str, Tensor]:
        if self._stash is None:  # W(-1) = W(0)
            self._stash = [p.detach().clone().requires_grad_(p.requires_grad) for p in self._live]
        return {name: self._stash[i] for name, i in self._slots}

    # ------------------------------------------------------------------ checkpoints
    # The stash is the next batch's weights: [Note: stage state in checkpoints] in runtime/stage_state.py.
    def state_slots(self) -> list[tuple[Tensor, str]]:
        return [(p, STASH_KEY) for p in self._live]

    def checkpoint_state(self) -> list[tuple[Tensor, str, Tensor]]:
        if self._stash is None:  # before the first batch: W(-1) = W(0), nothing to keep
            return []
        return [(live, STASH_KEY, stashed.detach()) for live, stashed in zip(self._live, self._stash)]

    def restore_state(self, values: Mapping[tuple[int, str], Tensor]) -> bool:
        saved = [values.get((id(p), STASH_KEY)) for p in self._live]
        if any(v is None for v in saved):
            return False
        self._stash = [v.detach().to(dtype=p.dtype).clone().requires_grad_(p.requires_grad)  # type: ignore[union-attr]
                       for v, p in zip(saved, self._live)]
        return True

    def stash_live(self) -> None:
        """Copy the live parameters into the stash (in place: the step's graphs are gone by now)."""
        if self._stash is None:
            return
        with torch.no_grad():
            for stashed, live in zip(self._stash, self._live):
                stashed.copy_(live)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward_maybe_with_nosync(*args, **kwargs)
        return torch.func.functional_call(self.submod, self._version(), args, kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        _refuse_split_backward(full_backward, "A versioned stage", "the stashed version the forward ran on")
        result = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
        self._move_grads()
        return result

    def _move_grads(self) -> None:
        if self._stash is None:
            return
        for stashed, live in zip(self._stash, self._live):
            grad = stashed.grad
            if grad is None:
                continue
            stashed.grad = None
            if live.grad is None:
                live.grad = grad
            else:
                live.grad.add_(grad)


def pipedream_version(stage: int, pipeline_size: int, microbatches: int, batch: int, microbatch: int) -> int:
    """The version (updates applied) micro-batch ``microbatch`` of batch ``batch`` uses on ``stage``:
    [Note: PipeDream version formula]."""
    warmup = min(microbatches, pipeline_size - stage)
    return batch * microbatches + max(0, microbatch - warmup + 1)


def pipedream_max_stashes(stage: int, pipeline_size: int, microbatches: int) -> int:
    """The most weight stashes alive at once on ``stage``: one per distinct version among the ``w = min(m, p - s)``
    micro-batches in flight, ``min(w, m - w + 1)`` (so at most ``p - s``; 1 when the warm-up covers the batch)."""
    warmup = min(microbatches, pipeline_size - stage)
    return min(warmup, microbatches - warmup + 1)


class StashingPipelineStage(PipelineStage):
    """A stage that stashes one weight version per in-flight micro-batch and updates after every backward.

    ``updater`` (a :class:`MicrobatchUpdate`, set by the engine) updates the live parameters from their ``.grad``;
    until it is set a due update is refused. ``versions_used`` lists ``(micro-batch, version)`` per training
    forward since the last :meth:`take_versions`; ``version`` counts the updates applied.
    """

    updates_per_microbatch = True
    """Read by the engine and the strategy: the optimizer steps inside the schedule, once per micro-batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live, self._slots = parameter_slots(self.submod)
        self.version = 0
        self._stashes: dict[int, list[Tensor]] = {}  # version -> stashed tensors
        self._chunk_version: dict[int, int] = {}  # micro-batch in flight -> the version its forward used
        self._chunk: int | None = None  # the micro-batch forward_one_chunk is running
        self._due = False
        self.updater: MicrobatchUpdate | None = None
        self.versions_used: list[tuple[int, int]] = []
        self.max_stashes = 0  # most stashes alive at once (memory: docs/seed-schedules.md)

    def take_versions(self) -> list[tuple[int, int]]:
        used, self.versions_used = self.versions_used, []
        return used

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.flush_update()
        self._chunk = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self._chunk = None

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        if self._chunk is None or not torch.is_grad_enabled():  # evaluation: the live weights
            return super().forward_maybe_with_nosync(*args, **kwargs)
        stash = self._stashes.get(self.version)
        if stash is None:
            stash = [p.detach().clone().requires_grad_(p.requires_grad) for p in self._live]
            self._stashes[self.version] = stash
            self.max_stashes = max(self.max_stashes, len(self._stashes))
        self._chunk_version[self._chunk] = self.version
        self.versions_used.append((self._chunk, self.version))
        return torch.func.functional_call(self.submod, {name: stash[i] for name, i in self._slots}, args, kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        _refuse_split_backward(full_backward, "A weight-stashing stage", "the stash the forward ran on")
        if not self.has_backward:  # torch's eval() walks the same loop; its backward is a no-op
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, last_backward=last_backward)
        self.flush_update()
        result = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
        version = self._chunk_version.pop(bwd_chunk_id)
        stash = self._stashes[version]
        for stashed, live in zip(stash, self._live):
            if stashed.grad is not None:
                live.grad = stashed.grad if live.grad is None else live.grad + stashed.grad
                stashed.grad = None
        if version not in self._chunk_version.values():
            del self._stashes[version]
        self._due = True
        if self.updater is not None:
            self.updater.start()
        return result

    def flush_update(self) -> None:
        """Apply the due update (the last backward's gradient), if any: [Note: PipeDream weight stashing]."""
        if not self._due:
            return
        if self.updater is None:
            raise RuntimeError("A weight-stashing stage ran a backward but has no optimizer to update with: the "
                               "strategy attaches it at setup (PipelineEngine.set_microbatch_update).")
        self._due = False
        self.updater.finish()
        self.version += 1


class MicrobatchUpdate:
    """One stage's update after one micro-batch: gradient sync, per-stage clipping, the user's optimizer, zero_grad.

    :meth:`start` runs right after the backward and only *launches* the tied-copy sums (asynchronous all-reduces
    over each tie's group): [Note: PipeDream collectives]. :meth:`finish` runs at the stage's next compute action:
    it waits for them, averages over data-parallel replicas (``dp_group``), clips this stage's own gradients with
    ``clip = (value, "norm" | "value")`` (a global norm over stages is undefined here: the stages update at
    different times, on different micro-batches), steps the optimizer and zeroes the gradients (``None``).

    [Note: clipping a tied weight under PipeDream]
    Each weight tied across stages (``ties``) is clipped by the norm of its own gradient, apart from the stage's
    other parameters: after the tied-copy sum every copy holds the same gradient, so every holder scales it alike
    and the copies stay equal. Clipping by value is elementwise: the same on every copy already.

    With tensor-parallel stages ``tensor_grads`` (the engine's ``GradientSync``) clips instead of torch, whose
    clipping cannot mix DTensor and plain gradients: the stage norm sums the split gradients' parts over the tensor
    group and counts each replicated one once ([Note: tensor parallel stages]).
    """

    def __init__(self, optimizer: Any, params: Sequence[nn.Parameter], dp_group: Any = None,
                 ties: Sequence[tuple[nn.Parameter, Any]] = (), clip: tuple[float, str] | None = None,
                 tensor_grads: Any = None) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.dp_group = dp_group
        self.ties = list(ties)
        self.clip = clip
        self.tensor_grads = tensor_grads
        self._works: list[Any] = []

    def start(self) -> None:
        self._works = [dist.all_reduce(param.grad, group=group, async_op=True)
                       for param, group in self.ties if param.grad is not None]

    def finish(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
        # (tensor parallel: each rank's part, with the same part of the other replicas)
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if self.dp_group is not None and grads:
            all_reduce_coalesced(grads, self.dp_group, average=True)
        if self.clip is not None:
            value, algorithm = self.clip
            if self.tensor_grads is not None and algorithm == "value":
                self.tensor_grads.clip_grad_value_(self.params, value)
            elif algorithm == "value":
                torch.nn.utils.clip_grad_value_(self.params, value)
            else:  # this stage's norm only (the others update at other times); each tied weight by its own norm
                tied = [param for param, _ in self.ties]
                untied = [p for p in self.params if all(p is not t for t in tied)]
                if self.tensor_grads is not None:
                    self.tensor_grads.clip_grad_norm_(untied, value, over_pipeline=False)
                else:
                    torch.nn.utils.clip_grad_norm_(untied, value)
                for param in tied:  # one tensor (a DTensor under tensor parallelism: torch takes its whole norm)
                    torch.nn.utils.clip_grad_norm_([param], value)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
