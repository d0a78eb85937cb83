"""Exposed data-parallel gradient sync, with and without overlapping it with the schedule's backward.

Pipeline 2 x replicas 2 on CPU (4 gloo ranks), one Trainer, one model; the engine's ``overlap_dp_sync`` switch
alternates every optimizer step, so both ways see the same machine noise. Per step:

- *exposed sync*: the wall time from the step's last compute (the latest ``schedule.step`` return over the ranks;
  ``perf_counter`` is CLOCK_MONOTONIC, shared by the processes) to the latest rank's gradients being ready for the
  optimizer (``sync_gradients`` returned). It also holds what is not sync at all (the loss broadcast, Lightning's
  hooks between ``training_step`` and the step), the same both ways, so the ratio is conservative.
- *sync calls*: only the gradient-sync calls after the schedule, slowest rank: overlap off, the coalesced
  all-reduce (``lightning_pipe.parallel.grads.all_reduce_coalesced``: flatten, all-reduce, divide, copy back); overlap on,
  the wait for the buckets launched during the schedule (``DataParallelOverlap.wait``).
- the step time (slowest rank), for context: on an oversubscribed CPU the all-reduce's own CPU work competes with
  compute, so hiding it need not shorten the step.

Medians over the timed steps. Figures: ``sync_call_ratio``, ``step_time_ratio`` and ``exposed_dp_sync_ratio`` (overlap
on / off), ``noise_floor`` (the overlap-off steps against themselves).

    python -m bench dp_overlap [--steps 24] [--width 1024] [--layers 8] [--batch 32] [--bucket-mb 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.common import Benchmark, Outcome, noise_floor, residual_mlp, run_ranks, step_clock, trainer, write_result


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pipe.parallel.grads as grads_module
    from lightning_pipe import PipelineStrategy

    calls: dict[int, float] = {}  # batch index -> seconds in the gradient-sync calls after the schedule
    # batch index -> (schedule end, gradients ready) on this rank's clock (CLOCK_MONOTONIC: shared by the ranks)
    exposed: dict[int, tuple[float, float]] = {}
    schedule_end = {"t": 0.0}
    in_schedule: dict[int, float] = {}  # batch index -> seconds in schedule.step on this rank
    current = {"batch": -1}
    original_reduce = grads_module.all_reduce_coalesced

    def timed_reduce(*a: Any, **k: Any) -> None:
        start = time.perf_counter()
        original_reduce(*a, **k)
        calls[current["batch"]] = calls.get(current["batch"], 0.0) + time.perf_counter() - start

    grads_module.all_reduce_coalesced = timed_reduce  # the after-schedule average (overlap off)

    class Alternate(Callback):
        """Overlap on for even steps, off for odd ones; times the overlapped path's wait; gathers at the end."""

        def __init__(self) -> None:
            self.wrapped = False
            self.gathered: list[Any] = []

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            engine = trainer.strategy.engine  # type: ignore[attr-defined]
            current["batch"] = batch_idx
            engine.overlap_dp_sync = batch_idx % 2 == 0
            overlap = engine.dp_overlap
            overlap.bucket_bytes = int(args.bucket_mb * 2**20)
            if not self.wrapped:
                wait = overlap.wait

                def timed_wait() -> Any:
                    start = time.perf_counter()
                    out = wait()
                    calls[current["batch"]] = calls.get(current["batch"], 0.0) + time.perf_counter() - start
                    return out

                overlap.wait = timed_wait
                step, sync = engine.schedule.step, engine.sync_gradients

                def timed_step(*a: Any, **k: Any) -> Any:
                    start = time.perf_counter()
                    out = step(*a, **k)
                    schedule_end["t"] = time.perf_counter()
                    in_schedule[current["batch"]] = schedule_end["t"] - start
                    return out

                def timed_sync() -> None:
                    sync()
                    exposed[current["batch"]] = (schedule_end["t"], time.perf_counter())

                engine.schedule.step, engine.sync_gradients = timed_step, timed_sync
                self.wrapped = True

        def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            self.gathered = [None] * dist.get_world_size()
            dist.all_gather_object(self.gathered, {"calls": calls, "exposed": exposed, "schedule": in_schedule,
                                                   "ends": clock.ends,
                                                   "counts": trainer.strategy.engine.dp_sync_counts})  # type: ignore[attr-defined]

    clock = step_clock()
    alternate = Alternate()
    total = args.steps + args.warmup
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch * 2 * total, args.width, generator=g)
    data = DataLoader(TensorDataset(x, torch.randn(x.shape, generator=g)), batch_size=args.batch, drop_last=True)
    strategy = PipelineStrategy(schedule=args.schedule, microbatches=args.microbatches, data_parallel_size=2)
    # each replica its own batches (the strategy's distributed sampler), as in a data-parallel run
    trainer(strategy, total, [alternate, clock], use_distributed_sampler=True).fit(
        residual_mlp(args.width, args.layers), data)
    write_result(args, alternate.gathered)


def summarize(ranks: list[dict[str, Any]], warmup: int) -> dict[str, dict[str, float]]:
    """Per mode, medians over the timed steps: exposed sync, the sync calls (slowest rank) and the step time."""
    out: dict[str, dict[str, float]] = {}
    steps = sorted(int(b) for b in ranks[0]["calls"])
    for mode, parity in (("before", 1), ("after", 0)):
        timed = [b for b in steps if b >= warmup and b % 2 == parity]
        calls = [max(r["calls"].get(str(b), 0.0) for r in ranks) for b in timed]
        # from the last compute of the step (the latest schedule end) to the latest rank's gradients being ready
        exposed = [max(r["exposed"][str(b)][1] for r in ranks) - max(r["exposed"][str(b)][0] for r in ranks)
                   for b in timed]
        step = [max(r["ends"][b] - r["ends"][b - 1] for r in ranks) for b in timed if b >= 1]
        schedule = [max(r["schedule"][str(b)] for r in ranks) for b in timed]
        out[mode] = {"calls": statistics.median(calls), "exposed": statistics.median(exposed),
                     "schedule": statistics.median(schedule), "step": statistics.median(step), "n": len(timed),
                     "noise_floor": noise_floor(step)}
    return out


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="per replica")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--bucket-mb", type=float, default=4.0)


def run(args: argparse.Namespace) -> Outcome:
    ranks = run_ranks("dp_overlap", 4, args)
    res = summarize(ranks, args.warmup)
    counts = [r["counts"] for r in ranks]
    total = args.steps + args.warmup
    if any(c != {"overlapped": (total + 1) // 2, "after_schedule": total // 2} for c in counts):
        raise SystemExit(f"the overlap switch did not alternate as asked: {counts}")
    grads_mib = args.width * (args.width + 1) * 4 * args.layers / 2 / 2**20
    lines = [f"pipeline 2 x replicas 2, schedule={args.schedule}, microbatches={args.microbatches}, "
             f"width={args.width}, layers={args.layers} ({grads_mib:.0f} MiB of gradients per rank), batch={args.batch} "
             f"per replica, buckets {args.bucket_mb} MiB, load {os.getloadavg()[0]:.1f}",
             "| data-parallel sync | exposed sync (ms) | sync calls after the schedule (ms) | schedule (ms) | step (ms) "
             "| steps |", "|---|---|---|---|---|---|"]
    for mode, label in (("before", "after the schedule (off)"), ("after", "overlapped with backward (on)")):
        r = res[mode]
        lines.append(f"| {label} | {r['exposed'] * 1e3:.1f} | {r['calls'] * 1e3:.1f} | {r['schedule'] * 1e3:.1f} "
                     f"| {r['step'] * 1e3:.1f} | {r['n']} |")
    return Outcome("\n".join(lines), {
        "sync_call_ratio": res["after"]["calls"] / res["before"]["calls"],
        "step_time_ratio": res["after"]["step"] / res["before"]["step"],
        "noise_floor": res["before"]["noise_floor"],
        "exposed_dp_sync_ratio": res["after"]["exposed"] / res["before"]["exposed"]})


BENCHMARK = Benchmark(
    "dp_overlap", "exposed data-parallel gradient sync with the overlap off and on, alternating every step "
    "(pipeline 2 x replicas 2, 4 ranks)", run, arguments, worker,
    quick=("--steps", "8", "--warmup", "2", "--width", "512"))
