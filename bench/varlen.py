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
the planner's boundary-message exchanges and meta forwards, and the first sight's cost. Figures: ``ratio_b``,
``ratio_c``, ``ratio_d``, ``reinferences_after_first``.

Where shapes cannot be planned (torch 2.11, FSDP or tensor-parallel stages, PipeDream / PipeMare / Chimera: torch
re-infers its buffers for every new shape signature, [Note: re-inference on a new shape]), a second run measures what
a new shape costs: the same model under ``--reinference-schedule`` (default ``pipedream``), the sequence length
changing every ``--block`` batches (64, 64, 64, 96, 96, 96, ...); cost = median step of the first batch of a block -
median of the others (each averaged over the two lengths). Figures ``reinference_ms`` and ``reinference_share`` (of a
step); ``--reinference-steps 0`` skips it.

    python -m bench varlen [--rounds 12] [--reinference-steps 36] [--block 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.common import Benchmark, Outcome, run_ranks, trainer, write_result

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

        def on_train_batch_end(self, trainer: Any, *a: object) -> None:
            self.times.append(time.perf_counter() - self.start)
            engine = trainer.strategy.engine
            self.inferences.append(engine.shape_inferences)
            self.planner = engine.shapes.planner  # the engine is gone after fit

    torch.manual_seed(0)
    model = VarlenGPT(vocab_size=256, block_size=LENGTHS[-1], n_layer=4, n_head=4, n_embd=128)
    clock = Clock()
    trainer(PipelineStrategy(schedule="1f1b", microbatches=MICROBATCHES), len(batches), [clock]).fit(
        model, torch.utils.data.DataLoader([(x, y) for _, x, y, _ in batches], batch_size=None))
    planner: Any = clock.planner
    return {"cases": [c for c, *_ in batches], "tokens": [n for *_, n in batches], "times": clock.times,
            "inferences": clock.inferences,
            "exchanges": planner.exchanges if planner is not None else None,
            "meta_forwards": planner.meta_forwards if planner is not None else None}


def _reinference(args: argparse.Namespace) -> dict[str, Any]:
    """Step times of the alternating-length run under a schedule whose shapes torch re-infers."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from bench.common import gpt
    from lightning_pipe import PipelineStrategy

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0
            self.inferences = 0

        def on_train_batch_start(self, *a: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *a: object) -> None:
            self.times.append(time.perf_counter() - self.start)
            self.inferences = trainer.strategy.engine.shape_inferences

    lengths = [args.lengths[(i // args.block) % 2] for i in range(args.reinference_steps)]
    g = torch.Generator().manual_seed(0)
    batches = []
    for length in lengths:
        tokens = torch.randint(0, 256, (ROWS, length + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    clock = Clock()
    strategy = PipelineStrategy(schedule=args.reinference_schedule, microbatches=MICROBATCHES)
    trainer(strategy, len(batches), [clock]).fit(gpt(n_layer=4, n_embd=128, block_size=max(args.lengths)),
                                                 torch.utils.data.DataLoader(batches, batch_size=None))
    return {"lengths": lengths, "times": clock.times, "inferences": clock.inferences}


def worker(args: argparse.Namespace) -> None:
    result = _fit(args.rounds)
    if args.reinference_steps:
        result["reinference"] = _reinference(args)
    write_result(args, result)


def reinference_cost(args: argparse.Namespace, run: dict[str, Any]) -> tuple[list[str], dict[str, float]]:
    lines, new, known = [], [], []
    for length in args.lengths:
        steps = [i for i in range(args.block, len(run["times"])) if run["lengths"][i] == length]
        firsts = [run["times"][i] for i in steps if i % args.block == 0]
        others = [run["times"][i] for i in steps if i % args.block != 0]
        new.append(statistics.median(firsts))
        known.append(statistics.median(others))
        lines.append(f"{args.reinference_schedule}, length {length}: median step {known[-1] * 1e3:.1f} ms with known "
                     f"shapes, {new[-1] * 1e3:.1f} ms on a new shape ({len(firsts)} / {len(others)} steps)")
    lines.append(f"shape inferences on rank 0: {run['inferences']} over {len(run['times'])} steps")
    cost, step = statistics.mean(new) - statistics.mean(known), statistics.mean(known)
    return lines, {"reinference_ms": cost * 1e3, "reinference_share": cost / step}


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--reinference-steps", type=int, default=36, help="0: skip the re-inference run")
    p.add_argument("--reinference-schedule", default="pipedream", help="a schedule whose shapes cannot be planned")
    p.add_argument("--block", type=int, default=3, help="batches per length in the re-inference run")
    p.add_argument("--lengths", type=int, nargs=2, default=[64, 96])


def run(args: argparse.Namespace) -> Outcome:
    res = run_ranks("varlen", 2, args)
    per_token: dict[str, float] = {}
    reinferences: dict[str, int] = {}
    inferences = [0, *res["inferences"]]
    times, cases = res["times"], res["cases"]
    for case in CASES:
        steps = [i for i, c in enumerate(cases) if c == case and i >= WARMUP]
        per_token[case] = statistics.median(times[i] / res["tokens"][i] for i in steps)
        reinferences[case] = sum(inferences[i + 1] - inferences[i] for i in steps)
    lines = [f"({case}) {per_token[case] * 1e6:7.2f} us/token  ratio {per_token[case] / per_token['a']:.3f}  "
             f"shape inferences after the first sight: {reinferences[case]}" for case in CASES]
    seen = statistics.median(times[i] / res["tokens"][i] for i in range(WARMUP, len(cases)) if cases[i] == "b")
    first = statistics.median(times[i] / res["tokens"][i] for i in range(2, 1 + len(LENGTHS)))
    lines.append(f"first sight of a length (b, meta forwards): {first / seen:.2f}x a step of a known one; torch's "
                 f"shape inferences in the whole run: {res['inferences'][-1]} (the first batch's)")
    lines.append(f"planner: {res['exchanges']} boundary exchanges, {res['meta_forwards']} meta forwards "
                 f"over {len(cases)} batches (rank 0)")
    figures: dict[str, float] = {f"ratio_{c}": per_token[c] / per_token["a"] for c in "bcd"}
    figures["reinferences_after_first"] = sum(reinferences.values())
    if "reinference" in res:
        more, costs = reinference_cost(args, res["reinference"])
        lines += more
        figures.update(costs)
    return Outcome("\n".join(lines), figures)


BENCHMARK = Benchmark(
    "varlen", "variable lengths: a new length every batch or every micro-batch and packed rows against a fixed "
    "length (per token), and what a new shape costs where shapes are re-inferred", run, arguments, worker,
    quick=("--rounds", "4", "--reinference-steps", "12"))
