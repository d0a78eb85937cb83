"""The next-token loss of a causal LM, as transformers computes it, and its token-weighted ``(sum, count)`` form."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "causal_lm_loss_sum_count"]

IGNORE_INDEX = -100


def causal_lm_loss_sum_count(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(sum of token losses, number of counted tokens)`` of next-token prediction.

    transformers' shift: position t predicts ``labels[:, t + 1]`` (``logits[:, :-1]`` vs ``labels[:, 1:]``); tokens
    whose label is ``ignore_index`` (-100: padding, prompts) are not counted. Logits are upcast to fp32 like the
    model's own loss. The pair lets micro-batch losses be combined weighted by tokens:
    ``sum(sums) / sum(counts)`` is the whole batch's loss.
    """
    labels = labels.to(logits.device)
    shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    count = (shift_labels != ignore_index).sum()
    return total, count


def causal_lm_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean next-token loss over the tokens whose (shifted) label is not ``ignore_index``, as the model's ``.loss``.

    Differs only when no token counts: 0 (still attached to the graph) instead of transformers' NaN.
    """
    total, count = causal_lm_loss_sum_count(logits, labels, ignore_index)
    return total / count.clamp_min(1)
