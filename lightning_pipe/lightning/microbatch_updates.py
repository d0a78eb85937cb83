"""PipeDream and PipeMare (``schedule="pipedream"`` / ``"pipemare"``) inside Lightning's one-optimizer-step-per-batch
loop.

[Note: PipeDream in Lightning's loop]
PipeDream updates every stage once per micro-batch, inside the schedule (``lightning_pipe/schedules/pipedream/stages.py``). Lightning's
automatic optimization steps once per batch: ``LightningModule.optimizer_step`` -> ``LightningOptimizer.step`` (which
counts the step) -> ``Strategy.optimizer_step(closure)``. We keep that loop and move only the update:

* At setup the strategy gives the engine a :class:`~lightning_pipe.schedules.pipedream.stages.MicrobatchUpdate` built on the user's
  optimizer (one stage per rank, so the rank's optimizer holds exactly that stage's parameters). After each
  micro-batch's backward it sums tied copies, averages over data-parallel replicas, clips this stage's gradients
  with ``gradient_clip_val`` / ``gradient_clip_algorithm`` (per stage: the stages update at different times, so
  a norm over all of them is undefined; a weight tied across stages is clipped by its own norm on every holder, so
  its copies stay equal: [Note: clipping a tied weight under PipeDream]), calls ``optimizer.step()`` and
  ``zero_grad(set_to_none=True)``.
* The strategy's ``optimizer_step`` runs Lightning's closure (``training_step`` with the schedule, the
  ``zero_grad`` hooks, the backward hand-off) and *not* the optimizer again. ``LightningOptimizer`` still counts
  one step per batch: ``global_step`` counts batches (each is ``m`` updates per stage); LR schedulers with
  ``interval="step"`` step once per batch, so the learning rate is constant within a batch.
* Each update uses the gradient of its own micro-batch's mean loss (PipeDream's per-micro-batch update), not
  ``loss / m``: a learning rate tuned for batch-mean gradients applies ``m`` times per batch here.
* ``on_before_optimizer_step`` and ``configure_gradient_clipping`` are not called (there is no single step for
  them to precede); ``on_before_zero_grad`` / ``optimizer_zero_grad`` fire once per batch as usual.

Refused, each naming its setting: ``accumulate_grad_batches > 1`` (an update per micro-batch leaves nothing to
accumulate), ``16-mixed`` (its loss scaler skips or keeps whole optimizer steps, agreed once per batch), several
optimizers or manual optimization (which optimizer would step per micro-batch?).

PipeMare ([Note: PipeMare] in ``schedules/pipemare/rule.py``) runs the same loop; its stages also get their rule
(``schedule_options``) and the micro-batch count here, and it refuses ``bf16-mixed`` too: autocast saves a cast copy
of each weight for the backward, which would then run on the forward's weights instead of the current ones.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from lightning_pipe.config import config_error
from lightning_pipe.layers.partition import stage_of
from lightning_pipe.schedules.pipedream.stages import MicrobatchUpdate
from lightning_pipe.schedules.pipemare.rule import rule_from_options, stage_delay
from lightning_pipe.schedules.pipemare.stages import PipeMareStage


def attach_microbatch_updates(strategy: Any, trainer: Trainer) -> None:
    """Check that ``schedule="pipedream"`` (or ``"pipemare"``) can hold for this trainer, then give the engine its
    per-micro-batch update. Every rank runs the same checks on the same settings, so all refuse together."""
    engine, module = strategy.engine, strategy.lightning_module
    name = strategy.plan.spec.name
    rule = f"Schedule {name!r} updates each stage once per micro-batch, inside the schedule"
    if not module.automatic_optimization or len(strategy.optimizers) != 1:
        raise config_error(
            f"{rule}, with the one optimizer configure_optimizers returns (manual optimization cannot be driven "
            "from inside the schedule).",
            f"{len(strategy.optimizers)} optimizer(s), automatic_optimization={module.automatic_optimization}",
            "schedule", fix="Return exactly one optimizer and use automatic optimization")
    if trainer.accumulate_grad_batches != 1:
        raise config_error(
            f"{rule}: there is nothing left to accumulate across batches.",
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}", "accumulate_grad_batches",
            "Trainer(accumulate_grad_batches=1), Hydra trainer.accumulate_grad_batches=1", also=("schedule",))
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        raise config_error(
            f"{rule}; fp16 loss scaling decides once per batch whether the optimizer steps, which cannot hold for "
            "updates made during the batch.", f"precision={strategy.precision_plugin.precision!r}", "precision",
            "use 'bf16-mixed' or '32-true'" if name != "pipemare" else "use '32-true' or 'bf16-true'",
            also=("schedule",))
    pipemare = [stage for stage in engine.stages if isinstance(stage, PipeMareStage)]
    if pipemare and "mixed" in str(strategy.precision_plugin.precision):
        raise config_error(
            "Schedule 'pipemare' runs each backward on the weights current at that time; under autocast the "
            "backward would use the cast copies the forward saved (the forward's weights) instead.",
            f"precision={strategy.precision_plugin.precision!r}", "precision", "use '32-true' or 'bf16-true'",
            also=("schedule",))
    clip_val = trainer.gradient_clip_val
    clip = None
    if clip_val:  # per stage; [Note: clipping a tied weight under PipeDream]
        algorithm = trainer.gradient_clip_algorithm
        clip = (float(clip_val), "norm" if algorithm is None else str(algorithm.value))
    if pipemare:
        configure_pipemare(strategy, pipemare)
    ties = [(param, tie_group.group) for param, tie_group in engine.grads.ties]
    engine.set_microbatch_update(MicrobatchUpdate(strategy.optimizers[0], engine.parameters, engine.groups.dp, ties,
                                                  clip, engine.grads if engine.groups.tensor is not None else None))


def configure_pipemare(strategy: Any, stages: list[PipeMareStage]) -> None:
    """Give PipeMare's stages their rule; refuse learning-rate rescheduling with a weight tied across stages whose
    factors can differ (a stage of delay >= 2): the copies would take different steps and drift apart."""
    rule = rule_from_options(strategy.pipeline_config.schedule_options)
    layout, plan = strategy.lightning_module._pipeline_layout, strategy.plan
    m, p = plan.microbatches, plan.num_stages
    if rule.warmup is not None:
        for tie in layout.tied:
            spanned = sorted({stage_of(layout.ranges, i) for i in tie.layer_indices})
            if len(spanned) > 1 and max(stage_delay(s, p, m) for s in spanned) >= 2:
                raise config_error(
                    "Schedule 'pipemare' with lr_reschedule scales each stage's learning rate by its own delay; a "
                    "weight tied across stages of different delays would take different steps on each and its "
                    "copies would drift apart.",
                    f"lr_reschedule with tied weights {tie.names} on stages {spanned} (delays "
                    f"{[stage_delay(s, p, m) for s in spanned]})", "schedule_options",
                    "set schedule.options.lr_reschedule=false, or place the tie's layers on stages of delay <= 1")
    trainer = strategy.lightning_module.trainer
    for stage in stages:  # global_step counts batches, each m updates per stage (read after a checkpoint's restore)
        stage.configure(rule, m, lambda: trainer.global_step * m)
