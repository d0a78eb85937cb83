"""Weight versions per stage: a ``PipelineStage`` that trains on a stashed earlier version of its parameters.

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
Schedules built on this stage refuse both (``schedules/pipedream.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pipe._compat import torch as _compat


def parameter_slots(submod: torch.nn.Module) -> tuple[list[Tensor], list[tuple[str, int]]]:
    """A stage module's distinct parameters and, per parameter name, its slot among them: a tie inside the stage
    keeps both names on one stashed tensor (``functional_call``'s ``tie_weights`` checks it)."""
    named = list(submod.named_parameters(remove_duplicate=False))
    unique = {id(p): p for _, p in named}
    slot = {key: i for i, key in enumerate(unique)}
    return list(unique.values()), [(name, slot[id(p)]) for name, p in named]


class VersionedPipelineStage(_compat.GuardedPipelineStage):
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
        if not full_backward:
            raise NotImplementedError(
                "A versioned stage needs full backward: torch's input/weight split differentiates the live "
                "parameters, not the stashed version the forward ran on. Use a schedule without I/W actions.")
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
