"""Overhead of the Lightning strategy over a hand-written torch.distributed.pipelining loop.

Same GPT-like model (recipes/gpt), same schedule, micro-batch count, optimizer and data, 2 ranks on CPU, one
invocation. The two sides alternate step by step (:func:`paired`): a Trainer with the strategy trains, and after
each of its batches a callback runs one hand-written step on the same batch. A strategy step is the time from the end
of that callback to the next batch's end (data loading, Lightning's loop, schedule, gradient sync, optimizer step —
everything a step costs), a hand-written step the callback's own step, which takes the batch from a DataLoader of its
own over the same data (a loop's data loading is part of its step on both sides, as in :func:`hand_written`). Each
side's median over ``--rounds`` fresh Trainers; last line: ``overhead_ratio=<strategy / hand-written>``.

Each strategy round is followed by a round of the *Lightning floor* (``--floor``): the same hand-written step as the
``training_step`` of a plain LightningModule in a stock Trainer, paired the same way, with automatic optimization
(``auto``, the default: the path a strategy user's module takes) or manual (``manual``; ``both``; ``none``).
``lightning_floor_ratio_<kind>=`` is what Lightning's loop alone costs around torch's pipeline, the bound no
strategy can go below; the strategy over the floor is what this library adds.

Figures: ``overhead_ratio`` (strategy / hand-written), ``lightning_floor_ratio_<kind>`` (floor / hand-written, each
against the hand-written steps of its own rounds), ``strategy_over_floor_<kind>``, and ``noise_floor`` (the
hand-written steps of the strategy's rounds disagreeing with themselves: ratios closer to 1 are not resolved).

``--instructions`` counts instead of timing: the instructions per training step of the three loops, every rank
under valgrind's callgrind (bench/_overhead_counts.py); figures ``instructions_overhead_ratio`` (strategy /
hand-written) and ``instructions_over_floor`` (strategy / the floor), the same on any machine at any load.

    python -m bench overhead [--steps 30] [--rounds 3] [--schedule 1f1b] [--microbatches 4] [--floor auto]
    python -m bench overhead --instructions [--count-steps 3] [--warmup 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench import _overhead_counts
from bench.common import (
    Benchmark,
    Outcome,
    gpt,
    noise_floor,
    paired_ratio,
    run_ranks,
    step_clock,
    token_batches,
    trainer,
    write_result,
)


def _model() -> Any:
    return gpt(n_layer=4, n_embd=128, block_size=64)


def _data(args: argparse.Namespace) -> Any:
    return token_batches(args.batch * (args.steps + args.warmup), 64, args.batch)


class HandWritten:
    """What a user would write with torch alone: split, stage, schedule, tied-grad all-reduce, the recipe's
    optimizer and learning-rate schedule."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from recipes.gpt.model import adamw_with_warmup_cosine

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model = _model()
        layers = list(model.layers)
        per = [len(layers) // self.world + (1 if r < len(layers) % self.world else 0) for r in range(self.world)]
        start = sum(per[:self.rank])
        stage_mod = nn.Sequential(*layers[start:start + per[self.rank]])
        stage = PipelineStage(stage_mod, self.rank, self.world, torch.device("cpu"))
        scale = 1.0 / args.microbatches

        def loss_fn(out, tgt):
            return model.loss_fn(out, tgt) * scale

        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.schedule]
        self.schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=loss_fn, scale_grads=False)
        self.stage_mod = stage_mod
        # the recipe's own optimizer over this rank's layers, as the strategy's run builds it from the module's
        # configure_optimizers: AdamW with decay on matrices only, and its warm-up + cosine schedule stepped per step
        hp = model.hparams
        optim = adamw_with_warmup_cosine(stage_mod, hp.lr, hp.weight_decay, hp.betas, hp.warmup_steps, hp.max_steps)
        self.opt, self.sched = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
        self.tied = model.layers[0].wte.weight  # held by the first and the last rank

    def run(self, x, y) -> None:
        """The schedule's forward and backward over the batch and the tied weight's gradient sum (no optimizer)."""
        import torch.distributed as dist

        if self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.world - 1:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
        if self.tied.grad is not None:
            dist.all_reduce(self.tied.grad)

    def step(self, x, y, opt: Any = None) -> None:
        """One training step; ``opt`` steps in place of the raw optimizer (Lightning's wrapper in the floor)."""
        opt = self.opt if opt is None else opt
        opt.zero_grad(set_to_none=True)
        self.run(x, y)
        opt.step()
        self.sched.step()


def hand_written(args: argparse.Namespace, on_step: Callable[[int], None] | None = None) -> list[float]:
    """The hand-written loop on its own; ``on_step(n)`` runs after the n-th step (bench/breakdown.py reads its
    probes there)."""
    loop = HandWritten(args)
    times, last = [], None
    for x, y in _data(args):
        loop.step(x, y)
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        if on_step is not None:
            on_step(len(times) + 1)
    return times[args.warmup - 1:]


def _trainer(args: argparse.Namespace, callback: Any, stock: bool = False) -> Any:
    """The strategy's Trainer, or with ``stock`` Lightning's own single-device strategy in each rank process (the
    Lightning floor: :class:`LightningFloor` brings its own process group and pipeline)."""
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_pipe import PipelineStrategy

    strategy = (SingleDeviceStrategy(torch.device("cpu")) if stock
                else PipelineStrategy(schedule=args.schedule, microbatches=args.microbatches))
    # the same batches, in the same order, as the hand-written loop
    return trainer(strategy, args.steps + args.warmup, [callback], devices=1 if stock else None)


def through_lightning(args: argparse.Namespace, on_step: Callable[[int], None] | None = None) -> list[float]:
    """The strategy on its own (bench/breakdown.py)."""
    clock = step_clock(on_step)
    _trainer(args, clock).fit(_model(), _data(args))
    return clock.durations(args.warmup)


def _floor_module(args: argparse.Namespace, kind: str) -> Any:
    """The Lightning floor: :class:`HandWritten`'s step as the ``training_step`` of a plain LightningModule, what a
    user who hand-writes torch's pipeline inside Lightning runs. Against the hand-written loop it costs what
    Lightning's loop costs around the same step; no strategy can go below it.

    ``manual``: manual optimization (Lightning's optimizer wrapper steps). ``auto``: automatic optimization, the
    path a strategy user's module takes (Lightning's closure, its zero_grad, backward and optimizer-step hooks): the
    schedule's gradients are held across Lightning's zero_grad, which runs between ``training_step`` and
    ``backward``, and put back in the ``backward`` hook, as the strategy does ([Note: gradients across Lightning's
    zero_grad] in lightning_pipe/runtime/engine.py)."""
    import lightning.pytorch as L
    import torch

    class LightningFloor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = kind == "auto"
            self.hand = HandWritten(args)
            self.stage = self.hand.stage_mod  # registered, as a user's module holds its layers
            self.held: list[Any] = []
            self.done = torch.zeros((), requires_grad=True)  # what training_step returns: the step already ran

        def configure_optimizers(self) -> Any:
            if not self.automatic_optimization:  # the manual step steps the schedule itself (HandWritten.step)
                return self.hand.opt
            return {"optimizer": self.hand.opt, "lr_scheduler": {"scheduler": self.hand.sched, "interval": "step"}}

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if not self.automatic_optimization:
                # Lightning's wrapper steps the optimizer, as in a user's manual step (it counts the step)
                self.hand.step(*batch, opt=self.optimizers())
                return None
            params = list(self.stage.parameters())
            for p in params:
                p.grad = None
            self.hand.run(*batch)
            self.held = [p.grad for p in params]
            return self.done

        def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
            for p, g in zip(self.stage.parameters(), self.held):
                p.grad = g

    return LightningFloor()


def paired(args: argparse.Namespace, floor: str | None = None) -> tuple[list[float], list[float]]:
    """(Trainer steps, hand-written steps), alternating step by step: after each training batch of the Trainer, a
    callback runs one hand-written step on the same batch. A slow phase of the machine (seconds long on a shared
    VM) then slows both sides of a pair alike, where blocks of steps per side would charge it to one. The Trainer
    runs the strategy, or with ``floor`` (``"auto"`` / ``"manual"``) the hand-written step in a stock Trainer
    (:func:`_floor_module`)."""
    from lightning.pytorch.callbacks import Callback

    hand = HandWritten(args)
    hand_batches = iter(_data(args))

    class Pairs(Callback):
        def __init__(self) -> None:
            self.light: list[float] = []
            self.hand: list[float] = []
            self.last: float | None = None

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            start = time.perf_counter()
            if self.last is not None:
                self.light.append(start - self.last)
            hand.step(*next(hand_batches))  # the same batch, from its own loader: a user's loop fetches its data too
            self.last = time.perf_counter()
            self.hand.append(self.last - start)

    pairs = Pairs()
    module = _floor_module(args, floor) if floor else _model()
    _trainer(args, pairs, stock=floor is not None).fit(module, _data(args))
    skip = args.warmup - 1
    return pairs.light[skip:], pairs.hand[skip + 1:]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if args.instructions:
        return _overhead_counts.worker(args, HandWritten, _floor_module, _trainer, _model, _data)

    floors = {"both": ["auto", "manual"], "none": []}.get(args.floor, [args.floor])
    results: dict[str, list[float]] = {"hand": [], "lightning": []}
    for kind in floors:
        results[kind], results[f"{kind}_hand"] = [], []
    dist.init_process_group("gloo")
    for _ in range(args.rounds):  # the strategy's and the floors' rounds alternate
        light, hand = paired(args)
        results["lightning"] += light
        results["hand"] += hand
        dist.barrier()
        for kind in floors:
            light, hand = paired(args, floor=kind)
            results[kind] += light
            results[f"{kind}_hand"] += hand
            dist.barrier()
    write_result(args, results)
    dist.destroy_process_group()  # its last collective holds no tensor (cf. bench/breakdown.py's exit)


def add_run_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The run's settings (model size, schedule, steps), shared with bench/breakdown.py, which times the same two
    runs."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])


def arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p, steps=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--floor", default="auto", choices=["auto", "manual", "both", "none"],
                   help="the Lightning floor's rounds: automatic optimization (the strategy's path), manual, both, none")
    p.add_argument("--instructions", action="store_true", help="count instructions per step with callgrind instead")
    p.add_argument("--count-steps", type=int, default=2, help="--instructions: steps in each of the two windows")
    p.add_argument("--native-kernels", action="store_true",
                   help="--instructions: MKL's kernels for this CPU (AVX2: ~25x slower under valgrind) instead of SSE4.2")


def run(args: argparse.Namespace) -> Outcome:
    if args.instructions:
        return _overhead_counts.count(args)
    times = run_ranks("overhead", 2, args)
    hand, light = statistics.median(times["hand"]), statistics.median(times["lightning"])
    lines = ["| path | median step (ms) | steps timed |", "|---|---|---|",
             f"| hand-written torch.distributed.pipelining | {hand * 1e3:.1f} | {len(times['hand'])} |",
             f"| Trainer(strategy=PipelineStrategy) | {light * 1e3:.1f} | {len(times['lightning'])} |"]
    figures: dict[str, float] = {}
    for kind in ("auto", "manual"):
        if kind not in times:
            continue
        floor, floor_hand = statistics.median(times[kind]), statistics.median(times[f"{kind}_hand"])
        lines += [f"| Lightning floor ({kind} optimization): the hand-written step in a stock Trainer | "
                  f"{floor * 1e3:.1f} | {len(times[kind])} |",
                  f"| hand-written, paired with that floor's rounds | {floor_hand * 1e3:.1f} | "
                  f"{len(times[f'{kind}_hand'])} |"]
        figures[f"lightning_floor_ratio_{kind}"] = floor / floor_hand
        figures[f"strategy_over_floor_{kind}"] = (light / hand) / (floor / floor_hand)
    lines.append(f"schedule={args.schedule} microbatches={args.microbatches} ranks=2 batch={args.batch} "
                 f"rounds={args.rounds}; median of the per-step ratios {paired_ratio(times['lightning'], times['hand']):.3f}")
    figures["noise_floor"] = noise_floor(times["hand"])
    figures["overhead_ratio"] = light / hand
    return Outcome("\n".join(lines), figures)


BENCHMARK = Benchmark(
    "overhead", "the strategy's training step against a hand-written torch.distributed.pipelining loop and the "
    "Lightning floor (GPT, 1F1B, m = 4, 2 ranks)", run, arguments, worker, quick=("--steps", "15", "--rounds", "2"))
