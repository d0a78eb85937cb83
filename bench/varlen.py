"""What variable lengths cost now ([Note: shapes without re-inference] in lightning_pipe/runtime/shapes.py): 2 CPU
ranks, 1F1B, the recipe's GPT (4 blocks, width 128, vocab 256), 8 rows per batch in 4 micro-batches, the same
tokens per step on average, a token-weighted (sum, count) loss. One run, the cases interleaved batch by batch (a
loaded machine's drift falls on every case alike):

(a) fixed length 96;
(b) a new length every batch (uniform in 64..128: dynamic padding);
(c) a different length per micro-batch (each batch padded to 128, sorted by length; each micro-batch trimmed to its
    own length by the module's ``trim_microbatch``);
(d) packed: fixed shape 96, documents back to back (for the runtime a fixed shape, like (a)).

Printed per case: median step time per processed token relative to (a), torch's shape inferences after the first
batch, the planner's boundary-message exchanges and meta forwards.

    python bench/varlen.py [--rounds 12]

Last line: ``ratio_b=<x> ratio_c=<x> ratio_d=<x> reinferences_after_first=<n>``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402

CASES = ("a", "b", "c", "d")
ROWS, MICROBATCHES, LENGTH, LOW, HIGH = 8, 4, 96, 64, 128


def _batches(rounds: int) -> list[tuple[str, object, object, int]]:
    """(case, tokens, labels, processed tokens) per batch, the cases interleaved."""
    import torch

    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rounds):
        for case in CASES:
            if case in "ad":
                tokens = torch.randint(0, 256, (ROWS, LENGTH + 1), generator=g)
                x, y, processed = tokens[:, :-1], tokens[:, 1:].clone(), ROWS * LENGTH
            elif case == "b":
                length = rng.randint(LOW, HIGH)
                tokens = torch.randint(0, 256, (ROWS, length + 1), generator=g)
                x, y, processed = tokens[:, :-1], tokens[:, 1:].clone(), ROWS * length
            else:  # rows sorted by length, each micro-batch's two rows of one length, padded to HIGH
                per_mb = sorted(rng.randint(LOW, HIGH) for _ in range(MICROBATCHES))
                x = torch.zeros(ROWS, HIGH, dtype=torch.long)
                y = torch.full((ROWS, HIGH), -100, dtype=torch.long)
                rows_per_mb = ROWS // MICROBATCHES
                for mb, length in enumerate(per_mb):
                    tokens = torch.randint(0, 256, (rows_per_mb, length + 1), generator=g)
                    rows = slice(mb * rows_per_mb, (mb + 1) * rows_per_mb)
                    x[rows, :length], y[rows, :length] = tokens[:, :-1], tokens[:, 1:]
                processed = rows_per_mb * sum(per_mb)
            out.append((case, x.contiguous(), y.contiguous(), processed))
    return out


def _fit(rounds: int) -> dict[str, object]:
    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PipelineStrategy
    from recipes.gpt.model import GPT

    class VarlenGPT(GPT):
        def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            flat = target.reshape(-1)
            return F.cross_entropy(output.reshape(-1, output.size(-1)), flat, reduction="sum"), (flat != -100).sum()

        def trim_microbatch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            used = (y != -100).any(0).nonzero()
            length = int(used.max()) + 1 if used.numel() else 1
            return (x, y) if length == x.shape[1] else (x[:, :length], y[:, :length])

    batches = _batches(rounds)

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.inferences: list[int] = []
            self.planner: object = None
            self.start = 0.0

        def on_train_batch_start(self, *a: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *a: object) -> None:
            self.times.append(time.perf_counter() - self.start)
            engine = trainer.strategy.engine
            self.inferences.append(engine.shape_inferences)
            self.planner = engine.shapes.planner  # the engine is gone after fit

    torch.manual_seed(0)
    model = VarlenGPT(vocab_size=256, block_size=HIGH, n_layer=4, n_head=4, n_embd=128)
    clock = Clock()
    trainer = L.Trainer(strategy=PipelineStrategy(schedule="1f1b", microbatches=MICROBATCHES), accelerator="cpu",
                        devices=2, max_steps=len(batches), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[clock])
    trainer.fit(model, torch.utils.data.DataLoader([(x, y) for _, x, y, _ in batches], batch_size=None))
    planner: Any = clock.planner
    return {"cases": [c for c, *_ in batches], "tokens": [n for *_, n in batches], "times": clock.times,
            "inferences": clock.inferences,
            "exchanges": planner.exchanges if planner is not None else None,
            "meta_forwards": planner.meta_forwards if planner is not None else None}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    result = _fit(args.rounds)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    run = run_ranks(__file__, 2, ["--rounds", str(args.rounds)])
    per_token: dict[str, float] = {}
    reinferences: dict[str, int] = {}
    inferences = [0, *run["inferences"]]
    for case in CASES:
        steps = [i for i, c in enumerate(run["cases"]) if c == case and i >= len(CASES)]  # round 1: warm-up
        per_token[case] = statistics.median(run["times"][i] / run["tokens"][i] for i in steps)
        reinferences[case] = sum(inferences[i + 1] - inferences[i] for i, c in enumerate(run["cases"])
                                 if c == case and i > 0)
    for case in CASES:
        print(f"({case}) {per_token[case] * 1e6:7.2f} us/token  ratio {per_token[case] / per_token['a']:.3f}  "
              f"shape inferences after the first batch: {reinferences[case]}")
    print(f"planner: {run['exchanges']} boundary exchanges, {run['meta_forwards']} meta forwards "
          f"over {len(run['cases'])} batches (rank 0)")
    ratios = {c: per_token[c] / per_token["a"] for c in "bcd"}
    print(f"ratio_b={ratios['b']:.3f} ratio_c={ratios['c']:.3f} ratio_d={ratios['d']:.3f} "
          f"reinferences_after_first={sum(reinferences.values())}")


if __name__ == "__main__":
    main()
