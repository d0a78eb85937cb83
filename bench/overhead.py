"""Overhead of the Lightning strategy over a hand-written torch.distributed.pipelining loop.

Same GPT-like model (recipes/gpt), same schedule, micro-batch count, optimizer and data, 2 ranks on CPU, one
invocation. Each side is timed as the median time between the ends of consecutive steps (data loading, schedule,
gradient sync of the tied weight, optimizer step — everything a step costs). The two sides alternate in rounds
to spread the machine's noise over both. Last line: ``overhead_ratio=<strategy / hand-written>``.

    python bench/overhead.py [--steps 30] [--rounds 2] [--schedule 1f1b] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402


def _model():
    import torch

    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, warmup_steps=5, max_steps=1000)


def _data(n: int, batch: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (n, 65), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, shuffle=False,
                      drop_last=True)


def hand_written(args: argparse.Namespace, on_step: Callable[[int], None] | None = None) -> list[float]:
    """What a user would write with torch alone: split, stage, schedule, tied-grad all-reduce, optimizer.
    ``on_step(n)`` runs after the n-th step (bench/breakdown.py reads its probes there)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    layers = list(model.layers)
    per = [len(layers) // world + (1 if r < len(layers) % world else 0) for r in range(world)]
    start = sum(per[:rank])
    stage_mod = nn.Sequential(*layers[start:start + per[rank]])
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    m = args.microbatches
    scale = 1.0 / m

    def loss_fn(out, tgt):
        return model.loss_fn(out, tgt) * scale

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.schedule]
    schedule = cls(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    params = list(stage_mod.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    tied = model.layers[0].wte.weight  # held by the first and the last rank
    times, last = [], None
    for x, y in _data(args.batch * (args.steps + args.warmup), args.batch):
        opt.zero_grad(set_to_none=True)
        losses: list = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if tied.grad is not None:
            dist.all_reduce(tied.grad)
        opt.step()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        if on_step is not None:
            on_step(len(times) + 1)
    return times[args.warmup - 1:]


def through_lightning(args: argparse.Namespace, on_step: Callable[[int], None] | None = None) -> list[float]:
    import lightning.pytorch as L

    from bench._timing import StepClock
    from lightning_pipe import PipelineStrategy

    clock = StepClock(on_step)
    trainer = L.Trainer(strategy=PipelineStrategy(schedule=args.schedule, microbatches=args.microbatches),
                        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        max_steps=args.steps + args.warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                        use_distributed_sampler=False)  # same batches, in the same order, as the hand-written loop
    trainer.fit(_model(), _data(args.batch * (args.steps + args.warmup), args.batch))
    return clock.durations(args.warmup)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    results: dict[str, list[float]] = {"hand": [], "lightning": []}
    for _ in range(args.rounds):
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        results["hand"] += hand_written(args)
        dist.barrier()
        results["lightning"] += through_lightning(args)
        dist.barrier()
    if int(os.environ["RANK"]) == 0:
        Path(args.out).write_text(json.dumps(results))


def add_run_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The run's settings (model size, schedule, steps) and the rank-process flags, shared with bench/breakdown.py,
    which times the same two runs."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, steps=30)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    times = run_ranks(__file__, 2, sys.argv[1:])
    hand, light = statistics.median(times["hand"]), statistics.median(times["lightning"])
    print("| path | median step (ms) | steps timed |\n|---|---|---|")
    print(f"| hand-written torch.distributed.pipelining | {hand * 1e3:.1f} | {len(times['hand'])} |")
    print(f"| Trainer(strategy=PipelineStrategy) | {light * 1e3:.1f} | {len(times['lightning'])} |")
    print(f"schedule={args.schedule} microbatches={args.microbatches} ranks=2 batch={args.batch}")
    print(f"overhead_ratio={light / hand:.3f}")


if __name__ == "__main__":
    main()
