"""Micro-batches the module shapes itself: the batch cut as torch cuts it, then each piece handed to the module's
``trim_microbatch(inputs, target)`` hook (e.g. to drop the padding columns its longest sequence does not need).

[Note: micro-batches of their own length]
A batch sorted by length and cut into micro-batches wastes little padding if each micro-batch is trimmed to its own
longest sequence. Torch's schedules cut a batch into equal pieces themselves, so the engine hands them the trimmed
micro-batches instead (:class:`SplitOverride`) and plans each one's shapes
([Note: shapes without re-inference] in shapes.py). The target crosses as the micro-batch's index (torch cuts
``arange(m)``); the last stage's loss looks up that micro-batch's own target, in the structure the hook returned.
The batch loss is what one device computes over the same micro-batches: for a ``(sum, count)`` loss the global sum
over the global count ([Note: token-weighted loss] in batches.py), which is why a trimmed batch should use one (a
mean per micro-batch weights a token by its micro-batch's length). Evaluation runs the same micro-batches and
combines their losses likewise (means weighted by rows); ``compute_output`` then returns the list of the
micro-batches' outputs, since outputs of different lengths do not concatenate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe._compat import stage_shapes as _stage_shapes
from lightning_pipe.layers.batches import LossParts, input_args, leaves, loss_parts


@dataclass(frozen=True)
class Microbatches:
    """The module's own micro-batches: each one's first-layer arguments and target."""

    args: list[tuple[Tensor, ...]]
    targets: list[Any]


class SplitOverride:
    """Within ``with``: the schedule takes these micro-batches instead of cutting the batch, and (``keep_chunks``)
    returns the last stage's outputs as a list instead of concatenating them (micro-batches of different lengths do
    not concatenate). ``microbatches`` is ``None`` on a rank without the first stage (``count`` empty ones)."""

    def __init__(self, schedule: Any, microbatches: list[tuple[Tensor, ...]] | None, count: int,
                 keep_chunks: bool) -> None:
        self.schedule, self.microbatches, self.count, self.keep_chunks = schedule, microbatches, count, keep_chunks

    def __enter__(self) -> None:
        mbs, m = self.microbatches, self.count
        _stage_shapes.replace_split(
            self.schedule, lambda args, kwargs=None: (list(mbs) if mbs is not None else [()] * m, [{}] * m),
            (lambda chunks: list(chunks)) if self.keep_chunks else None)

    def __exit__(self, *exc: object) -> None:
        _stage_shapes.restore_split(self.schedule)


def cut_rows(value: Any, m: int) -> list[Any]:
    """``value``'s rows in ``m`` pieces as torch cuts them (``tensor_split``), structure kept."""
    if isinstance(value, Tensor):
        return list(torch.tensor_split(value, m))
    if isinstance(value, dict):
        parts = {k: cut_rows(v, m) for k, v in value.items()}
        return [type(value)((k, parts[k][i]) for k in value) for i in range(m)]
    if isinstance(value, (tuple, list)):
        cols = [cut_rows(v, m) for v in value]
        rows = [[c[i] for c in cols] for i in range(m)]
        return [type(value)(*r) if hasattr(value, "_fields") else type(value)(r) for r in rows]
    return [value] * m


def explicit_microbatches(module: Any, inputs: Any, args: tuple[Tensor, ...], target: Any, m: int,
                          owner: str) -> Microbatches | None:
    """The micro-batches ``module.trim_microbatch`` makes of this batch, or ``None`` when the module has no such
    hook or it returned every micro-batch unchanged (torch then cuts the batch itself)."""
    trim: Callable[[Any, Any], tuple[Any, Any]] | None = getattr(module, "trim_microbatch", None)
    if trim is None or args[0].shape[0] < m:
        return None
    pieces = [torch.tensor_split(a, m) for a in args]
    targets = cut_rows(target, m)
    out_args, out_targets, changed = [], [], False
    for i in range(m):
        cut = tuple(p[i] for p in pieces)
        new_inputs, new_target = trim(cut[0] if isinstance(inputs, Tensor) else cut, targets[i])
        new_args = input_args(new_inputs, owner)
        changed = changed or new_target is not targets[i] or len(new_args) != len(cut) or any(
            a is not b for a, b in zip(new_args, cut))
        out_args.append(new_args)
        out_targets.append(new_target)
    if not changed:
        return None
    kinds = {tuple((a.dim(), a.dtype) for a in mb) for mb in out_args}
    if len(kinds) != 1:
        raise ValueError(
            f"{owner}.trim_microbatch returned micro-batches whose inputs differ in number, rank or dtype: "
            f"{[[(tuple(a.shape), a.dtype) for a in mb] for mb in out_args]}. Rule: it may change lengths only "
            "(every micro-batch keeps the same tensors, each with the same number of dims and dtype).")
    return Microbatches(out_args, out_targets)


def target_count(targets: list[Any]) -> int:
    """``N`` of [Note: token-weighted loss] over explicit micro-batches."""
    return max(1, sum(t.numel() for target in targets for t in leaves(target) if isinstance(t, Tensor)))


def microbatch_loss(loss_fn: Callable[[Any, Any], Any], outputs: list[Any], mbs: Microbatches, owner: str) -> Tensor:
    """The batch loss over explicit micro-batches, as one device computes it over the same micro-batches: a
    ``(sum, count)`` loss as global sum over global count, a mean weighted by each micro-batch's rows."""
    parts = [loss_parts(loss_fn(out, tgt), owner) for out, tgt in zip(outputs, mbs.targets)]
    if any(p.count is None for p in parts):
        rows = [float(mb[0].shape[0]) for mb in mbs.args]
        return sum(p.value.float() * r for p, r in zip(parts, rows)) / sum(rows)  # type: ignore[return-value]
    total = torch.stack([p.value.double() for p in parts]).sum()
    count = torch.stack([p.count for p in parts if p.count is not None]).sum()
    return LossParts(total, count).reduced().float()
