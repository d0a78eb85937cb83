"""PipelinePrecision: precision decisions that agree across every stage of the pipeline.

Each stage holds only part of the gradients, so anything that looks at "all gradients" — the norm for clipping, the
fp16 overflow check — must be reduced over the ranks. The strategy converts the plugin Lightning builds from
``Trainer(precision=...)`` into this one (a custom strategy receives it through its ``precision_plugin`` setter).

[Note: fp16 loss scaling in a pipeline]
On one device Lightning scales the loss before ``backward``. In a pipeline the backward runs inside the schedule, so
the engine scales each micro-batch loss inside the schedule's loss function (last stage); the scaled gradients
then flow through every stage. All ranks hold one ``ShardedGradScaler`` whose inf/NaN check is all-reduced over the
whole world (pipeline and data-parallel), so every rank skips the same optimizer step and moves its scale
identically. Ranks other than the last never call ``scale()`` on a loss, and a scaler that never scaled refuses
``unscale_``: every rank initialises its scale up front. Its unscale and inf check run on each rank's local
parts of the gradients (:class:`LocalPartsGradScaler`), so tensor-parallel stages, which mix DTensor and plain
gradients, take part too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pipe._compat.lightning import DtypeContextManager, convert_fp_tensor
from lightning_pipe._compat.torch import ShardedGradScaler
from lightning_pipe.config import config_error
from lightning_pipe.lightning.grad_norms import global_norms
from lightning_pipe.lightning.manual import hand_over
from lightning_pipe.parallel.dtensor import local

if TYPE_CHECKING:  # pragma: no cover
    from lightning_pipe.runtime.engine import PipelineEngine

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_HALF = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
         "16-true": torch.float16}


class LocalPartsGradScaler(ShardedGradScaler):
    """The world-agreeing fp16 scaler, unscaling each rank's local parts of its gradients.

    A tensor-parallel stage holds split (DTensor) and whole gradients side by side, and torch unscales with one
    ``_amp_foreach_non_finite_check_and_unscale_`` per device and dtype, which refuses such a mix. Unscaling and the
    inf check are elementwise, so each rank doing its parts (in place: a DTensor's local part shares its storage)
    and the all-reduce of the found-inf flag over the world (``ShardedGradScaler.unscale_``) give every rank the
    same verdict as on whole gradients. Without DTensors the parts are the gradients themselves.
    """

    def _unscale_grads_(self, optimizer: Any, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, Tensor]:
        # torch reads only ``param_groups[i]["params"][j].grad``: hand it stand-ins holding the local parts
        parts = SimpleNamespace(param_groups=[
            {"params": [SimpleNamespace(grad=local(p.grad)) for p in group["params"] if p.grad is not None]}
            for group in optimizer.param_groups])
        return super()._unscale_grads_(parts, inv_scale, found_inf, allow_fp16)


class PipelinePrecision(Precision):
    """Autocast / half weights per stage, fp16 loss scaling agreed by all ranks, clipping by the global norm.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        device: device type for autocast and the scaler (``"cuda"`` or ``"cpu"``).
        init_scale, growth_interval: fp16 loss-scaler settings (``"16-mixed"`` only).
    """

    def __init__(self, precision: PrecisionName = "32-true", device: str = "cuda", init_scale: float = 2.0**16,
                 growth_interval: int = 2000) -> None:
        super().__init__()
        if precision not in SUPPORTED_PRECISION:
            raise config_error(f"PipelinePrecision supports {list(SUPPORTED_PRECISION)}.", f"precision={precision!r}",
                               "precision")
        self.precision = precision
        self.device = device
        self.engine: PipelineEngine | None = None
        self._init_scale, self._growth_interval = init_scale, growth_interval
        self.scaler: Any | None = None  # created in `setup`, once the process group exists

    # ------------------------------------------------------------------ dtype handling
    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def half_dtype(self) -> torch.dtype | None:
        return _HALF.get(self.precision)

    @override
    def convert_module(self, module: Module) -> Module:
        if self.precision.endswith("-true") and self.half_dtype is not None:
            return module.to(dtype=self.half_dtype)
        return module

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        if self.precision.endswith("-true") and self.half_dtype is not None:
            return DtypeContextManager(self.half_dtype)
        return contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision.endswith("-true") and self.half_dtype is not None:
            return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor, dst_type=self.half_dtype)
        return data

    @override
    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=convert_fp_tensor, dtype=Tensor,
                                   dst_type=torch.get_default_dtype())

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast (mixed) or half default dtype (true) around every stage's forward and the loss."""
        if self.is_mixed:
            with torch.autocast(self.device, dtype=self.half_dtype, cache_enabled=False):
                yield
        elif self.half_dtype is not None:
            with DtypeContextManager(self.half_dtype):
                yield
        else:
            yield

    # ------------------------------------------------------------------ wiring to the engine
    def setup(self, engine: PipelineEngine, device: torch.device) -> None:
        """Attach to the engine; create the world-agreeing fp16 scaler ([Note: fp16 loss scaling in a pipeline])."""
        self.engine = engine
        self.device = device.type
        if self.precision == "16-mixed" and self.scaler is None:
            self.scaler = LocalPartsGradScaler(device=device.type, init_scale=self._init_scale,
                                               growth_interval=self._growth_interval,
                                               process_group=dist.group.WORLD if dist.is_initialized() else None)
        if self.scaler is not None:
            self.scaler.scale(torch.ones((), device=device))  # every rank initialises its scale
            engine.loss_scaler = self.scaler.scale

    # ------------------------------------------------------------------ backward / step
    @override
    def backward(self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """The schedule already ran backward inside training_step; hand its gradients over now (see the engine's
        [Note: gradients across Lightning's zero_grad])."""
        if self.engine is None:
            return super().backward(tensor, model, optimizer, *args, **kwargs)
        if not model.automatic_optimization:  # self.manual_backward(loss) ([Note: manual optimization in a pipeline])
            return hand_over(self.engine, tensor, type(model).__name__)
        self.engine.apply_pending_grads()

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:
        # on_after_backward runs in here: its gradient norms are the pipeline's ([Note: gradient norms in hooks])
        with global_norms(self.engine):
            return super().post_backward(tensor, module)

    @override
    def _after_closure(self, model: Any, optimizer: Steppable) -> None:
        # on_before_optimizer_step and configure_gradient_clipping: torch's clip_grad_norm_ / get_total_norm inside
        # them take the norm over every stage ([Note: gradient norms in hooks] in lightning/grad_norms.py)
        with global_norms(self.engine):
            super()._after_closure(model, optimizer)

    @override
    def optimizer_step(  # type: ignore[override]  # lightning.pytorch Precision's signature (narrows fabric's)
        self, optimizer: Steppable, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        # fp16: like Lightning's MixedPrecision, but the inf check inside unscale_ is agreed by every rank.
        closure_result = closure()
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)  # hooks + clipping, on unscaled gradients
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return closure_result if step_output is None else step_output

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.engine is None:  # not set up / one process: torch's clipping is global already
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.engine.grads.clip_grad_norm_(list(self.main_params(optimizer)), float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.engine is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        self.engine.grads.clip_grad_value_(list(self.main_params(optimizer)), float(clip_val))

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def convert_precision_plugin(plugin: Precision) -> PipelinePrecision:
    """Lightning's plugin for ``Trainer(precision=...)`` -> the pipeline's; anything else is refused by the caller."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    if isinstance(plugin, PipelinePrecision):
        return plugin
    if type(plugin) is Precision:
        return PipelinePrecision("32-true")
    if type(plugin) is MixedPrecision:
        if plugin.scaler is not None and type(plugin.scaler) is not torch.amp.GradScaler:
            raise TypeError(f"its custom GradScaler ({type(plugin.scaler).__name__}) cannot be carried over: the "
                            "pipeline's scaler must agree on overflows across all ranks")
        return PipelinePrecision(plugin.precision, device=plugin.device)  # type: ignore[arg-type]
    if type(plugin) is HalfPrecision:
        return PipelinePrecision(plugin.precision)
    raise TypeError(f"{type(plugin).__name__} is not one of Lightning's plain, mixed or half precision plugins")


def to_pipeline_precision(plugin: Precision) -> PipelinePrecision:
    """:func:`convert_precision_plugin`, or an error that keeps its reason (e.g. a custom GradScaler under
    "16-mixed" is refused for the scaler, not for the precision)."""
    try:
        return convert_precision_plugin(plugin)
    except TypeError as err:
        raise config_error(
            f"PipelineStrategy supports precision {list(SUPPORTED_PRECISION)} through PipelinePrecision: "
            "clipping and fp16 overflow checks must agree across stages, which other plugins cannot do.",
            f"precision plugin {type(plugin).__name__} (precision={getattr(plugin, 'precision', '?')!r}), "
            f"refused because: {err}", "precision",
            "use Lightning's own plugin, or Trainer(plugins=[PipelinePrecision(...)]) for scaler settings"
        ) from None

