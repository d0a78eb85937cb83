"""PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"): double-buffered weights;
and PipeDream (Narayanan et al. 2019): weight stashing, one update per micro-batch ([Note: PipeDream weight
stashing] in ``lightning_pipe/schedules/pipedream/stages.py``; the Lightning side: ``lightning/microbatch_updates.py``).

[Note: PipeDream-2BW semantics]
``W(b+1) = W(b) - update(mean_j grad f_{b,j}(W(b-1)))`` with ``W(-1) = W(0)``: every micro-batch j of batch b runs
forward *and* backward on the weights of one batch earlier; the gradient is applied to the current weights by the
user's optimizer, once per batch (so Lightning's loop, schedulers, clipping, accumulation and ``global_step`` are
unchanged). Each stage holds two versions: the live weights and the stash
(:class:`~lightning_pipe.schedules.pipedream.versioned.VersionedPipelineStage`). The engine refreshes the stash right before every
optimizer step (``PipelineEngine.before_optimizer_step``), so W(b) is kept as the version batch b+1 runs on.

The order is torch's 1F1B (``Schedule1F1B``) over the batch's micro-batches. Torch's runtime keeps nothing in flight
across ``step()`` calls, so there is still a flush per batch: the bubble is 1F1B's, (p - 1) / (m + p - 1). What 2BW's
staleness buys in the paper (no flush between batches) needs batches that overlap, which this runtime cannot do; what
it keeps exactly is the update rule, so a model tuned for 2BW trains the same way here. The paper's m >= p - 1
condition (two versions suffice) holds for every m that torch's 1F1B accepts (m >= p).

With ``accumulate_grad_batches = k`` a "batch" above is one optimizer step: all k batches run on the version before
the last update. A skipped optimizer step (fp16 overflow, ``training_step`` returning ``None``) leaves the live
weights as they are and the stash equal to them, so the next batch runs on the current weights. The stash is not
checkpointed: a resumed run starts again from ``W(-1) = W(0)`` (one batch without staleness).

Memory: one extra copy of each stage's parameters (the stash); gradients live once (on the live parameters).
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.runtime.spec import SchedulePlan, ScheduleSpec
from lightning_pipe.schedules.pipedream.stages import StashingPipelineStage, VersionedPipelineStage
from lightning_pipe.schedules.registry import bubble_flush, order_1f1b


def resolve_versioned(spec: ScheduleSpec, config: PipelineConfig, pipeline_size: int) -> SchedulePlan:
    """One stage per rank, m >= p (torch's 1F1B), full backward on stashed weights: no recomputation. Shared by
    PipeDream-2BW and PipeDream (both run torch's 1F1B on weight versions)."""
    if config.stages_per_rank not in (None, 1):
        raise config_error(f"Schedule '{spec.name}' runs one stage per rank (a 1F1B order on weight versions).",
                           f"stages_per_rank={config.stages_per_rank}", "stages_per_rank", "leave it unset or 1")
    if config.recompute_every is not None:
        raise config_error(
            f"Schedule '{spec.name}' runs each stage on a stashed weight version through torch.func.functional_call; "
            "recomputed layers would re-run on the live weights during backward and give wrong gradients, so "
            "activation recomputation is not available with it.",
            f"recompute={config.recompute!r}", "recompute", "set it to 'none', or choose another schedule",
            also=("schedule",))
    m = config.microbatches if config.microbatches is not None else 2 * pipeline_size
    if m < pipeline_size:
        paper = (", which covers the 2BW paper's m >= p - 1 under which two weight versions per stage suffice"
                 if spec.name == "pipedream_2bw" else "")
        raise config_error(
            f"Schedule '{spec.name}' needs at least as many micro-batches as pipeline ranks (torch's 1F1B order"
            f"{paper}).",
            f"microbatches={m}, pipeline size={pipeline_size}", "microbatches")
    return SchedulePlan(spec, pipeline_size, 1, m)


PIPEDREAM_2BW = ScheduleSpec(
    "pipedream_2bw", torch_schedules.Schedule1F1B,
    "PipeDream-2BW: 1F1B on the previous batch's weights (two versions per stage), one update per batch",
    theory_bubble=bubble_flush, resolve=resolve_versioned, order=order_1f1b,
    stage_class=VersionedPipelineStage, tensor_parallel=True, needs="m ≥ p; no recompute",
    resume_caveat=lambda config: "the checkpoint holds no previous weight version (the stash) for this layout's "
    "stages (it was written under another schedule, consolidated to a single file, or before the first batch): the "
    "first batch after the resume runs on the loaded weights instead of the version before them, so the run departs "
    "from an uninterrupted one from there on (docs/seed-schedules.md)")


PIPEDREAM = ScheduleSpec(
    "pipedream", torch_schedules.Schedule1F1B,
    "PipeDream: 1F1B with weight stashing, one optimizer update per micro-batch per stage",
    theory_bubble=bubble_flush, resolve=resolve_versioned, order=order_1f1b,
    stage_class=StashingPipelineStage, tensor_parallel=True, needs="m ≥ p; no recompute")
