"""What a new batch shape costs: torch re-infers its P2P buffer shapes whenever the batch's shape signature changes
([Note: re-inference on a new shape] in lightning_pipe/runtime/engine.py). 2 CPU ranks, 1F1B, the recipe's GPT (4 blocks,
width 128, vocab 256, 8 rows per batch in 4 micro-batches).

One run whose sequence length changes every ``--block`` batches (L1, L1, L1, L2, L2, L2, L1, ...): the first batch
of each block re-infers, the others reuse the buffers. Interleaving keeps a loaded machine's drift out of the
comparison. Re-inference cost per new shape = median step time of first-of-block batches - median of the others
(each side averaged over the two lengths); also as a share of a step.

    python bench/reinference.py [--steps 60] [--block 3] [--lengths 64 96]

Last line: ``reinference_ms=<x> reinference_share=<x>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402


def _fit(lengths: list[int], steps: int) -> tuple[list[float], int]:
    """Step times (s) and the forward shape inferences this rank ran."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PipelineStrategy
    from recipes.gpt.model import GPT

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, *a: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *a: object) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.inferences = trainer.strategy.engine.shape_inferences

    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(steps):
        tokens = torch.randint(0, 256, (8, lengths[i] + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
    clock = Clock()
    trainer = L.Trainer(strategy=PipelineStrategy(schedule="1f1b", microbatches=4), accelerator="cpu", devices=2,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[clock])
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    return clock.times, clock.inferences


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    lengths = [args.lengths[(i // args.block) % 2] for i in range(args.steps)]
    times, inferences = _fit(lengths, args.steps)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"lengths": lengths, "times": times, "inferences": inferences}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs=2, default=[64, 96])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    run = run_ranks(__file__, 2, ["--steps", str(args.steps), "--block", str(args.block),
                                  "--lengths", *map(str, args.lengths)])
    new, known = [], []
    for length in args.lengths:
        firsts = [t for i, t in enumerate(run["times"]) if i >= args.block and i % args.block == 0
                  and run["lengths"][i] == length]
        others = [t for i, t in enumerate(run["times"]) if i >= args.block and i % args.block != 0
                  and run["lengths"][i] == length]
        new.append(statistics.median(firsts))
        known.append(statistics.median(others))
        print(f"length {length:4d}: median step {known[-1] * 1e3:7.1f} ms with known shapes, {new[-1] * 1e3:7.1f} ms "
              f"on a new shape ({len(firsts)} / {len(others)} steps)")
    print(f"shape inferences on rank 0: {run['inferences']} over {args.steps} steps")
    cost, step = statistics.mean(new) - statistics.mean(known), statistics.mean(known)
    print(f"reinference_ms={cost * 1e3:.1f} reinference_share={cost / step:.2f}")


if __name__ == "__main__":
    main()
