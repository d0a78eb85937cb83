"""What variable lengths cost now ([Note: shapes without re-inference] in lightning_pipe/runtime/shapes.py): 2 CPU
ranks, 1F1B, the recipe's GPT (4 blocks, width 128, vocab 256), 8 rows per batch in 4 micro-batches, the same
tokens per step on average, a token-weighted (sum, count) loss. One run, the cases interleaved batch by batch (a
loaded machine's drift falls on every case alike):

(a) fixed length 96;
(b) a new length every batch (64..128 in steps of 8, mean 96: dynamic padding to a multiple of 8);
(c) a different length per micro-batch (each batch padded to 128, sorted by length; each micro-batch trimmed to its
    own length by the module's ``trim_microbatch``);
(d) packed: fixed shape 96, documents back to back (for the runtime a fixed shape, like (a)).

The run first sees every length once (what a first epoch pays: one meta forward per stage and new length), then
times the cases. Printed per case: median step time per processed token relative to (a), torch's shape inferences,
the planner's boundary-message exchanges and meta forwards, and the first sight's cost.

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
ROWS, MICROBATCHES, LENGTH = 8, 4, 96
LENGTHS = tuple(range(64, 129, 8))  # dynamic padding to a multiple of 8 (as transformers' pad_to_multiple_of)
WARMUP = 1 + len(LENGTHS) + 2  # the first sight of every length (not in the ratios)


def _batch(case: str, rng: random.Random, g: Any, length: int | None = None) -> tuple[str, Any, Any, int]:
    """(case, tokens, labels, processed tokens) of one batch."""
    import torch

    if case in "ad":
        tokens = torch.randint(0, 256, (ROWS, LENGTH + 1), generator=g)
        return case, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), ROWS * LENGTH
    if case == "b":
        length = length or rng.choice(LENGTHS)
        tokens = torch.randint(0, 256, (ROWS, length + 1), generator=g)
        return case, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), ROWS * length
    # (c): rows sorted by length, each micro-batch's rows of one length, the batch padded to the longest length
    per_mb = sorted(rng.choice(LENGTHS) for _ in range(MICROBATCHES))
    x = torch.zeros(ROWS, LENGTHS[-1], dtype=torch.long)
    y = torch.full((ROWS, LENGTHS[-1]), -100, dtype=torch.long)
    rows_per_mb = ROWS // MICROBATCHES
    for mb, mb_length in enumerate(per_mb):
        tokens = torch.randint(0, 256, (rows_per_mb, mb_length + 1), generator=g)
        rows = slice(mb * rows_per_mb, (mb + 1) * rows_per_mb)
        x[rows, :mb_length], y[rows, :mb_length] = tokens[:, :-1], tokens[:, 1:]
    return case, x, y, rows_per_mb * sum(per_mb)


def _batches(rounds: int) -> list[tuple[str, Any, Any, int]]:
    """A first sight of every length ((b) once per length, then (c) and (d)), then ``rounds`` rounds of the four
    cases interleaved."""
    import torch

    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    first = [_batch("a", rng, g)] + [_batch("b", rng, g, length) for length in LENGTHS] + [
        _batch("c", rng, g), _batch("d", rng, g)]
    return first + [_batch(case, rng, g) for _ in range(rounds) for case in CASES]


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
    model = VarlenGPT(vocab_size=256, block_size=LENGTHS[-1], n_layer=4, n_head=4, n_embd=128)
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
    times, cases = run["times"], run["cases"]
    for case in CASES:
        steps = [i for i, c in enumerate(cases) if c == case and i >= WARMUP]
        per_token[case] = statistics.median(times[i] / run["tokens"][i] for i in steps)
        reinferences[case] = sum(inferences[i + 1] - inferences[i] for i in steps)
    for case in CASES:
        print(f"({case}) {per_token[case] * 1e6:7.2f} us/token  ratio {per_token[case] / per_token['a']:.3f}  "
              f"shape inferences after the first sight: {reinferences[case]}")
    seen = statistics.median(times[i] / run["tokens"][i] for i in range(WARMUP, len(cases)) if cases[i] == "b")
    first = statistics.median(times[i] / run["tokens"][i] for i in range(2, 1 + len(LENGTHS)))
    print(f"first sight of a length (b, meta forwards): {first / seen:.2f}x a step of a known one; torch's shape "
          f"inferences in the whole run: {run['inferences'][-1]} (the first batch's)")
    print(f"planner: {run['exchanges']} boundary exchanges, {run['meta_forwards']} meta forwards "
          f"over {len(cases)} batches (rank 0)")
    ratios = {c: per_token[c] / per_token["a"] for c in "bcd"}
    print(f"ratio_b={ratios['b']:.3f} ratio_c={ratios['c']:.3f} ratio_d={ratios['d']:.3f} "
          f"reinferences_after_first={sum(reinferences.values())}")


if __name__ == "__main__":
    main()
