"""Dynamic rebalancing, measured in one run: the GPT recipe's model on 2 CPU ranks starts from a deliberately bad
split (the embedding and every block on rank 0, only the final norm and head on rank 1); after N steps the strategy
measures the layers, moves them (``rebalance_every_n_steps=N``) and training goes on. Prints the step times around
the move, the split chosen, and

    rebalance_speedup=<median step time before the rebalance / median step time after it>

Excluded from both medians: the first step (warm-up), the step that ran the move, and the first step after it
(torch infers the new stages' shapes). ``measure_rebalance_speedup()`` returns the ratio (for bench/planner.py).

    python bench/rebalance.py [--layers 6] [--width 128] [--seq 64] [--batch 16] [--every 6]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402


def _model(args: argparse.Namespace) -> Any:
    import torch

    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0,
               warmup_steps=5, max_steps=1000)


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from bench._timing import StepClock
    from lightning_pipe import PipelineStrategy

    torch.set_num_threads(1)
    steps = 2 * args.every - 1  # one decision, at step N
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch * steps, args.seq + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch, drop_last=True)
    model = _model(args)
    n = len(model.layers)
    clock = StepClock()
    strategy = PipelineStrategy(schedule="1f1b", microbatches=args.microbatches, partition=[n - 2, 2],
                                rebalance_every_n_steps=args.every, rebalance_threshold=0.05)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock], limit_val_batches=0,
                        use_distributed_sampler=False)
    trainer.fit(model, data)
    assert strategy.rebalancer is not None
    d = [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # d[k - 1]: batch k's time, k >= 1
    n_every = args.every
    before = d[: n_every - 2]  # batches 1 .. N-2 (batch N-1 runs the move)
    after = d[n_every:]  # batches N+1 .. (batch N re-infers shapes)
    events = [{"step": e.step, "split": [list(e.decision.current), list(e.decision.proposed)],
               "gain": e.decision.gain, "moves": len(e.decision.moves)} for e in strategy.rebalancer.history]
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({
            "before": statistics.median(before), "after": statistics.median(after),
            "move_step": d[n_every - 2], "events": events}))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--every", type=int, default=6, help="rebalance_every_n_steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def measure_rebalance_speedup(argv: list[str] | None = None) -> float:
    """Run the benchmark on 2 CPU ranks (``argv``: this script's options); the step-time ratio before / after."""
    res = run_ranks(__file__, 2, list(argv or []))
    return float(res["before"] / res["after"])


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        return worker(args)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    res = run_ranks(__file__, 2, sys.argv[1:])
    print(f"GPT: {args.layers} blocks, width {args.width}, seq {args.seq}, batch {args.batch}, "
          f"m={args.microbatches}, 1f1b on 2 CPU ranks x 1 thread; start split [all but 2, 2]")
    for e in res["events"]:
        print(f"  step {e['step']}: split {e['split'][0]} -> {e['split'][1]} (predicted gain {e['gain']:.0%}, "
              f"{e['moves']} layers moved)")
    print(f"  step before {res['before'] * 1e3:.1f} ms, after {res['after'] * 1e3:.1f} ms; the step that moved "
          f"{res['move_step'] * 1e3:.1f} ms")
    print(f"rebalance_speedup={res['before'] / res['after']:.2f}")


if __name__ == "__main__":
    main()
