"""Gradient norms a LightningModule computes in its hooks, over the whole pipeline.

[Note: gradient norms in hooks]
Each rank holds its own stages' gradients, so a norm computed in a hook from ``self.parameters()`` is that rank's
part. ``self.clip_gradients`` and ``Trainer(gradient_clip_val=...)`` always took the global norm (PipelinePrecision);
hand-written clipping did not: ``torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)`` in
``configure_gradient_clipping`` clipped each stage by its own norm (parameters 1.3e-2 from one device, silently).
While Lightning runs ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (and ``on_after_backward``),
and during a manual-optimization ``training_step``, torch's total norm (what ``clip_grad_norm_`` and
``get_total_norm`` compute, however they were imported) is replaced by :func:`global_total_norm`: the norm over every
stage's tensors, a tied weight once, a sharded or split gradient's parts each once (``GradientSync.global_norm``).
It is a collective over the pipeline: every rank calls it, as every rank runs these hooks. Elementwise clipping
(``clip_grad_value_``) needs nothing. In ``on_after_backward`` of a batch that only accumulates, a tied weight's
copies are not summed yet (they are at the optimizer step): there its norm counts one copy's part.

Lightning's ``grad_norm(self, 2)`` utility reads ``self.named_parameters()`` (this rank's) and nothing can reach
inside it: its total is this rank's part. :func:`grad_norm` is the pipeline's own (the same keys, every stage's
parameters on every rank, the total over every stage, ties once), and logging a ``grad_<p>_norm_total`` that did not
come from it warns once, naming it.
"""

from __future__ import annotations

import contextlib
import re
import warnings
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe._compat import torch as _compat_torch

_TOTAL_KEY = re.compile(r"^grad_[0-9.inf]+_norm_total$")
_OURS: weakref.WeakSet[Tensor] = weakref.WeakSet()  # totals computed by grad_norm below
_warned: set[str] = set()


def global_total_norm(engine: Any, tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                      foreach: bool | None = None) -> Tensor:
    """torch's ``get_total_norm`` over every rank's ``tensors`` ([Note: gradient norms in hooks]). A tensor that is
    the gradient of one of this rank's parameters counts as that parameter's (ties once, shards once); any other
    tensor counts as it is on this rank."""
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    by_grad = {id(p.grad): p for p in engine.parameters if p.grad is not None}
    holders: list[Any] = [by_grad[id(t)] if id(t) in by_grad else SimpleNamespace(grad=t) for t in tensors]
    total: Tensor = engine.grads.global_norm(holders, float(norm_type))
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite (over every "
            "pipeline stage), so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


@contextlib.contextmanager
def global_norms(engine: Any | None) -> Iterator[None]:
    """Within: torch's total norm is :func:`global_total_norm` (nothing changes without an engine)."""
    if engine is None:
        yield
        return

    def total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> Tensor:
        return global_total_norm(engine, tensors, norm_type, error_if_nonfinite, foreach)

    with _compat_torch.total_norm_replaced(total_norm):
        yield


def _whole(grad: Tensor) -> Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's ``grad_norm`` for a module under PipelineStrategy: ``grad_{p}_norm{sep}{name}`` for every
    parameter with a gradient, whichever stage holds it, and ``grad_{p}_norm_total`` over every stage (a tied weight
    once, under its first name), the same on every rank of a pipeline. A collective: call it on every rank (in
    ``on_before_optimizer_step``, as Lightning's docs do). On one device it is Lightning's."""
    engine = getattr(module, "_pipeline_engine", None)
    if engine is None:
        return lightning_grad_norm(module, norm_type, group_separator)  # type: ignore[return-value]
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    aliases = {name for tie in getattr(getattr(module, "_pipeline_layout", None), "tied", ()) for name in tie.names[1:]}
    named = [(n, q.grad) for n, q in module.named_parameters() if q.grad is not None and n not in aliases]
    mine = {f"grad_{p}_norm{group_separator}{n}": float(_whole(g).detach().norm(p)) for n, g in named if g is not None}
    gathered: list[Any] = [None] * engine.plan.pipeline_size
    dist.all_gather_object(gathered, mine, group=engine.groups.pp)
    norms: dict[str, Tensor] = {}
    for part in gathered:
        norms.update({k: torch.tensor(v, device=engine.device) for k, v in part.items()})
    if norms:
        total = global_total_norm(engine, [q.grad for q in engine.parameters if q.grad is not None], p)
        _OURS.add(total)
        norms[f"grad_{p}_norm_total"] = total
    return dict(sorted(norms.items()))


def check_logged(name: str, value: Any, engine: Any) -> None:
    """Warn once when a ``grad_<p>_norm_total`` logged under the pipeline did not come from :func:`grad_norm`."""
    if not _TOTAL_KEY.match(name) or name in _warned or (isinstance(value, Tensor) and value in _OURS):
        return
    _warned.add(name)
    p = name[len("grad_"):-len("_norm_total")].removesuffix(".0")
    spans = ", ".join(f"{sm.layer_indices.start}-{sm.layer_indices.stop - 1}" for sm in engine.stage_modules)
    where = f"layers {spans} on pipeline rank {engine.groups.topology.pp_rank}"
    warnings.warn(
        f"lightning_pipe: {name!r} comes from Lightning's grad_norm(self, {p}), which reads this rank's parameters "
        f"only ({where}): under PipelineStrategy the logged total is not the model's. Use "
        f"`lightning_pipe.grad_norm(self, {p})`: the same keys, every stage's parameters, the total over every stage "
        "(a tied weight once); a collective, called on every rank.", stacklevel=3)


__all__ = ["check_logged", "global_norms", "global_total_norm", "grad_norm"]
