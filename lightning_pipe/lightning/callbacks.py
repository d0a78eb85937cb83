"""Lightning callbacks for pipeline runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_pipe.trace import (
    StepRecord,
    StepRecorder,
    plot_timeline,
    save_records,
    write_chrome_trace,
)


class PipelineTimeline(Callback):
    """Measure the pipeline bubble of training steps and record what ran, per rank (off unless this callback is used).

    Every ``every_n_steps``-th training batch (after the first ``warmup_steps``, which include torch's shape
    inference) is recorded on every rank: start and end of each forward, backward, weight-gradient, loss and P2P
    action (see [Note: how the trace is recorded] in ``lightning_pipe.trace``). After a recorded batch it logs,
    with the same value on every rank (gathered over all ranks, so the logger on rank 0 sees the truth):

    - ``pipeline/bubble``: measured idle fraction, ``1 - busy compute / step wall time``, averaged over ranks
      (shown in the progress bar),
    - ``pipeline/bubble_theory``: the schedule's ideal bubble for the same p, v, m (equal stage times, free
      communication),
    - ``pipeline/bubble_pp<r>``: per pipeline rank (averaged over data-parallel replicas),
    - ``pipeline/step_ms``: the slowest rank's schedule step time,
    - ``pipeline/predicted_step_ms`` and ``pipeline/predicted_bubble``: the planner's prediction of the same two
      quantities (the schedule's step, its idle fraction) when the layout came from the planner
      (``schedule="auto"``, ``partition="time"`` / ``"memory"`` or ``plan=``); a layout set by hand has no
      prediction (said once at the start: profile it with ``python -m lightning_pipe.planner``).

    With ``export_dir``, rank 0 writes ``records.json`` (all ranks' recorded steps), ``trace.json`` (Chrome /
    Perfetto trace events) and ``timeline.png`` (the last ``plot_steps`` recorded steps) when training ends.
    Records of the last ``keep_steps`` recorded batches are kept per rank (``self.records``).

    Args:
        every_n_steps: record one training batch in this many (counted in batches, so with gradient accumulation
            every micro-step counts).
        export_dir: where to write the files at the end of ``fit`` (``None``: nothing written).
        warmup_steps: batches at the start of ``fit`` that are never recorded.
        log: log the metrics above (``False``: only record).
        prog_bar: show ``pipeline/bubble`` in the progress bar.
        keep_steps: recorded batches kept in memory per rank.
        plot_steps: recorded batches drawn in ``timeline.png``.
    """

    def __init__(self, every_n_steps: int = 1, export_dir: str | Path | None = None, warmup_steps: int = 1,
                 log: bool = True, prog_bar: bool = True, keep_steps: int = 64, plot_steps: int = 2) -> None:
        if every_n_steps < 1:
            raise ValueError(f"PipelineTimeline(every_n_steps={every_n_steps}): must be >= 1.")
        self.every_n_steps = every_n_steps
        self.export_dir = Path(export_dir) if export_dir is not None else None
        self.warmup_steps = warmup_steps
        self.log = log
        self.prog_bar = prog_bar
        self.keep_steps = keep_steps
        self.plot_steps = plot_steps
        self.recorder: StepRecorder | None = None
        self.last_bubble: float | None = None
        self.last_bubbles_per_pp_rank: list[float] = []
        self._batches = 0
        self._meta: dict[str, Any] = {}

    @property
    def records(self) -> list[StepRecord]:
        return self.recorder.records if self.recorder is not None else []

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or not hasattr(engine, "step_contexts"):
            rank_zero_warn(f"PipelineTimeline does nothing under {type(trainer.strategy).__name__}: it measures "
                           "PipelineStrategy runs (strategy='pipeline').")
            return
        if self.recorder is None or self.recorder.engine is not engine:
            self.recorder = StepRecorder(engine, keep=self.keep_steps)
        self.recorder.attach()
        plan = engine.plan
        self._meta = {"schedule": plan.spec.name, "p": plan.pipeline_size, "v": plan.stages_per_rank,
                      "m": plan.microbatches, "theoretical_bubble": plan.theoretical_bubble(),
                      "data_parallel_size": engine.groups.topology.data_parallel_size,
                      "counts": _split(pl_module)}  # layers per stage: what `planner validate --records` checks
        planned = getattr(trainer.strategy, "planned", None)
        if planned is not None:
            # the plan's schedule step (older plans only carry the whole step, optimizer included)
            self._meta["predicted_step_ms"] = float(planned.get("predicted_schedule_ms",
                                                                planned["predicted_step_ms"]))
            self._meta["predicted_bubble"] = float(planned["predicted_bubble"])
            self._meta["plan"] = planned
        elif self.log:
            rank_zero_info("PipelineTimeline: no pipeline/predicted_step_ms for this run: the layout was set by "
                           "hand, so there is no prediction. schedule='auto', partition='time'/'memory' or a plan "
                           "file (python -m lightning_pipe.planner search) come with one.")
        self._batches = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.recorder is None:
            return
        n = self._batches
        self.recorder.armed = n >= self.warmup_steps and (n - self.warmup_steps) % self.every_n_steps == 0
        self.recorder.step_index = n

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.recorder is None:
            return
        recorded = self.recorder.armed
        self.recorder.armed = False
        self._batches += 1
        if not recorded or not self.records or self.records[-1].step != self._batches - 1:
            return
        record = self.records[-1]
        mean, per_pp, step_ms = self._gather(trainer, record)
        self.last_bubble, self.last_bubbles_per_pp_rank = mean, per_pp
        if not self.log:
            return
        def log(name: str, value: float, prog_bar: bool = False) -> None:
            # Every rank measured the same step and holds the same gathered values: no sync, no rank-0-only.
            pl_module.log(name, value, prog_bar=prog_bar, on_step=True, on_epoch=False, batch_size=1,
                          rank_zero_only=False, sync_dist=False)

        log("pipeline/bubble", mean, prog_bar=self.prog_bar)
        theory = self._meta.get("theoretical_bubble")
        if theory is not None:
            log("pipeline/bubble_theory", float(theory))
        for r, value in enumerate(per_pp):
            log(f"pipeline/bubble_pp{r}", value)
        log("pipeline/step_ms", step_ms)
        if "predicted_step_ms" in self._meta:
            log("pipeline/predicted_step_ms", self._meta["predicted_step_ms"])
            log("pipeline/predicted_bubble", self._meta["predicted_bubble"])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recorder is None:
            return
        self.recorder.detach()
        if self.export_dir is not None:
            self.export(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.recorder is not None:
            self.recorder.detach()

    # ------------------------------------------------------------------ helpers
    def _gather(self, trainer: Trainer, record: StepRecord) -> tuple[float, list[float], float]:
        """Every rank's (pp rank, bubble, step ms) -> mean bubble, per pipeline rank, slowest step; same on all."""
        p = int(self._meta.get("p", 1))
        mine = torch.tensor([float(record.pp_rank), record.bubble(), record.wall_ns / 1e6], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = trainer.strategy.root_device
            if device.type != "cuda":  # gloo takes CPU tensors; NCCL needs the rank's GPU
                device = torch.device("cpu")
            local = mine.to(device)
            rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, local)
            table = torch.stack(rows).cpu()
        else:
            table = mine.unsqueeze(0)
        per_pp = []
        for r in range(p):
            sel = table[table[:, 0] == r]
            per_pp.append(float(sel[:, 1].mean()) if len(sel) else float("nan"))
        return float(table[:, 1].mean()), per_pp, float(table[:, 2].max())

    def gather_records(self) -> list[StepRecord] | None:
        """All ranks' kept records on global rank 0 (``None`` elsewhere). Collective: call on every rank."""
        local = [r.to_dict() for r in self.records]
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [StepRecord.from_dict(d) for d in local]
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # type: ignore
        dist.gather_object(local, gathered, dst=0)
        if dist.get_rank() != 0:
            return None
        return [StepRecord.from_dict(d) for part in gathered for d in part]

    def export(self, trainer: Trainer, export_dir: str | Path | None = None) -> dict[str, Path] | None:
        """Write records.json, trace.json and timeline.png on rank 0. Collective: call on every rank."""
        out = Path(export_dir) if export_dir is not None else self.export_dir
        if out is None:
            raise ValueError("PipelineTimeline.export needs an export_dir.")
        records = self.gather_records()
        if records is None or not trainer.is_global_zero:
            return None
        if not records:
            rank_zero_warn("PipelineTimeline: no step was recorded (fewer batches than warmup_steps?); "
                           "nothing exported.")
            return None
        split = _split(trainer.lightning_module)
        if split != self._meta.get("counts"):  # rebalanced since the start
            self._meta["counts_at_end"] = split
        files = {"records": save_records(records, out / "records.json", self._meta),
                 "trace": write_chrome_trace(records, out / "trace.json", self._meta)}
        try:
            files["png"] = plot_timeline(records, out / "timeline.png", steps=self.plot_steps, meta=self._meta)
        except ImportError as err:  # matplotlib is an optional (dev) dependency
            rank_zero_warn(f"PipelineTimeline: no timeline.png ({err}); "
                           "`python -m lightning_pipe.trace plot records.json out.png` draws it later.")
        if trainer.is_global_zero:
            print(f"[PipelineTimeline] wrote {', '.join(str(p) for p in files.values())}")
        return files


def _split(module: Any) -> list[int] | None:
    """Layers per stage of the module's current cut (None before one)."""
    layout = getattr(module, "_pipeline_layout", None)
    return None if layout is None else [len(r) for r in layout.ranges]
