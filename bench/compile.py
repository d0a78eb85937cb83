"""Compiled layers against eager ones: the CPU GPT of bench/overhead.py, 2 ranks, ``PipelineStrategy(compile=...)``.

Both sides run the same strategy, model, schedule and batches; only ``compile`` differs. Each side's step time is the
median time between the ends of consecutive steps after the warm-up; the compiled side's warm-up holds its
compilation (one layer class at a time: Dynamo compiles each distinct layer once, for training and for eval), which
is reported apart as the time of its first step against the eager first step. The two sides alternate in rounds.
Figures: ``compile_ratio`` (compiled / eager step time; below 1: compiled is faster), ``compile_first_step_s``,
``eager_first_step_s``, ``noise_floor`` (the eager steps against themselves).

    python -m bench compile [--steps 20] [--rounds 2] [--schedule 1f1b] [--microbatches 4] [--mode default]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from bench.common import Benchmark, Outcome, interleave, noise_floor, run_ranks, step_clock, trainer, write_result
from bench.overhead import _data, _model  # the same GPT and batches


def fit(args: argparse.Namespace, compile: bool | dict[str, Any]) -> tuple[list[float], float]:
    """Step durations after the warm-up, and the first step's duration (compile=True: mostly compiling)."""
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PipelineStrategy

    class FirstStep(Callback):
        def __init__(self) -> None:
            self.seconds = 0.0

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == 0:
                self.seconds = -time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == 1:
                self.seconds += time.perf_counter()

    clock, first = step_clock(), FirstStep()
    strategy = PipelineStrategy(schedule=args.schedule, microbatches=args.microbatches, compile=compile)
    trainer(strategy, args.steps + args.warmup, [clock, first]).fit(_model(), _data(args))
    return clock.durations(args.warmup), first.seconds


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    options: bool | dict[str, Any] = True if args.mode == "default" else {"mode": args.mode}

    def one(name: str) -> tuple[list[float], float]:
        out = fit(args, False if name == "eager" else options)
        if dist.is_initialized():
            dist.barrier()
        return out

    runs = interleave(["eager", "compiled"], args.rounds, one)
    write_result(args, {name: [t for times, _ in done for t in times] for name, done in runs.items()}
                 | {f"first_{name}": [first for _, first in done] for name, done in runs.items()})


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved_1f1b"])
    p.add_argument("--mode", default="default", help="torch.compile mode (default, reduce-overhead, max-autotune)")


def run(args: argparse.Namespace) -> Outcome:
    # a fresh inductor cache: the first compiled step pays the whole compilation, as a first run does
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
        times = run_ranks("compile", 2, args)
    eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
    lines = ["| layers | median step (ms) | steps timed | first step (s), per round |", "|---|---|---|---|"]
    for name, median in (("eager", eager), ("compiled", compiled)):
        firsts = ", ".join(f"{s:.1f}" for s in times[f"first_{name}"])
        lines.append(f"| {name} | {median * 1e3:.1f} | {len(times[name])} | {firsts} |")
    lines.append(f"schedule={args.schedule} microbatches={args.microbatches} ranks=2 batch={args.batch} "
                 f"mode={args.mode}")
    return Outcome("\n".join(lines), {"compile_first_step_s": times["first_compiled"][0],
                                      "eager_first_step_s": times["first_eager"][0],
                                      "noise_floor": noise_floor(times["eager"]), "compile_ratio": compiled / eager})


BENCHMARK = Benchmark(
    "compile", "compiled layers (PipelineStrategy(compile=True)) against eager ones on the GPT of the overhead "
    "benchmark, 2 ranks; the first compiled step apart", run, arguments, worker,
    slow="inductor's first compile takes minutes on 2 cores")
