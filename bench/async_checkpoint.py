"""What checkpointing every N steps costs a training run: none, synchronous, asynchronous ([Note: asynchronous
checkpoints]), measured in one launch of 2 CPU ranks with the variants interleaved round by round.

The model is the recipe's GPT at a width where a checkpoint is worth writing (default 12.7 M parameters, ~150 MB with
AdamW's state) on random byte tokens; every variant runs the same steps from the same seed. A variant's time runs
from the start of its second step to the end of ``fit`` (the last asynchronous write included), per step; the figures
are the medians over rounds and their ratios to the run without checkpoints.

Figures: ``step_s_none``, ``step_s_sync``, ``step_s_async``, ``sync_over_none``, ``async_over_none``,
``async_over_sync``, and ``save_held_s_sync`` / ``save_held_s_async``: the median time one save held the training
loop (rank 0). The rest of an asynchronous save's cost is the write competing with training for the host's cores.

    python -m bench async_checkpoint [--steps 24] [--every 4] [--rounds 3] [--width 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Benchmark, Outcome, interleave, run_ranks, trainer, write_result

VARIANTS = ("none", "sync", "async")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4, help="a checkpoint every N steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")


def _fit(variant: str, args: argparse.Namespace, root: Path) -> tuple[float, float]:
    """Seconds per step of one ``fit`` under ``variant``, and the median time one save held the loop."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineStrategy
    from recipes.gpt.model import GPT

    class Clock(pl.Callback):
        start = 0.0

        def on_train_batch_start(self, trainer: pl.Trainer, *rest: Any) -> None:
            if trainer.global_step == 1:
                self.start = time.perf_counter()

    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=128, n_layer=args.layers, n_head=8, n_embd=args.width, lr=1e-4,
                warmup_steps=1, max_steps=args.steps)
    tokens = torch.randint(0, 256, (8 * args.steps, 129))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8, drop_last=True)
    clock = Clock()
    callbacks: list[Any] = [clock]
    if variant != "none":
        callbacks.append(ModelCheckpoint(dirpath=root / variant, every_n_train_steps=args.every, save_top_k=0,
                                         save_last=True))
    class Timed(PipelineStrategy):
        """Times how long each save holds the training loop."""

        held: list[float] = []

        def save_checkpoint(self, *a: Any, **kw: Any) -> None:
            start = time.perf_counter()
            super().save_checkpoint(*a, **kw)
            self.held.append(time.perf_counter() - start)

    strategy = Timed(schedule="1f1b", microbatches=4, async_checkpoint=variant == "async")
    strategy.held = []
    trainer(strategy, args.steps, callbacks, enable_checkpointing=variant != "none").fit(model, data)
    elapsed = time.perf_counter() - clock.start
    shutil.rmtree(root / variant, ignore_errors=True)
    return elapsed / (args.steps - 1), statistics.median(strategy.held) if strategy.held else 0.0


def worker(args: argparse.Namespace) -> None:
    root = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "lp-bench-async-checkpoint"
    write_result(args, interleave(VARIANTS, args.rounds, lambda v: _fit(v, args, root)))


def run(args: argparse.Namespace) -> Outcome:
    results = run_ranks("async_checkpoint", 2, args)
    times = {v: [r[0] for r in rs] for v, rs in results.items()}
    held = {v: statistics.median(r[1] for r in rs) for v, rs in results.items()}
    median = {v: statistics.median(ts) for v, ts in times.items()}
    figures = {f"step_s_{v}": median[v] for v in VARIANTS}
    figures.update(sync_over_none=median["sync"] / median["none"], async_over_none=median["async"] / median["none"],
                   async_over_sync=median["async"] / median["sync"], save_held_s_sync=held["sync"],
                   save_held_s_async=held["async"])
    lines = [f"checkpoint every {args.every} of {args.steps} steps, GPT {args.layers} x {args.width}, 2 CPU ranks, "
             f"{args.rounds} interleaved rounds"]
    lines += [f"  {v:5s}: {median[v]:.4f} s/step  rounds {[round(t, 4) for t in times[v]]}  a save held the loop "
              f"{held[v]:.3f} s" for v in VARIANTS]
    return Outcome("\n".join(lines), figures)


BENCHMARK = Benchmark(
    "async_checkpoint", "step time with a checkpoint every N steps: none, synchronous, asynchronous (2 CPU ranks)",
    run, arguments, worker=worker, quick=("--steps", "9", "--rounds", "1", "--width", "256", "--layers", "2"))
