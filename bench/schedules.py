"""Every pipeline schedule on the same GPT-like model, 2 CPU ranks, the same micro-batch count: step time, speedup
over one process, the theoretical and simulated bubble, and where each rank's time went.

The model is recipes/gpt's GPT (embedding, n transformer blocks, final norm, tied head) cut into balanced stages:
the embedding rides with the first blocks and norm + head with the last ones (2 stages: [emb+4, 4+norm+head] for
8 blocks; 4 stages: [emb+2, 2, 2, 2+norm+head]). One torchrun invocation runs every schedule through
``Trainer(strategy=PipelineStrategy(...))`` in rounds (alternating, to spread the machine's noise); the
single-process reference (the same LightningModule, one thread, no micro-batching) runs before and after it.
Step time is the median time between the ends of consecutive training steps (the best round's median).

Columns: ``bubble theory`` is the schedule's textbook idle fraction (equal F and B; ZB: F = I = W);
``bubble sim`` replays the schedule's real action order with F=1, B=2 (I=W=1) and free communication;
``compute`` is the measured fraction of the step the ranks spent inside stage forward / backward calls, and
``F``/``B``/``I``/``W`` the measured mean milliseconds of one such call (recorded by lightning_pipe.trace). Figures: ``speedup_<row>`` per
schedule, and ``speedup`` of the best one (its name is printed as ``best_schedule=``).

    python -m bench schedules [--steps 8] [--rounds 3] [--microbatches 8] [--batch 32] [--layers 8] [--only a,b]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from bench.common import (
    Benchmark,
    Outcome,
    balanced_split,
    gather,
    gpt,
    run_ranks,
    step_clock,
    token_batches,
    trainer,
    write_result,
)

# (row name, schedule, stages per rank, extra strategy kwargs)
ROWS = [("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("interleaved_1f1b", "interleaved_1f1b", 2),
        ("looped_bfs", "looped_bfs", 2), ("zb_h1", "zb_h1", 2), ("zbv", "zbv", 2), ("dualpipev", "dualpipev", 2),
        ("v_half", "v_half", 2), ("v_min", "v_min", 2),
        ("custom (1F1B lists)", "custom", 1), ("pipedream_2bw", "pipedream_2bw", 1),
        ("pipedream", "pipedream", 1),
        ("chimera", "chimera", 1)]


def _model(args: argparse.Namespace):
    return gpt(n_layer=args.layers, n_embd=args.width, block_size=args.seq)


def _data(args: argparse.Namespace):
    return token_batches(args.batch * (args.steps + args.warmup), args.seq, args.batch)


def _run_pipeline(args: argparse.Namespace, schedule: str, v: int) -> dict:
    import lightning.pytorch as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PipelineStrategy
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.schedules import compute_order, plan_schedule
    from lightning_pipe.trace import StepRecorder

    class Record(Callback):
        """The library's trace recorder (lightning_pipe.trace) measures each stage call of the timed steps."""

        def on_train_start(self, trainer: L.Trainer, *a) -> None:
            self.recorder = StepRecorder(trainer.strategy.engine, keep=None).attach()

    record = Record()

    def arm(finished: int) -> None:
        if finished == args.warmup:
            record.recorder.armed = True  # record the timed steps only

    clock = step_clock(on_step=arm)
    world = dist.get_world_size()
    options = {}
    if schedule == "custom":
        order = compute_order(plan_schedule(PipelineConfig(schedule="1f1b", microbatches=args.microbatches), world))
        options = {"actions": [[str(a) for a in order[r] if a is not None] for r in range(world)]}
    strategy = PipelineStrategy(schedule=schedule, microbatches=args.microbatches, stages_per_rank=v,
                                partition=balanced_split(args.layers, world * v), schedule_options=options)
    trainer(strategy, args.steps + args.warmup, [clock, record]).fit(_model(args), _data(args))
    diffs = clock.durations(args.warmup)
    timed = sum(diffs)
    spent: dict[str, list[float]] = defaultdict(list)
    for rec in record.recorder.records:
        for sl in rec.slices:
            if sl.kind in "FBIW":  # stage forward / backward calls (the loss is not counted)
                spent[sl.kind].append((sl.end_ns - sl.start_ns) / 1e9)
    mine = {"compute": sum(sum(x) for x in spent.values()) / timed if timed else 0.0,
            "ms": {k: 1e3 * statistics.mean(x) for k, x in spent.items() if x}}
    return {"step": statistics.median(diffs), "ranks": gather(mine)}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rows = [r for r in ROWS if args.only is None or r[0].split()[0] in args.only.split(",")]
    results: dict[str, list] = defaultdict(list)
    for _ in range(args.rounds):
        for name, schedule, v in rows:
            results[name].append(_run_pipeline(args, schedule, v))
            dist.barrier()
    write_result(args, results)


def single_process(args: argparse.Namespace) -> float:
    """The same LightningModule on one process, one thread, whole batches (no pipeline, no micro-batches)."""
    import torch

    torch.set_num_threads(1)
    clock = step_clock()
    trainer("auto", args.steps + args.warmup, [clock], devices=1).fit(_model(args), _data(args))
    return statistics.median(clock.durations(args.warmup))


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--only", default=None, help="comma-separated row names (default: all)")


def run(args: argparse.Namespace) -> Outcome:
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.schedules import compute_order, plan_schedule, simulate

    single = [single_process(args)]
    results = run_ranks("schedules", 2, args)
    single.append(single_process(args))
    t_single = min(single)
    lines = [f"GPT: {args.layers} blocks, width {args.width}, seq {args.seq}, batch {args.batch}, "
             f"{args.microbatches} micro-batches, 2 CPU ranks x 1 thread; one process: {t_single * 1e3:.0f} ms/step",
             "", "| schedule | stages/rank | step (ms) | speedup vs 1 process | bubble theory | bubble sim | compute "
             "r0 / r1 | F / B / I / W ms (r0) |", "|---|---|---|---|---|---|---|---|"]
    figures: dict[str, float] = {}
    best = None
    for name, schedule, v in ROWS:
        if name not in results:
            continue
        runs = results[name]
        step = min(r["step"] for r in runs)
        best_run = min(runs, key=lambda r: r["step"])
        config = (PipelineConfig(schedule="1f1b", microbatches=args.microbatches) if schedule == "custom" else
                  PipelineConfig(schedule=schedule, microbatches=args.microbatches, stages_per_rank=v))
        plan = plan_schedule(config, 2)
        theory = plan.theoretical_bubble()
        sim = simulate(compute_order(plan), plan.num_stages).bubble
        compute = " / ".join(f"{r['compute']:.0%}" for r in best_run["ranks"])
        ms = best_run["ranks"][0]["ms"]
        parts = " / ".join(f"{ms[k]:.1f}" if k in ms else "-" for k in "FBIW")
        speedup = t_single / step
        lines.append(f"| {name} | {v} | {step * 1e3:.0f} | {speedup:.2f}x | {theory:.1%} | {sim:.1%} | {compute} | "
                     f"{parts} |")
        figures[f"speedup_{name.split()[0]}"] = speedup
        if best is None or speedup > best[1]:
            best = (name, speedup)
    assert best is not None
    lines.append(f"best_schedule={best[0].split()[0]}")
    figures["speedup"] = best[1]
    return Outcome("\n".join(lines), figures)


BENCHMARK = Benchmark(
    "schedules", "every schedule on the same GPT balanced over 2 ranks: step time, speedup over one process, "
    "theoretical and simulated bubble, measured F / B / I / W", run, arguments, worker,
    quick=("--steps", "4", "--warmup", "2", "--rounds", "1"))
