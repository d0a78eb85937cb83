"""Compiled layers against eager ones: the CPU GPT of bench/overhead.py, 2 ranks, ``PipelineStrategy(compile=...)``.

Both sides run the same strategy, model, schedule and batches; only ``compile`` differs. Each side's step time is the
median time between the ends of consecutive steps after the warm-up; the compiled side's warm-up holds its
compilation (one layer class at a time: Dynamo compiles each distinct layer once, for training and for eval), which
is reported apart as the time of its first step against the eager first step. The two sides alternate in rounds.
Last line: ``compile_ratio=<compiled / eager step time>`` (below 1: compiled is faster).

    python bench/compile.py [--steps 20] [--rounds 2] [--schedule 1f1b] [--microbatches 4] [--mode default]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402
from bench.overhead import _data, _model  # noqa: E402  (the same GPT and batches)


def fit(args: argparse.Namespace, compile: bool | dict[str, Any]) -> tuple[list[float], float]:
    """Step durations after the warm-up, and the first step's duration (compile=True: mostly compiling)."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback

    from bench._timing import StepClock
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

    clock, first = StepClock(), FirstStep()
    strategy = PipelineStrategy(schedule=args.schedule, microbatches=args.microbatches, compile=compile)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        max_steps=args.steps + args.warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, first],
                        use_distributed_sampler=False)
    trainer.fit(_model(), _data(args.batch * (args.steps + args.warmup), args.batch))
    return clock.durations(args.warmup), first.seconds


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    options: bool | dict[str, Any] = True if args.mode == "default" else {"mode": args.mode}
    results: dict[str, Any] = {"eager": [], "compiled": [], "first_eager": [], "first_compiled": []}
    for _ in range(args.rounds):
        for name, value in (("eager", False), ("compiled", options)):
            times, first = fit(args, value)
            results[name] += times
            results[f"first_{name}"].append(first)
            if dist.is_initialized():
                dist.barrier()
    if int(os.environ["RANK"]) == 0:
        Path(args.out).write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved_1f1b"])
    p.add_argument("--mode", default="default", help="torch.compile mode (default, reduce-overhead, max-autotune)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    # a fresh inductor cache: the first compiled step pays the whole compilation, as a first run does
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
        times = run_ranks(__file__, 2, sys.argv[1:])
    eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print("| layers | median step (ms) | steps timed | first step (s), per round |\n|---|---|---|---|")
    for name, median in (("eager", eager), ("compiled", compiled)):
        firsts = ", ".join(f"{s:.1f}" for s in times[f"first_{name}"])
        print(f"| {name} | {median * 1e3:.1f} | {len(times[name])} | {firsts} |")
    print(f"schedule={args.schedule} microbatches={args.microbatches} ranks=2 batch={args.batch} mode={args.mode}")
    print(f"compile_first_step_s={times['first_compiled'][0]:.1f} eager_first_step_s={times['first_eager'][0]:.1f}")
    print(f"compile_ratio={compiled / eager:.3f}")


if __name__ == "__main__":
    main()
