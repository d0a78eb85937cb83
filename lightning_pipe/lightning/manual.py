"""Manual optimization under the pipeline: several optimizers, GAN-style alternating updates, per-group optimizers.

[Note: manual optimization in a pipeline]
With ``self.automatic_optimization = False`` a training step drives the optimizers itself. The pipeline keeps the
roles of one device:

- ``self.compute_loss(batch)`` runs the schedule (forward and backward of every micro-batch) and returns the loss,
  as in automatic optimization; its gradients wait aside;
- ``self.manual_backward(loss)`` is where they arrive: it must get exactly that loss (the backward already ran: a
  changed loss would not reach the gradients), hands the gradients over (added to what ``.grad`` holds, so gradients
  accumulate across calls as on one device) and completes them at once: averaged over replicas, tied copies summed.
  So whatever follows sees the whole model's gradients on each stage, as one device does after ``backward``:
  ``self.clip_gradients(opt, ...)`` (the global norm over the optimizer's parameters on every stage), and
  ``torch.nn.utils.clip_grad_norm_`` in the step, which takes the norm over every stage during a manual training
  step ([Note: gradient norms in hooks] in grad_norms.py);
- ``opt.step()`` / ``opt.zero_grad()`` act on the parameters this rank holds of each optimizer (an optimizer with
  none here steps nothing: [Note: stages with nothing to train] in optimizers.py); ``toggle_optimizer`` freezes the
  other optimizers' parameters on each rank, so the schedule's backward gives them no gradient, as on one device;
- a step may run ``compute_loss`` again once the previous loss went through ``manual_backward`` (a GAN's generator
  and discriminator losses): each is one more pipeline pass over a batch. The loss is chosen in ``loss_fn`` (on the
  last stage) from the module's state, e.g. an attribute the step sets before each ``compute_loss``.

What one pass through the layer list cannot express is refused with the rule, on every rank: a second
``compute_loss`` before ``manual_backward`` of the first (both losses' gradients would be needed at once: compute one
loss in ``loss_fn``, or back-propagate each before the next pass), ``manual_backward`` of anything but
``compute_loss``'s loss (a sum of two passes' losses, a scaled loss: scale inside ``loss_fn``), ``self(x)`` in the
step (each rank holds only its layers: ``compute_output`` runs the pipeline forward), and manual optimization with a
schedule that updates inside the schedule or keeps its own weight versions (PipeDream, PipeDream-2BW, PipeMare), runs
two pipelines (Chimera), or with rebalancing (its layer moves carry one optimizer's state at step boundaries).
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import Tensor

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.lightning.grad_norms import global_norms
from lightning_pipe.schedules import SchedulePlan


def check_manual_optimization(module: Any, plan: SchedulePlan, config: PipelineConfig) -> None:
    """At setup, before anything is split: manual optimization with what cannot run it ([Note: manual optimization
    in a pipeline])."""
    if module.automatic_optimization:
        return
    own = plan.spec.stage_class or plan.spec.engine
    if own is not None:
        raise PipelineConfigError(
            f"Manual optimization (automatic_optimization=False in {type(module).__name__}) runs with schedules on "
            f"the standard pipeline stage and engine; schedule={plan.spec.name!r} has its own "
            f"({own.__name__}: it updates the weights inside the schedule, keeps weight versions, or runs two "
            "pipelines). Use gpipe, 1f1b, interleaved_1f1b, looped_bfs, the zero-bubble schedules or a custom "
            "list, or automatic optimization.")
    if config.rebalance_every_n_steps is not None:
        raise PipelineConfigError(
            f"Manual optimization (automatic_optimization=False in {type(module).__name__}) cannot rebalance: "
            "moving layers between ranks happens at optimizer-step boundaries that the strategy owns in automatic "
            f"optimization only. Set rebalance_every_n_steps=None (got {config.rebalance_every_n_steps}).")


def hand_over(engine: Any, tensor: Tensor, owner: str) -> None:
    """``self.manual_backward(loss)``: the gradients of the step's ``compute_loss``, completed ([Note: manual
    optimization in a pipeline])."""
    loss = engine.step_loss
    if loss is not None and tensor is not loss:
        seen = f"{float(tensor):.6g}" if tensor.numel() == 1 else f"a tensor of shape {tuple(tensor.shape)}"
        raise RuntimeError(
            f"{owner}.training_step called manual_backward with a loss other than the one compute_loss returned "
            f"({seen} against {float(loss):.6g}). Rule: under PipelineStrategy compute_loss already ran the backward "
            "of every micro-batch, so manual_backward hands those gradients over and a term added to the loss, a "
            "scaling of it or a sum of two compute_loss calls would not reach the gradients. Pass compute_loss's loss "
            "unchanged; put extra terms or a scale in loss_fn (a sum of two losses: one loss_fn computing both).")
    engine.apply_pending_grads()
    engine.sync_gradients()


def step_context(module: Any, engine: Any) -> contextlib.AbstractContextManager[None]:
    """Around a manual-optimization training step: torch's gradient norms over every stage."""
    if engine is None or module.automatic_optimization:
        return contextlib.nullcontext()
    return global_norms(engine)


__all__ = ["check_manual_optimization", "hand_over", "step_context"]
