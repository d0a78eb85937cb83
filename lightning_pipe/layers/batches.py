"""Batches as the engine sees them: inputs and target checked on every rank, the shape signature that decides when
torch must re-infer its buffers, padding of short evaluation batches, and the loss contract.

[Note: token-weighted loss]
``loss_fn`` returns either a scalar tensor, the *mean* over the batch's samples, or a pair ``(sum, count)``: the sum
of per-item losses and how many items it sums over (e.g. tokens whose label is not -100). A mean averages well over
equal micro-batches; a masked-LM mean does not (micro-batches hold different numbers of tokens), so for the pair the
batch loss is ``global sum / global count`` across micro-batches and data-parallel replicas, as on one device over
the whole batch (``sum / max(count, 1)``). The backward is linear in the loss, so the engine runs the schedule with
each micro-batch's *sum* as the loss (times ``1 / (accumulate_grad_batches * N)``, ``N`` the batch's target element
count, only so that gradient magnitudes stay those of a mean, which matters to fp16 loss scaling), learns the counts
on the last stage, and then multiplies this batch's fresh gradients by ``N * dp / global_count`` — ``dp``
because the replicas' gradients are averaged afterwards (lightning_pipe/parallel/grads.py). With ``accumulate_grad_batches``
each batch is normalised by its own count, as Lightning does on one device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.layers.stages import LayerContractError, check_layer_io, layer_args

TensorSpec = tuple[tuple[int, ...], torch.dtype, bool]  # shape without the batch rows, dtype, requires_grad


@dataclass(frozen=True)
class Signature:
    """What torch's P2P buffers depend on: the mode and the shapes/dtypes of one micro-batch's inputs (and target)."""

    mode: str
    """``train`` or ``eval``."""
    rows: int
    """Rows of one micro-batch."""
    inputs: tuple[TensorSpec, ...]
    target: tuple[TensorSpec, ...] = ()

    def with_rows(self, rows: int) -> Signature:
        return replace(self, rows=rows)


def _spec(t: Tensor) -> TensorSpec:
    return tuple(t.shape[1:]), t.dtype, t.requires_grad


def signature(mode: str, args: tuple[Tensor, ...], mb_rows: int, target: Any = None) -> Signature:
    targets = tuple(_spec(t) for t in layer_args(target) if isinstance(t, Tensor) and t.dim() > 0)
    return Signature(mode, mb_rows, tuple(_spec(a) for a in args), targets)


def input_args(inputs: Any, owner: str) -> tuple[Tensor, ...]:
    """``split_batch``'s inputs as the first layer's positional arguments, checked on every rank before any waits:
    tensors (or a tuple of them) that all hold the batch in dim 0; contiguous.

    A view (a collator's ``v[:, :longest]``, an expanded mask) is copied once, contiguous: torch cuts the batch into
    micro-batches along dim 0 and torch 2.11 checks every micro-batch against the first one's strides, which a
    contiguous batch's row blocks share ([Note: contiguous on the wire] in runtime/wire.py). A contiguous input is
    used as it is."""
    check_layer_io(inputs, f"{owner}.split_batch returned inputs that are")
    args = layer_args(inputs)
    rows = {a.shape[0] if a.dim() > 0 else None for a in args}
    if None in rows or len(rows) != 1:
        raise LayerContractError(
            f"{owner}.split_batch returned inputs of shapes {[tuple(a.shape) for a in args]}. Rule: every input "
            "holds the batch in dim 0, with the same number of rows (the pipeline cuts micro-batches along it). "
            "Move the batch to dim 0, or pass batch-independent values as module attributes instead of inputs.")
    return tuple(a if a.is_contiguous() else a.contiguous() for a in args)


def check_target(target: Any, microbatches: int, owner: str) -> Tensor:
    """A training target is one tensor whose dim 0 divides into the micro-batches: torch cuts it like the inputs."""
    if not isinstance(target, Tensor) or target.dim() == 0 or target.shape[0] % microbatches:
        seen = (f"a tensor of shape {tuple(target.shape)}" if isinstance(target, Tensor)
                else "None" if target is None else f"a {type(target).__name__}")
        raise LayerContractError(
            f"{owner}.split_batch returned a training target that is {seen}, with microbatches={microbatches}. "
            "Rule: in training the target is one tensor with the batch in dim 0 (it is cut into micro-batches "
            "with the inputs and given to loss_fn on the last stage). Return `(inputs, target)` with such a tensor "
            "from split_batch.")
    return target


def pad_rows(args: tuple[Tensor, ...], rows: int) -> tuple[Tensor, ...]:
    """Pad along dim 0 to ``rows`` by repeating the last row (the padded rows' outputs are trimmed away)."""
    return tuple(a if a.shape[0] == rows else torch.cat([a, a[-1:].expand(rows - a.shape[0], *a.shape[1:])])
                 for a in args)


def trim_rows(x: Any, rows: int) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(trim_rows(t, rows) for t in x)
    return x[:rows] if isinstance(x, Tensor) else x


# ------------------------------------------------------------------------------------------------ the loss contract
@dataclass(frozen=True)
class LossParts:
    """``loss_fn``'s result, read: a mean (``count is None``) or a sum over ``count`` items."""

    value: Tensor
    count: Tensor | None = None

    def detached(self) -> LossParts:
        return LossParts(self.value.detach(), self.count)

    def reduced(self) -> Tensor:
        """The loss: the mean as given, or ``sum / max(count, 1)`` (no counted item: loss and gradient 0)."""
        if self.count is None:
            return self.value
        return self.value / self.count.to(self.value.dtype).clamp_min(1)


_LOSS_RULE = ("Rule: loss_fn returns a scalar tensor (the mean over the batch's samples) or a pair (sum, count) — "
              "a scalar tensor summed over `count` items and their number (an int or a scalar tensor), e.g. "
              "`(losses.sum(), (labels != -100).sum())` for a token-weighted loss.")


def loss_parts(result: Any, owner: str) -> LossParts:
    """Read a ``loss_fn`` result ([Note: token-weighted loss]); anything else is refused naming ``owner``."""
    if isinstance(result, (Tensor, int, float)):
        return LossParts(_scalar(result, owner, "its loss"))
    if isinstance(result, (tuple, list)) and len(result) == 2:
        total = _scalar(result[0], owner, "the sum of its (sum, count) pair")
        count = result[1]
        if isinstance(count, Tensor) and count.numel() == 1 and not count.is_complex():
            return LossParts(total, count.detach().reshape(()).to(total.device, torch.float64))
        if isinstance(count, (int, float)) and not isinstance(count, bool):
            return LossParts(total, torch.tensor(float(count), dtype=torch.float64, device=total.device))
        raise TypeError(f"{owner}.loss_fn returned a (sum, count) pair whose count is {_describe(count)}. {_LOSS_RULE}")
    raise TypeError(f"{owner}.loss_fn returned {_describe(result)}. {_LOSS_RULE}")


def _scalar(value: Any, owner: str, what: str) -> Tensor:
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        return value.reshape(())
    hint = ""
    if isinstance(value, Tensor) and value.numel() > 1:
        hint = " Reduce per-sample losses: `losses.mean()`, or return `(losses.sum(), losses.numel())`."
    elif isinstance(value, (int, float)):
        hint = " A Python number carries no gradient: compute the loss from `output` with torch operations."
    raise TypeError(f"{owner}.loss_fn returned {what} as {_describe(value)}. {_LOSS_RULE}{hint}")


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (int, float)):
        return f"a Python {type(value).__name__} ({value!r})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"


def target_elements(target: Any) -> int:
    """``N`` of [Note: token-weighted loss]: the batch's target element count (any positive constant would do)."""
    return max(1, sum(t.numel() for t in layer_args(target) if isinstance(t, Tensor)))
