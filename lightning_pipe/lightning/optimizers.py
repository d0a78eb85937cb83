"""Optimizers of a rank whose stages have nothing to train: ``configure_optimizers`` runs per rank, on its layers.

[Note: stages with nothing to train]
Under the pipeline each rank keeps only its own layers, so the module's ``configure_optimizers`` sees only them.
With frozen layers (PEFT / LoRA / adapters / partial fine-tuning) the usual ``AdamW(p for p in self.parameters()
if p.requires_grad)`` then gets no parameter at all on a stage that holds only frozen layers (a frozen head, a
frozen embedding), or a stage with no parameters (a parameter-free layer), and torch refuses: ``ValueError:
optimizer got an empty parameter list``. The same code is right on one device, so it must work here.

While the strategy calls ``configure_optimizers``, an optimizer built over no parameters gets one *empty parameter
group* instead (:func:`empty_parameter_lists_allowed`): the user's own class with the user's hyper-parameters, that
steps nothing. Every rank then holds the same number of optimizers (Lightning's loop, LR schedulers and the
checkpoint's ``optimizer_states`` see the same layout on every stage), an LR scheduler on it moves its ``lr`` as on
the other ranks, and its state is empty. Param groups that are empty on some ranks are torch's own business: they
are allowed and step nothing. Everything after the optimizer treats "no gradient here" as a contribution of zero
that still joins each collective: the global-norm clip (:class:`~lightning_pipe.parallel.grads.GradientSync`), the
fp16 scaler's inf check (all-reduced over the world, [Note: fp16 loss scaling in a pipeline]), the data-parallel
sync (an empty bucket list) — so no rank waits on one that skipped.

Frozen parameters get no gradient (torch's backward skips leaves without ``requires_grad``; the split I/W backward
of the zero-bubble schedules too), so no optimizer moves them, weight decay included: they stay bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim import Optimizer


@contextlib.contextmanager
def empty_parameter_lists_allowed() -> Iterator[None]:
    """Within: ``torch.optim.<Any>(params=[])`` builds an optimizer with one empty param group instead of raising
    ([Note: stages with nothing to train]). Patches ``Optimizer.__init__`` (which every torch optimizer and most
    third-party ones reach through ``super().__init__(params, defaults)``) for the duration only."""
    original = Optimizer.__init__

    def init(self: Optimizer, params: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(params, torch.Tensor):  # a tensor: torch's own TypeError below
            params = list(params)
            if not params:
                params = [{"params": []}]
        original(self, params, *args, **kwargs)

    Optimizer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Optimizer.__init__ = original  # type: ignore[method-assign]


def has_parameters(optimizer: Any) -> bool:
    """Whether an optimizer (or Lightning's wrapper of one) holds any parameter on this rank."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return any(group["params"] for group in getattr(inner, "param_groups", ()))
