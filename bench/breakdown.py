"""Where a training step's time goes, per rank: the strategy against the hand-written torch loop of bench/overhead.py.

Same model, data, schedule and ranks as ``bench/overhead.py``, one invocation. In the rank processes (never in the
library) the functions a step passes through are wrapped with timers that nest: each category is the time spent in
its functions *minus* the wrapped functions they call, so the categories of a step add up to its time. Collectives
are counted by wrapping ``torch.distributed``'s functions and named by the caller outside torch (``all_reduce <-
faults.after_step``). P2P is torch's post and wait of the schedule's sends and receives, and a wait includes the
time the peer is still computing (the pipeline's bubble). "Lightning's loop (rest)" is what no probe covers:
Lightning's hooks, logging, the LR scheduler, the loop itself (for the hand-written loop: zero_grad, the loop).
Printed: ms per step per category (mean over the timed steps), then the per-step collectives (count, ms). Figures:
``probed_ratio`` (the probes add their own cost to both sides: ``overhead`` gives the ratio), and the collectives
per step of each side on rank 0, ``collectives_per_step_hand`` / ``collectives_per_step_strategy`` (counts).

    python -m bench breakdown [--steps 20] [--schedule 1f1b] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Benchmark, Outcome, gather, run_ranks, write_result
from bench.overhead import add_run_arguments

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier",
               "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "gather_object")
REST = "Lightning's loop (rest)"
ORDER = ["schedule compute (stage forward/backward)", "schedule: loss_fn", "P2P (post + wait, incl. peer's bubble)",
         "schedule: torch host (step, split, ops)", "ours: per-micro-batch stage work", "ours: engine pre/post-step",
         "ours: strategy + precision hooks", "ours: faults.after_step", "collectives (all)",
         "optimizer update", "data loading", "user's training_step + self.log", REST]


class Probe:
    """Nested timers around functions: exclusive time and call count per category, read and reset per step."""

    def __init__(self) -> None:
        self.stack: list[float] = []  # per open region: time spent in wrapped children
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, category: str | Callable[[], str]) -> None:
        had = attr in vars(owner)
        before = vars(owner).get(attr)
        original = getattr(owner, attr)
        probe = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            probe.stack.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                inner = probe.stack.pop()
                name = category if isinstance(category, str) else category()
                probe.ms[name] += (took - inner) * 1e3
                probe.calls[name] += 1
                if probe.stack:
                    probe.stack[-1] += took

        timed.__dict__.update(getattr(original, "__dict__", {}))  # e.g. torch's "hooked" mark on Optimizer.step
        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, before) if had else delattr(owner, attr))

    def unwrap(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        ms, calls = dict(self.ms), dict(self.calls)
        self.ms.clear()
        self.calls.clear()
        return ms, calls


def _caller() -> str:
    """``module.function`` of the first frame outside torch and this file (who issued the collective)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "torch" not in Path(path).parts and not path.endswith("breakdown.py"):
            return f"{Path(path).stem}.{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def install(probe: Probe) -> None:
    """Wrap what a step passes through (both sides; the library's functions simply never run in the hand loop)."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.loops.optimization.automatic import Closure
    from torch.distributed.pipelining import schedules, stage
    from torch.utils.data import dataloader

    from lightning_pipe.lightning.faults import PipelineFaults
    from lightning_pipe.lightning.module import PipelineModule
    from lightning_pipe.lightning.precision import PipelinePrecision
    from lightning_pipe.lightning.strategy import PipelineStrategy
    from lightning_pipe.runtime import stage as our_stage
    from lightning_pipe.runtime.engine import PipelineEngine

    for name in COLLECTIVES:
        if hasattr(dist, name):
            probe.wrap(dist, name, lambda name=name: f"collective: {name} <- {_caller()}")
    compute = ORDER[0]
    for attr in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        probe.wrap(stage._PipelineStageBase, attr, compute)
        probe.wrap(our_stage.PipelineStage, attr, ORDER[4])
    for attr in ("get_fwd_send_ops", "get_bwd_send_ops", "get_fwd_recv_ops", "get_bwd_recv_ops"):
        probe.wrap(stage._PipelineStageBase, attr, ORDER[3])
        probe.wrap(our_stage.PipelineStage, attr, ORDER[4])
    probe.wrap(schedules._PipelineSchedule, "_maybe_compute_loss", ORDER[1])
    probe.wrap(schedules, "_batch_p2p", ORDER[2])
    probe.wrap(schedules, "_wait_batch_p2p", ORDER[2])
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        probe.wrap(cls, "step", ORDER[3])
    for attr in ("_train_step", "apply_pending_grads", "sync_gradients", "before_optimizer_step"):
        probe.wrap(PipelineEngine, attr, ORDER[5])
    for owner, attr in ((PipelineStrategy, "training_step"), (PipelineStrategy, "optimizer_step"),
                        (PipelinePrecision, "backward"), (PipelinePrecision, "optimizer_step")):
        probe.wrap(owner, attr, ORDER[6])
    probe.wrap(PipelineFaults, "after_step", ORDER[7])
    probe.wrap(torch.optim.AdamW, "step", ORDER[9])
    probe.wrap(dataloader._BaseDataLoaderIter, "__next__", ORDER[10])
    probe.wrap(PipelineModule, "training_step", ORDER[11])
    probe.wrap(Closure, "__call__", REST)  # Lightning's closure: its own work is Lightning's


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from bench.overhead import hand_written, through_lightning

    dist.init_process_group("gloo")
    probe = Probe()
    install(probe)
    result: dict[str, Any] = {}
    for side, run in (("hand", hand_written), ("strategy", through_lightning)):
        steps: list[tuple[dict[str, float], dict[str, int]]] = []
        probe.take()
        times = run(args, lambda n, steps=steps: steps.append(probe.take()))
        timed = steps[-len(times):]  # the steps whose durations were kept (after warm-up)
        ms: dict[str, float] = defaultdict(float)
        calls: dict[str, float] = defaultdict(float)
        for step_ms, step_calls in timed:
            for k, v in step_ms.items():
                ms[k] += v / len(timed)
            for k, c in step_calls.items():
                calls[k] += c / len(timed)
        total = sum(times) / len(times) * 1e3
        ms[REST] = ms.get(REST, 0.0) + total - sum(ms.values())
        result[side] = {"total": total, "ms": ms, "calls": calls}
        dist.barrier()
    write_result(args, gather(result))
    # Exit without the interpreter's finalisation: a gloo worker thread can still hold the last reference to the
    # all-gather's work when the main thread starts finalising, and its tensor's decref then needs the GIL of a dying
    # interpreter: std::terminate, SIGABRT after good results (about one run in eight; seen in a core dump).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report_table(ranks: list[dict[str, Any]]) -> str:
    sides = [(side, r) for side in ("hand", "strategy") for r in range(len(ranks))]
    head = " | ".join(f"{'hand-written' if s == 'hand' else 'strategy'} r{r}" for s, r in sides)
    lines = [f"| ms per step | {head} |", "|---" * (len(sides) + 1) + "|"]

    def row(label: str, values: list[float]) -> None:
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |")

    collectives = sorted({k for rk in ranks for s in ("hand", "strategy") for k in rk[s]["ms"]
                          if k.startswith("collective: ")})
    for category in ORDER:
        if category == "collectives (all)":
            row(category, [sum(ranks[r][s]["ms"].get(k, 0.0) for k in collectives) for s, r in sides])
            continue
        row(category, [ranks[r][s]["ms"].get(category, 0.0) for s, r in sides])
    row("**step total**", [ranks[r][s]["total"] for s, r in sides])
    lines += ["", "| collective per step (calls / ms) | " + head + " |", "|---" * (len(sides) + 1) + "|"]
    for k in collectives:
        cells = [f"{ranks[r][s]['calls'].get(k, 0):.1f} / {ranks[r][s]['ms'].get(k, 0.0):.2f}" for s, r in sides]
        lines.append(f"| {k.removeprefix('collective: ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Outcome:
    ranks = run_ranks("breakdown", 2, args)
    hand = max(r["hand"]["total"] for r in ranks)
    light = max(r["strategy"]["total"] for r in ranks)
    counts = {side: sum(c for k, c in ranks[0][side]["calls"].items() if k.startswith("collective: "))
              for side in ("hand", "strategy")}
    report = (report_table(ranks) + f"\nschedule={args.schedule} microbatches={args.microbatches} ranks=2 "
              f"batch={args.batch} (probes add their own cost to both sides: the overhead benchmark gives the ratio)"
              f"\nstep_ms hand={hand:.1f} strategy={light:.1f}")
    return Outcome(report, {"collectives_per_step_hand": counts["hand"],
                            "collectives_per_step_strategy": counts["strategy"], "probed_ratio": light / hand})


def arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p, steps=20)


BENCHMARK = Benchmark(
    "breakdown", "where a training step's time goes per rank, the strategy against the hand-written loop (timers "
    "around the functions a step passes through; collectives counted)", run, arguments, worker,
    quick=("--steps", "10"))
