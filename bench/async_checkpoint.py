"""What checkpointing every N steps costs a training run: none, synchronous, asynchronous ([Note: asynchronous
checkpoints]), measured in one launch of 2 CPU ranks with the variants interleaved round by round.

The model is the recipe's GPT at a width where a checkpoint is worth writing (default 12.7 M parameters: ~150 MB
with AdamW's state) on random byte tokens; every variant runs the same steps from the same seed. A variant's time is
from the start of its second step to the end of ``fit`` (the last asynchronous write included), per step; the
figures are the median over rounds and the ratio to the run without checkpoints.

    python bench/async_checkpoint.py [--steps 24] [--every 4] [--rounds 3] [--width 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("none", "sync", "async")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4, help="a checkpoint every N steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _run(variant: str, args: argparse.Namespace, root: Path) -> float:
    """Seconds per step of one ``fit`` under ``variant``."""
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
    callbacks: list[pl.Callback] = [clock]
    if variant != "none":
        callbacks.append(ModelCheckpoint(dirpath=root / variant, every_n_train_steps=args.every, save_top_k=0,
                                         save_last=True))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
                         strategy=PipelineStrategy(schedule="1f1b", microbatches=4,
                                                   async_checkpoint=variant == "async"),
                         enable_checkpointing=variant != "none", enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks)
    trainer.fit(model, data)
    elapsed = time.perf_counter() - clock.start
    shutil.rmtree(root / variant, ignore_errors=True)
    return elapsed / (args.steps - 1)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    root = Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / "lp-bench-async-checkpoint"
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            times[variant].append(_run(variant, args, root))
    if dist.get_rank() == 0 and args.out:
        Path(args.out).write_text(json.dumps(times))


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        worker(args)
        return
    from bench._ranks import run_ranks

    forwarded = [f"--steps={args.steps}", f"--every={args.every}", f"--rounds={args.rounds}",
                 f"--width={args.width}", f"--layers={args.layers}", *([f"--dir={args.dir}"] if args.dir else [])]
    times = run_ranks(__file__, 2, forwarded)
    median = {v: statistics.median(ts) for v, ts in times.items()}
    print(f"# checkpoint every {args.every} of {args.steps} steps, GPT {args.layers} x {args.width}, 2 CPU ranks, "
          f"{args.rounds} interleaved rounds")
    for variant in VARIANTS:
        print(f"step_s_{variant}={median[variant]:.4f}  rounds={[round(t, 4) for t in times[variant]]}")
    print(f"sync_over_none={median['sync'] / median['none']:.3f}")
    print(f"async_over_none={median['async'] / median['none']:.3f}")
    print(f"async_over_sync={median['async'] / median['sync']:.3f}")


if __name__ == "__main__":
    main()
