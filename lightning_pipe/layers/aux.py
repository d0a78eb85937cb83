"""Auxiliary losses from any layer: router load-balancing, z-losses, any regulariser, on any stage.

[Note: auxiliary losses]
A layer calls ``hidden = attach_aux_loss(hidden, loss, name=...)``: the identity on ``hidden``, and ``loss`` (a 0-dim
tensor computed from this micro-batch) enters the gradient exactly as if it were added to the micro-batch's training
loss. The main loss exists only on the last stage, so an aux term on stage 0 cannot simply be added to it. Instead
(Megatron's ``MoEAuxLossAutoScaler``) an autograd function on the activation passes ``hidden``'s gradient through and
gives ``loss`` the gradient ``scale`` — so ``loss``'s backward runs inside the stage's own backward, wherever and
whenever the schedule runs it: GPipe, 1F1B, interleaved, looped, ZB-H1 / ZB-V / DualPipeV (torch's split backward
finds the function's node on the input path, so the weight half of the backward replays it: the term reaches the
weights too), PipeDream-2BW, Chimera. Nothing travels between stages for a generic term.

``scale`` is what the engine gives the main loss of one micro-batch ([Note: loss scaling] in runtime/engine.py):
``1 / (microbatches * accumulate_grad_batches)`` (the term is a per-micro-batch mean, like gradient accumulation over
the micro-batches on one device), times the fp16 loss scale (``PipelinePrecision``), divided by the token-weighted
factor that the engine applies to every fresh gradient afterwards ([Note: token-weighted loss] in batches.py), so
that after it the term carries exactly ``1 / (m * k)``; data-parallel replicas then average it like any gradient.
That factor needs the batch's global token count *before* the backward; the module gives it with
``loss_count(target)`` (``HFCausalLM`` has one), else a ``(sum, count)`` loss with aux terms is refused after the first
step. PipeDream / PipeMare update per micro-batch on that micro-batch's own loss: there the term's scale is 1 (times
the fp16 scale), i.e. each update sees its own micro-batch's aux term.

On one device (no pipeline engine) :meth:`~lightning_pipe.PipelineModule.compute_loss` opens a collecting context:
the terms are added to the returned loss as ordinary graph terms, so Lightning's own accumulation and AMP scaling
apply. With no context (evaluation, ``no_grad``, a forward outside ``compute_loss``) the call is the identity and the
term is dropped. Values are logged per step (``train_aux_loss`` and ``train_aux_loss/<name>``): each term's mean over
the micro-batches, summed over the layers that share a name, summed over stages, per replica like the main loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["AuxLossContext", "attach_aux_loss", "attach_layer_penalty", "aux_loss_context", "current_aux_context",
           "records_once"]


class AuxLossContext:
    """What :func:`attach_aux_loss` does while it is active (one training step, or one forward on one device).

    ``grad_scale``: pipeline mode, the gradient each unit of aux loss gets in backward (a float, or a callable asked
    once, at the first term: the engine computes it lazily, see [Note: auxiliary losses]); ``None`` collects the
    graph-attached terms in :attr:`terms` instead (one device). :attr:`values` sums each name's detached values.
    """

    def __init__(self, grad_scale: float | Callable[[], float] | None = None) -> None:
        self._grad_scale = grad_scale
        self.terms: list[Tensor] = []
        self.values: dict[str, Tensor] = {}
        self.recording = True
        """Off during torch's shape inference (not one of the step's micro-batches)."""
        self.finalizers: list[Callable[[Any], None]] = []
        """Collect mode: called with what the last layer hands them (see hf/moe.py's deferred router terms)."""

    @property
    def collect(self) -> bool:
        return self._grad_scale is None

    def grad_scale(self) -> float:
        scale = self._grad_scale
        if scale is None:
            raise RuntimeError("grad_scale of a collecting AuxLossContext")
        if callable(scale):
            scale = self._grad_scale = float(scale())
        return scale

    def record(self, name: str, value: Tensor) -> None:
        if not self.recording:
            return
        value = value.detach().double().reshape(())
        held = self.values.get(name)
        self.values[name] = value if held is None else held + value.to(held.device)


_ACTIVE: list[AuxLossContext] = []


def current_aux_context() -> AuxLossContext | None:
    """The innermost active context, or ``None``."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def aux_loss_context(context: AuxLossContext) -> Iterator[AuxLossContext]:
    """Make ``context`` the one :func:`attach_aux_loss` uses (forward *and* backward of the step run inside)."""
    _ACTIVE.append(context)
    try:
        yield context
    finally:
        _ACTIVE.remove(context)


def records_once(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for ``torch.utils.checkpoint``: its recomputation in the backward re-attaches the terms (their gradient
    then rides on the recomputed graph) but does not log their values a second time."""
    calls = [0]

    def run(*args: Any) -> Any:
        calls[0] += 1
        context = current_aux_context()
        if calls[0] == 1 or context is None:
            return fn(*args)
        recording, context.recording = context.recording, False
        try:
            return fn(*args)
        finally:
            context.recording = recording
    return run


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on ``hidden``; backward gives ``aux`` the gradient ``scale`` ([Note: auxiliary losses])."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad_hidden: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad_hidden, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(hidden: Tensor, loss: Tensor, name: str = "aux", coef: float = 1.0) -> Tensor:
    """``hidden`` unchanged; ``coef * loss`` (0-dim, computed from this micro-batch) joins the training loss.

    Under the pipeline it enters the gradient exactly as if added to this micro-batch's loss on one device with
    gradient accumulation over the micro-batches ([Note: auxiliary losses]); its value is logged as
    ``train_aux_loss/<name>``. Return value must be used in place of ``hidden`` (the gradient rides on it).
    """
    context = current_aux_context()
    if context is None or not torch.is_grad_enabled():
        return hidden
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        seen = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"attach_aux_loss(name={name!r}) takes a 0-dim tensor loss (reduce it first); got {seen}.")
    if not isinstance(hidden, Tensor):
        raise TypeError(f"attach_aux_loss(name={name!r}) attaches to one tensor (an activation the layer returns); "
                        f"got {type(hidden).__name__}.")
    term = loss * coef if coef != 1.0 else loss
    context.record(name, term)
    if context.collect:
        context.terms.append(term)
        return hidden
    if not term.requires_grad:
        return hidden
    return _InjectAuxGrad.apply(hidden, term, context.grad_scale())


# [Note: a penalty over every stage's parameters]
# A term over the parameters (an L2 penalty, say) cannot be added to the loss a training step returns under the
# pipeline (compute_loss already ran the backward), and loss_fn, on the last stage, cannot see stage 0's parameters.
# It need not: the gradient of a sum over parameters is each parameter's own part. A module's
# ``layer_penalty(index, layer)`` (a 0-dim tensor, or None) is called for each layer where the layer runs, and the
# stage's sum rides its output as an aux term (``attach_aux_loss`` above, name "penalty"): once per
# micro-batch, scaled like each micro-batch's loss, which sums to the penalty once per batch, exactly as one device
# adds it once to the batch's loss (``PipelineModule.forward`` attaches the same sum there). Every schedule runs it
# (it is part of the stage's own backward); its value is logged as ``train_aux_loss/penalty``. It costs one
# evaluation of the penalty per micro-batch per stage. A weight two layers share counts in both (on one device too).


def attach_layer_penalty(output: Any, layers: Sequence[nn.Module], indices: Sequence[int],
                         penalty: Callable[[int, nn.Module], torch.Tensor | None] | None) -> Any:
    """``output`` with the sum of ``penalty(index, layer)`` over ``layers`` attached as an aux term ([Note: a
    penalty over every stage's parameters]); ``output`` itself where there is nothing to attach or no training."""
    if penalty is None or current_aux_context() is None or not torch.is_grad_enabled():
        return output
    terms = [t for t in (penalty(i, layer) for i, layer in zip(indices, layers)) if t is not None]
    if not terms:
        return output
    total = terms[0] if len(terms) == 1 else torch.stack([t.reshape(()) for t in terms]).sum()
    if isinstance(output, torch.Tensor):
        return attach_aux_loss(output, total, name="penalty")
    first = attach_aux_loss(output[0], total, name="penalty")
    return (first, *output[1:])
