"""PipeMare (``schedule="pipemare"``): asynchronous 1F1B with one weight version per stage and an update per
micro-batch, with learning-rate rescheduling and discrepancy correction ([Note: PipeMare] in ``rule.py``; the
stages: ``stages.py``; the Lightning side is PipeDream's, ``lightning/microbatch_updates.py``)."""

from __future__ import annotations

from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec
from lightning_pipe.schedules.pipedream.spec import resolve_versioned
from lightning_pipe.schedules.pipemare.rule import OPTIONS, rule_from_options
from lightning_pipe.schedules.pipemare.stages import PipeMareStage
from lightning_pipe.schedules.registry import bubble_flush, order_1f1b


def resolve_pipemare(spec: ScheduleSpec, config: PipelineConfig, pipeline_size: int) -> SchedulePlan:
    """PipeDream's rules (one stage per rank, m >= p, no recomputation or offload; split backward is never in its order),
    and the two techniques' options checked here, on every rank before any process waits."""
    rule_from_options(config.schedule_options)
    if config.recompute_every is not None:
        raise config_error(
            "Schedule 'pipemare' reads the weights at backward time for the tensors the forward saved; recomputed "
            "layers would re-run their forward then, on other weights than the forward's, so activation "
            "recomputation is not available with it.",
            f"recompute={config.recompute!r}", "recompute", "set it to 'none', or choose another schedule",
            also=("schedule",))
    if config.offload != "none":
        raise config_error(
            "Schedule 'pipemare' packs the tensors the forward saves to rebuild the weights at backward time; "
            "activation offload packs the same saved tensors to move them to host memory, and the two cannot both "
            "own them, so offload is not available with it.",
            f"offload={config.offload!r}", "offload", "set it to 'none', or choose another schedule",
            also=("schedule",))
    return resolve_versioned(spec, config, pipeline_size)


def _resume_caveat(config: PipelineConfig) -> str | None:
    if rule_from_options(config.schedule_options).decay is None:
        return None  # without discrepancy correction a resume is exact
    return ("the checkpoint holds no velocity estimate (delta) of the discrepancy correction for this layout's "
            "stages (it was written under another schedule or correction setting, consolidated to a single file, or "
            "before the first batch), so delta restarts at 0: the first updates after the resume run uncorrected "
            "backwards and the run departs from an uninterrupted one (docs/seed-schedules.md)")


PIPEMARE = ScheduleSpec(
    "pipemare", torch_schedules.Schedule1F1B,
    "PipeMare: 1F1B on one weight version per stage, one update per micro-batch, LR rescheduling and "
    "discrepancy correction",
    theory_bubble=bubble_flush, resolve=resolve_pipemare, order=order_1f1b, options=OPTIONS,
    stage_class=PipeMareStage, needs="m ≥ p; no recompute, no offload",
    resume_caveat=_resume_caveat)
