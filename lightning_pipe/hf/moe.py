"""transformers mixture-of-experts models as layer lists: their router load-balancing loss, exact across stages.

[Note: the load-balancing loss across stages]
transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) takes the router logits of
*all* ``L`` MoE layers of one forward, ``p`` = their softmax and the top-k choices, and returns
``E * sum_e (T_e / R) * (P_e / R)`` with ``T_e`` the (mask-weighted) number of top-k choices of expert e summed over
layers and tokens, ``P_e`` the (mask-weighted) sum of ``p[:, e]`` over layers and tokens, ``R = L * sum(mask)``
(``L * tokens`` without a mask). ``T`` is a count (no gradient) over every layer: not a sum of per-layer terms, and a
stage cannot know it when it runs its layers. But the loss is linear in each layer's ``P_l``:
``aux = sum_l E / R^2 * <T, P_l>``, so layer l's gradient is ``E / R^2 * T`` times ``dP_l`` — only ``T`` of the whole
micro-batch is needed, and only in the backward. So ``T`` travels with the activations, twice per micro-batch:

* forward: every MoE model's layer list carries a ``carry`` tensor ``[B, E]`` (fp32, last in the layer tuple, see
  [Note: layer I/O] in layers.py): the embedding starts it at zero, each MoE layer adds its rows' counts;
* backward: the head hands ``carry`` (now the whole micro-batch's ``T`` per row) back as the *gradient* of ``carry``;
  each MoE layer's autograd function reads it, gives ``P_l`` the gradient ``scale * coef * E / R^2 * T`` and passes
  it on unchanged, across stages in the ordinary backward messages of every schedule.

``scale`` is the aux-loss scale of the step ([Note: auxiliary losses] in lightning_pipe/layers/aux.py), so the term
enters as ``router_aux_loss_coef * mean_j aux_j`` over the micro-batches j — what one device computes with gradient
accumulation over the same micro-batches (a whole-batch term cannot be computed causally under 1F1B: micro-batch 0's
backward runs before micro-batch m-1's forward). ``R`` needs the mask, which every decoder layer already receives.
Values (logged as ``train_aux_loss/load_balancing``) are computed in the backward, where ``T`` is known. On one
device the same layers add the term to the loss directly (``T`` is known after the head's forward). Only with
``config.output_router_logits`` (as transformers adds the term only then); DeepSeek-V3 has no such loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.layers.aux import current_aux_context

__all__ = ["LOSS_NAME", "RouterBalance", "find_routers", "release_carry", "router_logits_source"]

LOSS_NAME = "load_balancing"


def router_logits_source(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The router class and output index transformers records ``router_logits`` from (``_can_record_outputs``)."""
    for cls in type(model).__mro__:
        recorders = cls.__dict__.get("_can_record_outputs")
        if recorders and "router_logits" in recorders:
            rec = recorders["router_logits"]
            return getattr(rec, "target_class", rec), int(getattr(rec, "index", 0) or 0)
    base = getattr(model, "model", None)
    return router_logits_source(base) if isinstance(base, nn.Module) and base is not model else None


def find_routers(block: nn.Module, router_class: type[nn.Module]) -> list[nn.Module]:
    return [m for m in block.modules() if isinstance(m, router_class)]


class _BalanceCarry(torch.autograd.Function):
    """Identity on ``hidden``; ``carry + counts``; backward: ``P``'s gradient from the carry's ([Note: the
    load-balancing loss across stages])."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, carry: Tensor, probs: Tensor, counts: Tensor, factor: float,
                scale: float) -> tuple[Tensor, Tensor]:
        ctx.factor, ctx.scale = factor, scale
        ctx.save_for_backward(probs.detach())
        return hidden.view_as(hidden), carry + counts

    @staticmethod
    def backward(ctx: Any, grad_hidden: Tensor, grad_carry: Tensor | None) -> tuple[Any, ...]:
        (probs,) = ctx.saved_tensors
        if grad_carry is None:
            return grad_hidden, None, None, None, None, None
        total = grad_carry.sum(0)  # T of the whole micro-batch, every layer of every stage
        context = current_aux_context()
        if context is not None:
            context.record(LOSS_NAME, ctx.factor * (total * probs).sum())
        return grad_hidden, grad_carry, (ctx.scale * ctx.factor) * total.to(probs.dtype), None, None, None


class _ReleaseCarry(torch.autograd.Function):
    """At the head: identity on the logits; the carry's gradient is the carry itself (the micro-batch's T)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, carry: Tensor) -> Tensor:
        ctx.save_for_backward(carry.detach())
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad_logits: Tensor) -> tuple[Tensor, Tensor]:
        (carry,) = ctx.saved_tensors
        return grad_logits, carry


class RouterBalance(nn.Module):
    """One MoE decoder layer's part of the load-balancing loss; reads its router's logits with a forward hook.

    ``layers``: the model's MoE layer count ``L``; ``coef``: ``router_aux_loss_coef``.
    """

    def __init__(self, router: nn.Module, logits_index: int, num_experts: int, top_k: int, layers: int,
                 coef: float) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.layers, self.coef = num_experts, top_k, layers, coef
        self.logits_index = logits_index
        self._logits: Tensor | None = None
        router.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        self._logits = output[self.logits_index] if isinstance(output, (tuple, list)) else output

    def start(self) -> None:
        self._logits = None

    def add_term(self, hidden: Tensor, carry: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        logits, self._logits = self._logits, None
        if logits is None:
            raise RuntimeError("the MoE layer's router did not run in its forward (no router logits recorded)")
        rows = hidden.shape[0]
        probs = torch.softmax(logits, dim=-1)  # as load_balancing_loss_func: softmax in the logits' dtype
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        mask = (attention_mask.reshape(-1).to(torch.float32) if attention_mask is not None
                else torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device))
        with torch.no_grad():
            hits = torch.zeros(probs.shape[0], self.num_experts, dtype=torch.float32, device=probs.device)
            hits.scatter_add_(1, chosen, mask.unsqueeze(-1).expand_as(chosen).contiguous())
            counts = hits.reshape(rows, -1, self.num_experts).sum(1)
        prob_sum = (probs.float() * mask.unsqueeze(-1)).sum(0)
        total_rows = float(self.layers) * mask.sum().clamp_min(1)
        # a per-micro-batch constant: R comes from this micro-batch's mask, the same on every stage
        factor_t = self.coef * self.num_experts / total_rows.square()
        context = current_aux_context()
        if context is None or not torch.is_grad_enabled():
            return hidden, carry + counts
        if context.collect:  # one device: the term joins the loss once the head knows T
            def finish(total: Tensor) -> None:
                term = factor_t * (total.sum(0) * prob_sum).sum()
                context.terms.append(term)
                context.record(LOSS_NAME, term)
            context.finalizers.append(finish)
            return hidden, carry + counts
        out_hidden, out_carry = _BalanceCarry.apply(hidden, carry, prob_sum, counts, float(factor_t),
                                                    context.grad_scale())
        return out_hidden, out_carry


def release_carry(logits: Tensor, carry: Tensor) -> Tensor:
    """At the head: hand T back (pipeline), or finish the one-device terms."""
    context = current_aux_context()
    if context is None or not torch.is_grad_enabled():
        return logits
    if context.collect:
        finalizers, context.finalizers = context.finalizers, []
        for finish in finalizers:
            finish(carry)
        return logits
    return _ReleaseCarry.apply(logits, carry)
