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

What cannot work is refused at setup, on every rank with the same message (:func:`check_optimizers_agree`):
``configure_optimizers`` returning a different number of optimizers or schedulers on some ranks (e.g. ``None``
where a stage has nothing to train: that rank would skip the optimizer steps, and with them the collectives its
peers wait in), and a fit where no stage has any parameter to train (on one device that fails in ``backward``).

Frozen parameters get no gradient (torch's backward skips leaves without ``requires_grad``; the split I/W backward
of the zero-bubble schedules too), so no optimizer moves them, weight decay included: they stay bit-identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_pipe.config import PipelineConfigError


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


def tie_homes(optimizers: Sequence[Any], ties: Sequence[tuple[nn.Parameter, tuple[str, ...]]]
              ) -> dict[tuple[str, ...], list[tuple[int, str]]]:
    """For each weight tied across ranks (its copy here, its names): the optimizers and hyper-parameters that hold
    the copy on this rank, as ``(optimizer index, hyper-parameters)``."""
    homes: dict[tuple[str, ...], list[tuple[int, str]]] = {}
    for param, names in ties:
        homes[names] = [(i, repr(sorted((k, v) for k, v in group.items() if k != "params")))
                        for i, opt in enumerate(optimizers)
                        for group in getattr(opt, "optimizer", opt).param_groups
                        if any(p is param for p in group["params"])]
    return homes


def _tie_error(every: list[Any]) -> str | None:
    """The copies of a tied weight are updated by different optimizers on different ranks: they would drift apart."""
    held: dict[tuple[str, ...], dict[int, list[tuple[int, str]]]] = {}
    for rank, (*_, homes) in enumerate(every):
        for names, where in homes.items():
            held.setdefault(names, {})[rank] = where
    for names, per_rank in held.items():
        if len({repr(w) for w in per_rank.values()}) > 1:
            seen = "; ".join(f"rank {r}: optimizer(s) {sorted({i for i, _ in w})}" for r, w in per_rank.items())
            return (f"The weight tied across stages under the names {list(names)} is held by several ranks, and each "
                    f"copy is updated by the optimizers (and param groups) that hold it there: {seen}. The copies "
                    "would train apart. Rule: a tied weight is in the same optimizers and param groups on every rank "
                    "that holds it. Choose each optimizer's parameters by name with every name of the tied weight "
                    "in the same one (`self.named_parameters(remove_duplicate=False)` lists each copy under its "
                    "layer's name), not by layer position.")
    return None


def check_optimizers_agree(optimizers: Sequence[Any], schedulers: int, params: Sequence[nn.Parameter],
                           stages: str, ties: Sequence[tuple[nn.Parameter, tuple[str, ...]]] = ()) -> None:
    """Refuse, on every rank alike, optimizer layouts that differ between ranks, tied copies updated differently
    (:func:`tie_homes`) and fits with nothing to train ([Note: stages with nothing to train]). Collective over the
    world (one object gather at setup).

    ``stages`` describes this rank's stages and layers for the message (e.g. ``"stage 3 (layers 4-5)"``)."""
    mine = (len(optimizers), schedulers, sum(p.numel() for p in params if p.requires_grad), stages,
            tie_homes(optimizers, ties))
    if dist.is_available() and dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    counts = {(n, s) for n, s, *_ in every}
    if len(counts) > 1:
        per_rank = "; ".join(f"rank {r} ({where}): {n} optimizer(s), {s} scheduler(s)"
                             for r, (n, s, _, where, _) in enumerate(every))
        raise PipelineConfigError(
            "configure_optimizers runs on every rank with that rank's layers only, and must return the same number "
            f"of optimizers and LR schedulers on every rank (each optimizer step is a collective). Got {per_rank}. "
            "Build every optimizer on every rank, even over no parameters (e.g. `AdamW(p for p in "
            "self.parameters() if p.requires_grad)` is allowed to be empty on a stage with nothing to train: it "
            "steps nothing); do not return None where a stage has nothing to train.")
    tie_error = _tie_error(every)
    if tie_error is not None:
        raise PipelineConfigError(tie_error)
    if not any(trainable for _, _, trainable, *_ in every):
        where = "; ".join(f"rank {r}: {w}" for r, (_, _, _, w, _) in enumerate(every))
        raise PipelineConfigError(
            "Training needs at least one parameter with requires_grad=True on some stage; every parameter of the "
            f"module is frozen on every rank ({where}). Unfreeze the parameters to train (e.g. the adapters), or "
            "use trainer.validate / trainer.predict to only run the model.")
