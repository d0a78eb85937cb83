"""PipelinePrecision: precision decisions that agree across every stage of the pipeline.

Each stage holds only part of the gradients, so anything that looks at "all gradients" — the norm for clipping,
an overflow check — must be reduced over the pipeline group. The strategy converts Lightning's default plugin into
this one (a custom strategy receives a generic ``Precision`` through its setter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

if TYPE_CHECKING:  # pragma: no cover
    from lightning_pipe.engine import PipelineEngine

SUPPORTED_PRECISION = ("32-true",)


class PipelinePrecision(Precision):
    """fp32 training with gradient clipping by the *global* norm over all pipeline stages."""

    precision = "32-true"

    def __init__(self) -> None:
        super().__init__()
        self.engine: PipelineEngine | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.engine is None:  # not set up yet / single process: plain clipping is global already
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.engine.clip_grad_norm_(list(self.main_params(optimizer)), float(clip_val))

    @override
    def backward(self, tensor: Any, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """The schedule already ran backward inside training_step; hand its gradients over now (see the engine's
        [Note: gradients across Lightning's zero_grad])."""
        if self.engine is None:
            return super().backward(tensor, model, optimizer, *args, **kwargs)
        self.engine.apply_pending_grads()

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        engine = self.engine

        def closure_then_sync() -> Any:
            # After every accumulated backward, before on_before_optimizer_step and clipping see the gradients.
            result = closure()
            if engine is not None:
                engine.sync_gradients()
            return result

        return super().optimizer_step(optimizer, model, closure_then_sync, **kwargs)
