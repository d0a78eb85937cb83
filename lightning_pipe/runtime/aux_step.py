"""The engine's side of [Note: auxiliary losses] (lightning_pipe/layers/aux.py): each step's context, the gradient
scale its terms get, and their values reduced over the pipeline so every rank logs the same numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.config import config_error
from lightning_pipe.layers.aux import AuxLossContext

__all__ = ["AuxLossStep", "UNVERIFIED_SCHEDULES"]

UNVERIFIED_SCHEDULES = frozenset({"pipedream", "pipedream_2bw", "pipemare"})
"""Schedules whose aux-loss semantics no parity test covers yet: refused on the first step that has aux terms, on
every rank of the pipeline together (the decision is taken on the gathered flags)."""


class AuxLossStep:
    """Per training step: :meth:`begin` a context, :meth:`end` it (values over the pipeline group, checks).

    Whether any stage has aux terms is learnt on the first step (one object all-gather over the pipeline group) and
    kept: models without aux losses then pay nothing. The checks of :meth:`end` run on the gathered flags, so every
    rank of the pipeline raises the same error together (never a hang).
    """

    def __init__(self, pp_group: dist.ProcessGroup | None, pipeline_size: int, owner: str,
                 schedule: str = "") -> None:
        self.pp_group, self.pipeline_size, self.owner = pp_group, pipeline_size, owner
        self.schedule = schedule
        self.anywhere: bool | None = None
        self.context: AuxLossContext | None = None
        self.values: dict[str, Tensor] = {}
        """The last step's per-name values: mean over the micro-batches, summed over layers and stages."""
        self.predicted_count: Tensor | None = None  # the global token count the scale was computed with
        self.uncompensated = False  # a term was scaled without the token count (module without loss_count)

    def begin(self, grad_scale: Callable[[], float]) -> AuxLossContext:
        self.predicted_count, self.uncompensated = None, False
        self.context = AuxLossContext(grad_scale)
        return self.context

    def grad_scale(self, *, per_microbatch: bool, loss_scale: float, loss_scaler: Callable[[Tensor], Tensor] | None,
                   count: Callable[[], Any], elements: float | Tensor, dp_group: dist.ProcessGroup | None, dp_degree: int,
                   device: torch.device) -> float:
        """The gradient of one unit of aux loss in this step ([Note: auxiliary losses]); asked at the first term.

        ``count()`` is the module's ``loss_count(target)`` for this replica's batch (``None``: a mean loss, or no
        such hook). With a count, the replicas' sum is taken over ``dp_group`` exactly as the engine takes the
        main loss's global count (the data-parallel peers of a stage reach their first term at the same point).
        """
        fp16 = float(loss_scaler(torch.ones((), device=device))) if loss_scaler is not None else 1.0
        if per_microbatch:  # PipeDream / PipeMare: each update takes its own micro-batch's loss
            return fp16
        local = count()
        if local is None:
            self.uncompensated = True  # harmless for a mean loss; refused in end() for a (sum, count) one
            return loss_scale * fp16
        total = torch.as_tensor(local, dtype=torch.float64, device=device).reshape(()).clone()
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        self.predicted_count = total
        # the engine multiplies fresh gradients by elements * dp / count afterwards: divide it out in advance
        # (one host read per step, on the aux path only: elements is a device value under the overlapped DP sync)
        return loss_scale * fp16 * float(total.clamp_min(1)) / float(elements * dp_degree)

    def end(self, microbatches: int, global_count: Tensor | None, device: torch.device) -> Tensor:
        """Reduce the step's values; return their total (a 0-dim float32 tensor, 0 without aux terms)."""
        context, self.context = self.context, None
        local = {name: float(v) / microbatches for name, v in (context.values.items() if context else ())}
        predicted = None if self.predicted_count is None else float(self.predicted_count)
        flags = (bool(local), self.uncompensated, predicted)
        if self.anywhere is None or (local and not self.anywhere):
            if self.anywhere is False:
                raise RuntimeError(
                    f"{self.owner}: aux losses (attach_aux_loss) appeared after the first training step, on some "
                    "stages only. Rule: the layers that attach aux terms do so on every training step, from the first.")
            gathered = self._gather((local, flags))
            self.anywhere = any(f[0] for _, f in gathered)
        elif self.anywhere:
            gathered = self._gather((local, flags))
        else:
            self.values = {}
            return torch.zeros((), device=device)
        if self.anywhere and self.schedule in UNVERIFIED_SCHEDULES:
            raise config_error(
                "Aux losses (attach_aux_loss) are verified exact under the synchronous schedules (gpipe, 1f1b, "
                "interleaved_1f1b, looped_bfs, zb_h1, zbv, dualpipev, v_half, v_min, chimera); under the asynchronous "
                "ones (per-micro-batch updates, weight versions) no reference proves them yet, so they are refused "
                "rather than trained unverified.", f"schedule={self.schedule!r} with aux terms attached by "
                f"{self.owner}'s layers", "schedule", "a synchronous schedule, or remove the aux terms")
        self._check([f for _, f in gathered], global_count)
        values: dict[str, float] = {}
        for part, _ in gathered:
            for name, v in part.items():
                values[name] = values.get(name, 0.0) + v
        self.values = {name: torch.tensor(v, dtype=torch.float32, device=device) for name, v in sorted(values.items())}
        return torch.tensor(sum(values.values()), dtype=torch.float32, device=device)

    def _gather(self, obj: Any) -> list[Any]:
        if self.pipeline_size == 1 or self.pp_group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(out, obj, group=self.pp_group)
        return out

    def _check(self, flags: list[tuple[bool, bool, float | None]], global_count: Tensor | None) -> None:
        if global_count is not None and any(f[1] for f in flags):
            raise TypeError(
                f"{self.owner}.loss_fn returns a token-weighted (sum, count) loss and layers attach aux losses, but "
                f"{self.owner} has no `loss_count(target)`. Rule: the engine rescales every fresh gradient by the "
                "batch's global token count after the step ([Note: token-weighted loss]), so an aux term needs that "
                "count before its backward to enter with its own scale ([Note: auxiliary losses]). Define "
                "`loss_count(self, target)` returning the count loss_fn will return for the whole batch (HFCausalLM "
                "has one), or return a mean loss.")
        if global_count is None and any(f[2] is not None for f in flags):
            raise TypeError(
                f"{self.owner}.loss_count(target) returned a count, but loss_fn returned a mean loss, not a "
                "(sum, count) pair. Rule: loss_count is for token-weighted losses only; return None from it otherwise.")
        wrong = [f[2] for f in flags if f[2] is not None and global_count is not None and f[2] != float(global_count)]
        if wrong and global_count is not None:
            raise ValueError(
                f"{self.owner}.loss_count(target) gave {wrong[0]:g} counted items over the "
                f"replicas, but loss_fn counted {float(global_count):g}. Rule: loss_count returns exactly the count "
                "that loss_fn's (sum, count) pairs add up to over the batch (aux gradients are scaled by it).")
