"""The PipeMare stage: one weight version, an update after every micro-batch's backward, the backward reading the
weights in memory at its own time (optionally corrected): [Note: PipeMare] in ``schedules/pipemare/rule.py``.

[Note: PipeMare backward weights]
Autograd keeps, for each op, the tensors its backward needs. A training forward here runs the stage module on its
live parameters inside ``saved_tensors_hooks``: a saved tensor that shares a live parameter's storage (the
parameter or a view of it) is packed as (parameter, size, stride, offset) and rebuilt from the parameter when the
backward unpacks it, so the backward sees the weights as they are *then*; with discrepancy correction, from
``W - tau * delta`` for that one parameter (a transient, never a per-stage copy). Everything else is saved as the
forward left it. Packing also keeps the graph from holding the parameter itself, so the optimizer's in-place
update between forward and backward trips no autograd version check (there is no saved parameter to check).

Gradients accumulate on the live parameters' ``.grad`` (the forward ran on them); between a backward and its
update no other backward runs (the update is applied at the stage's next compute action), so ``.grad`` holds one
micro-batch's gradient when :class:`~lightning_pipe.schedules.pipedream.stages.MicrobatchUpdate` takes it.

Full backward only (torch's I/W split would unpack the weights at the W step, at another time); no recomputation
(``torch.utils.checkpoint`` re-runs the forward at backward time, on the weights then): refused by the spec. Plain
parameters only: DTensor parameters (tensor parallelism) and FSDP's sharded ones are refused before any rank starts
(the spec does not declare ``tensor_parallel``; ``parallel/fsdp.py`` refuses every stage class). Saved-tensor hooks
installed inside the stage do not compose (the innermost hooks win): offload is refused by the spec, and
``ActivationMeter`` sees no saved tensor here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.runtime.stage import PipelineStage
from lightning_pipe.schedules.pipemare.rule import PipeMareRule, stage_delay

DELTA_KEY = "pipemare_delta"
"""Checkpoint key of a PipeMare stage's velocity estimate ([Note: stage state in checkpoints])."""


class PipeMareStage(PipelineStage):
    """A stage updating once per micro-batch on its one weight version.

    ``updater`` (a ``MicrobatchUpdate``) and :meth:`configure` are set by the strategy at setup. Recorded for checks:
    ``versions_used`` (``(micro-batch, forward version, backward version)`` per backward since
    :meth:`take_versions`), ``lr_factors`` (per update), ``max_copy_bytes`` (bytes of the weight-sized copies the
    stage keeps: ``delta`` with discrepancy correction, else none).
    """

    updates_per_microbatch = True
    """Read by the engine and the strategy: the optimizer steps inside the schedule, once per micro-batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live = list({id(p): p for p in self.submod.parameters()}.values())
        self.rule = PipeMareRule()
        self.delay = 0  # tau_s, set by configure
        self.version = 0
        self._forward_version: dict[int, int] = {}  # micro-batch in flight -> updates before its forward
        self._chunk: int | None = None
        self._due: int | None = None  # the delay of the gradient awaiting its update
        self._tau = 0  # the delay of the backward running now (with correction on)
        self._delta: list[Tensor] | None = None
        self.updater: Any = None
        self.versions_used: list[tuple[int, int, int]] = []
        self.lr_factors: list[float] = []
        self.max_copy_bytes = 0
        self._updates_done: Callable[[], int] | None = None

    def configure(self, rule: PipeMareRule, microbatches: int, updates_done: Callable[[], int] | None = None) -> None:
        """Set the rule and the stage's steady-state delay ``tau_s = min(m, p - s) - 1`` (one stage per rank).
        ``updates_done`` (read at the first training forward) gives the updates made before this run: a run resumed
        from a checkpoint continues the learning-rate annealing where it stopped (``delta`` restarts at 0)."""
        self.rule = rule
        self.delay = stage_delay(self.stage_index, self.num_stages, microbatches)
        self._updates_done = updates_done

    # ------------------------------------------------------------------ checkpoints
    # delta carries across batches: [Note: stage state in checkpoints] in runtime/stage_state.py.
    def state_slots(self) -> list[tuple[Tensor, str]]:
        if self.rule.gamma(self.delay) is None:  # no correction on this stage: nothing kept
            return []
        return [(p, DELTA_KEY) for p in self._live]

    def checkpoint_state(self) -> list[tuple[Tensor, str, Tensor]]:
        if self._delta is None:
            return []
        return [(live, DELTA_KEY, delta) for live, delta in zip(self._live, self._delta)]

    def restore_state(self, values: Mapping[tuple[int, str], Tensor]) -> bool:
        if not self.state_slots():
            return True
        saved = [values.get((id(p), DELTA_KEY)) for p in self._live]
        if any(v is None for v in saved):
            return False
        self._delta = [v.detach().to(dtype=torch.promote_types(p.dtype, torch.float32)).clone()  # type: ignore[union-attr]
                       for v, p in zip(saved, self._live)]
        self.max_copy_bytes = sum(t.untyped_storage().nbytes() for t in self._delta)
        return True

    def take_versions(self) -> list[tuple[int, int, int]]:
        used, self.versions_used = self.versions_used, []
        return used

    # ------------------------------------------------------------------ forward / backward
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.flush_update()
        if self._updates_done is not None and torch.is_grad_enabled() and self.has_backward:  # first training forward
            self.version, self._updates_done = self._updates_done(), None
        self._chunk = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self._chunk = None

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        if self._chunk is None or not torch.is_grad_enabled():  # evaluation, shape inference: nothing saved
            return super().forward_maybe_with_nosync(*args, **kwargs)
        self._forward_version[self._chunk] = self.version
        storages = {p.untyped_storage().data_ptr(): i for i, p in enumerate(self._live)}

        def pack(saved: Tensor) -> Any:
            ptr = _storage_ptr(saved)
            index = None if ptr is None else storages.get(ptr)
            if index is None:
                return saved
            return _ParameterView(index, saved.size(), saved.stride(),
                                  saved.storage_offset() - self._live[index].storage_offset())

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            return super().forward_maybe_with_nosync(*args, **kwargs)

    def _unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _ParameterView):
            return packed
        weight = self._live[packed.index].detach()
        if self._tau and self._delta is not None:  # u_bkwd = W - tau * delta (same strides as W: the view maps)
            weight = torch.add(weight, self._delta[packed.index], alpha=-self._tau).to(weight.dtype)
        return weight.as_strided(packed.size, packed.stride, weight.storage_offset() + packed.offset)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        if not full_backward:
            raise NotImplementedError(
                "A PipeMare stage needs full backward: torch's input/weight split would read the weights at the "
                "weight step, not at the backward. Use a schedule without I/W actions.")
        if not self.has_backward:  # torch's eval() walks the same loop; its backward is a no-op
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, last_backward=last_backward)
        self.flush_update()
        forward = self._forward_version.pop(bwd_chunk_id)
        delay = self.version - forward
        self.versions_used.append((bwd_chunk_id, forward, self.version))
        self._tau = delay if self._delta is not None else 0
        try:
            result = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True,
                                                last_backward=last_backward)
        finally:
            self._tau = 0
        self._due = delay
        if self.updater is not None:
            self.updater.start()
        return result

    # ------------------------------------------------------------------ the update
    def flush_update(self) -> None:
        """Apply the due update: the learning-rate factor around the user's step, then the velocity estimate."""
        if self._due is None:
            return
        if self.updater is None:
            raise RuntimeError("A PipeMare stage ran a backward but has no optimizer to update with: the strategy "
                               "attaches it at setup (PipelineEngine.set_microbatch_update).")
        delay, self._due = self._due, None
        factor = self.rule.lr_factor(delay, self.version)
        gamma = self.rule.gamma(self.delay)
        if gamma is not None:  # delta <- gamma * delta - (1 - gamma) * W(k) now, + (1 - gamma) * W(k+1) after the step
            if self._delta is None:  # fp32 (or wider): the difference of two low-precision weights is exact in it
                self._delta = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                               for p in self._live]
                self.max_copy_bytes = sum(t.untyped_storage().nbytes() for t in self._delta)
            with torch.no_grad():
                for delta, live in zip(self._delta, self._live):
                    delta.mul_(gamma).sub_(live, alpha=1 - gamma)
        groups = self.updater.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * factor
        try:
            self.updater.finish()
        finally:
            for group, rate in zip(groups, rates):
                group["lr"] = rate
        if gamma is not None and self._delta is not None:
            with torch.no_grad():
                for delta, live in zip(self._delta, self._live):
                    delta.add_(live, alpha=1 - gamma)
        self.lr_factors.append(factor)
        self.version += 1


class _ParameterView:
    """A saved tensor that is (a view of) live parameter ``index``: rebuilt from the parameter at unpack."""

    __slots__ = ("index", "size", "stride", "offset")

    def __init__(self, index: int, size: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.index, self.size, self.stride, self.offset = index, size, stride, offset


def _storage_ptr(tensor: Tensor) -> int | None:
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (subclasses, functional wrappers)
        return None
