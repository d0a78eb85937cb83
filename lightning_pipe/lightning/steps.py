"""How Lightning's steps become pipeline steps: each step runs inside ``engine.running`` (a training batch with the
hints of Lightning's loop), a failure is reported to the peers at once, every rank agrees at the step's end; the
optimizer step's closure syncs the gradients before Lightning's hooks and clipping see them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.lightning.faults import PipelineFaults
from lightning_pipe.lightning.manual import step_context
from lightning_pipe.lightning.module import check_returned_loss
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.runtime.train_step import StepHints


def step_hints(trainer: Trainer, batch_idx: int | None, faults: PipelineFaults | None) -> StepHints:
    """What Lightning's loop rules say of this training batch (exact whatever they say: hints only decide how much
    of the data-parallel sync overlaps the schedule), and the fault handling's flags to agree with its loss."""
    accumulate = trainer.accumulate_grad_batches
    return StepHints(optimizer_step_follows=not _compat.should_accumulate(trainer),
                     zero_grad_follows=batch_idx is None or batch_idx % accumulate == 0,
                     accumulate_grad_batches=accumulate,
                     flags=faults.train_flags if faults is not None else None)


def run_step(engine: PipelineEngine, module: LightningModule, faults: PipelineFaults | None, phase: str,
             parent: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Lightning's ``parent`` step (``training_step`` ...) with the engine set for ``phase``; the training loss
    checked to be the one ``compute_loss`` returned ([Note: the loss a training step returns])."""
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
    hints = step_hints(module.trainer, batch_idx, faults) if phase == "train" else None
    manual = phase == "train" and not module.automatic_optimization  # [Note: manual optimization in a pipeline]
    if faults is not None:
        faults.before_step(phase, batch_idx)
    try:
        with engine.running(phase, batch_idx, hints), step_context(module, engine if manual else None):
            result = parent(*args, **kwargs)
            if phase == "train" and not manual:
                check_returned_loss(result, engine.step_loss, type(module).__name__)
    except BaseException as err:
        if faults is not None:
            faults.report(err)  # now: peers are blocked on this rank ([Note: failure propagation])
        raise
    if faults is not None:
        faults.after_step(phase, batch_idx)  # every rank: stop together on SIGTERM
    return result


def synced_closure(closure: Callable[[], Any], engine: PipelineEngine | None) -> Callable[[], Any]:
    """The optimizer step's closure, then the gradient sync: after every accumulated backward, before
    ``on_before_optimizer_step`` and clipping see the gradients, average over replicas and sum tied copies
    (lightning_pipe.parallel.grads); weight versions (PipeDream-2BW) keep W(b) before the update."""

    def closure_then_sync() -> Any:
        result = closure()
        if engine is not None:
            engine.sync_gradients()
            engine.before_optimizer_step()
        return result

    return closure_then_sync
