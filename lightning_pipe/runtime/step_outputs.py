"""The last stage's outputs of a training step, kept on request: ``compute_loss(batch, return_outputs=True)``.

[Note: a training step's outputs]
A training metric (an accuracy, say) needs the model's outputs in ``training_step``, where under the pipeline only
the loss came back: the outputs exist on the last stage, per micro-batch, inside the schedule's loss function, and
torch's training step keeps none ([Note: no outputs kept by a training step] in _compat/torch.py). On request, the
loss function keeps each micro-batch's output, detached, under its place in the batch; after the schedule the last
stage joins them along dim 0 in batch order (micro-batches of different lengths, from ``trim_microbatch``, stay a
list, as ``compute_output`` returns them) and every rank of the pipeline gets them (one object broadcast from the
last stage), so the same ``training_step`` updates its metric on every rank, and the metric's sync over the ranks
that read different data counts each sample once. It costs a copy of the outputs on the last stage and that
broadcast, per step that asks (a language model's logits are large: ask only on the steps that log a metric).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _detached(output: Any) -> Any:
    if isinstance(output, Tensor):
        return output.detach()
    return tuple(o.detach() if isinstance(o, Tensor) else o for o in output)


def _join(parts: list[Any]) -> Any:
    if isinstance(parts[0], Tensor):
        same = len({tuple(p.shape[1:]) for p in parts}) == 1
        return torch.cat(parts) if same else parts
    columns = list(zip(*parts))
    if all(len({tuple(p.shape[1:]) for p in column}) == 1 for column in columns):
        return tuple(torch.cat(column) for column in columns)
    return parts


class StepOutputs:
    """This rank's kept outputs of one training step (the last stage's only)."""

    def __init__(self) -> None:
        self._kept: dict[int, Any] | None = None

    @property
    def keeping(self) -> bool:
        return self._kept is not None

    def begin(self, keep: bool) -> None:
        self._kept = {} if keep else None

    def add(self, position: int, output: Any) -> None:
        """Keep one micro-batch's output; ``position``: its place in the batch (its first row, or its index)."""
        if self._kept is not None:
            self._kept[position] = _detached(output)

    def joined(self) -> Any:
        """The batch's outputs in batch order (``None`` where nothing was kept: not the last stage); ends keeping."""
        kept, self._kept = self._kept, None
        if not kept:
            return None
        return _join([kept[k] for k in sorted(kept)])


__all__ = ["StepOutputs"]
