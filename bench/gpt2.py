"""A model of real size on CPU: GPT-2 small's shapes (12 blocks of width 768, 12 heads; the byte vocabulary of 256
tokens, whose head is small next to the blocks, instead of GPT-2's 50,257), sequence 256, 2 ranks of one thread.

For 1F1B and interleaved 1F1B (2 stages per rank) at m = 4 and 8 micro-batches of ``--rows`` sequences each, three
ways train the same batches, interleaved in rounds (:func:`bench.common.interleave`; each way's fastest step after a
warm-up step: contention only adds time):

* ``single``: the same model on one process (one thread; the other rank waits), gradient accumulation over the same
  m micro-batches, then the optimizer step;
* ``hand``: a hand-written ``torch.distributed.pipelining`` loop over the same split (blocks balanced, the
  embedding with the first stage, norm and head with the last), torch's schedule, the tied weight's all-reduce;
* ``strategy``: ``Trainer(strategy=PipelineStrategy(...))`` with that split.

All three run the recipe's AdamW with its warm-up + cosine schedule. Printed per configuration: tokens/s, the
strategy over the hand-written loop (goal: within 1 %), the speed-up over one process against the schedule's
bound, and peak memory per rank against the planner's prediction (goal: within 10 %).

The bound: with p ranks, v stages per rank and balanced stages, a step's schedule takes ``(m + (p - 1) / v)`` stage
slots where one process takes ``p * m`` (1F1B: ``v = 1``), so the speed-up over one process is at most
``p * m / (m + (p - 1) / v)`` — for 1F1B ``p * m / (m + p - 1)``: 1.6 at m = 4, 1.78 at m = 8 (p = 2); interleaved
1.78 and 1.88. Communication and the unbalanced embedding and head keep a real step above it; the optimizer step,
which each rank runs over half the weights, brings it a little closer.

Memory is what the step's tensors hold on a rank: its parameters, their gradients, the optimizer's state (counted
after a step) and the peak of the activations autograd saves for the backward (``ActivationMeter``, on the first
round's warm-up step only, so it costs no timed step); the prediction is the planner's
(``lightning_pipe.planner``: a profile of the model's layers at the micro-batch size, the schedule's replay).
Process memory (RSS) is not compared: the interpreter, the libraries and the other two ways' models are in it.

    python -m bench gpt2 [--rounds 2] [--steps 2] [--rows 1] [--configs 1f1b:4,1f1b:8,interleaved_1f1b:4,...]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import (
    Benchmark,
    Outcome,
    balanced_split,
    gather,
    gpt,
    interleave,
    least_disturbed,
    run_ranks,
    step_clock,
    token_batches,
    trainer,
    write_result,
)

BLOCKS, WIDTH, HEADS, VOCAB = 12, 768, 12, 256
WAYS = ("single", "hand", "strategy")


def _model(args: argparse.Namespace) -> Any:
    return gpt(n_layer=BLOCKS, n_embd=WIDTH, block_size=args.seq, n_head=HEADS, vocab_size=VOCAB,
               max_steps=10_000)


def _data(args: argparse.Namespace, m: int) -> Any:
    batch = m * args.rows
    return token_batches(batch * (args.steps + 1), args.seq, batch)


def _optimizer(model: Any, module: Any) -> tuple[Any, Any]:
    from recipes.gpt.model import adamw_with_warmup_cosine

    hp = model.hparams
    optim = adamw_with_warmup_cosine(module, hp.lr, hp.weight_decay, hp.betas, hp.warmup_steps, hp.max_steps)
    return optim["optimizer"], optim["lr_scheduler"]["scheduler"]


def timed_loop(step: Any, data: Any) -> list[float]:
    """Each step's time, data loading included, after the first (warm-up) step."""
    times, last = [], None
    for x, y in data:
        step(x, y)
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times


def single(args: argparse.Namespace, m: int) -> list[float]:
    """One process: m micro-batches' forward and backward, then the optimizer step."""
    model = _model(args)
    opt, sched = _optimizer(model, model)

    def step(x: Any, y: Any) -> None:
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (model.loss_fn(model.layers(xs), ys) / m).backward()
        opt.step()
        sched.step()

    return timed_loop(step, _data(args, m))


def hand(args: argparse.Namespace, schedule: str, v: int, m: int, counts: list[int]) -> list[float]:
    """torch.distributed.pipelining as a user writes it: this rank's stages of the split, torch's schedule, the
    tied weight's gradient summed over the two ranks that hold it, the optimizer over this rank's layers."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args)
    layers, starts = list(model.layers), [sum(counts[:i]) for i in range(len(counts) + 1)]
    ids = [rank + k * world for k in range(v)]
    mods = [nn.Sequential(*layers[starts[s]:starts[s + 1]]) for s in ids]
    stages = [PipelineStage(mod, s, world * v, torch.device("cpu")) for mod, s in zip(mods, ids)]

    def loss_fn(out: Any, tgt: Any) -> Any:
        return model.loss_fn(out, tgt) / m

    sched_cls = Schedule1F1B if v == 1 else ScheduleInterleaved1F1B
    pipe = sched_cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    opt, lr = _optimizer(model, nn.ModuleList(mods))
    tied = model.layers[0].wte.weight  # the embedding (first stage, rank 0) and the head (last stage, rank 1)

    def step(x: Any, y: Any) -> None:
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=[])
        dist.all_reduce(tied.grad)
        opt.step()
        lr.step()

    return timed_loop(step, _data(args, m))


def strategy(args: argparse.Namespace, schedule: str, v: int, m: int, counts: list[int],
             memory: dict[str, Any] | None) -> list[float]:
    """The strategy; with ``memory`` (a dict), its first step's peak tensor bytes on this rank are written there."""
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PipelineStrategy
    from lightning_pipe.trace.memory import ActivationMeter

    class Meter(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            engine = trainer.strategy.engine
            self.meter = ActivationMeter.attach(engine)
            self.remove = lambda: engine.step_contexts.remove(self.meter.measure)

        def on_train_batch_end(self, trainer: Any, *unused: Any) -> None:
            if memory is not None and "activations" not in memory:
                self.remove()
                memory.update(activations=self.meter.peak_bytes, static=static_bytes(trainer))

    clock = step_clock()
    pipeline = PipelineStrategy(schedule, microbatches=m, stages_per_rank=v, partition=counts)
    trainer(pipeline, args.steps + 1, [clock, Meter()]).fit(_model(args), _data(args, m))
    return clock.durations(1)


def static_bytes(trainer: Any) -> int:
    """This rank's parameters, their gradients and the optimizer's state, in bytes."""
    params = trainer.strategy.engine.parameters
    state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values() if hasattr(t, "nbytes")]
    grads = [p.grad for p in params if p.grad is not None]
    return sum(t.nbytes for t in [*params, *grads, *state])


def predicted_memory(args: argparse.Namespace, schedule: str, v: int, m: int, counts: list[int]) -> list[int]:
    """The planner's peak memory per rank for this layout (a profile of the layers at the micro-batch size)."""
    import torch

    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.planner import profile_model
    from lightning_pipe.planner.model import CostModel, predict
    from lightning_pipe.schedules import compute_order, plan_schedule
    from lightning_pipe.schedules.simulate import compile_order

    tokens = torch.randint(0, VOCAB, (args.rows, args.seq + 1), generator=torch.Generator().manual_seed(0))
    profile = profile_model(_model(args), (tokens[:, :-1], tokens[:, 1:]), [args.rows], repeats=1, passes=1)
    plan = plan_schedule(PipelineConfig(schedule=schedule, microbatches=m, stages_per_rank=v), 2)
    compiled = compile_order(compute_order(plan), plan.num_stages)
    return list(predict(CostModel(profile, args.rows, [1.0, 1.0]), compiled, counts, 1).peak_memory)


def measure(args: argparse.Namespace, schedule: str, m: int) -> dict[str, Any]:
    """One configuration: the three ways in interleaved rounds, the memory measured and predicted."""
    import torch.distributed as dist

    rank, v = dist.get_rank(), 2 if schedule == "interleaved_1f1b" else 1
    counts = balanced_split(BLOCKS, 2 * v)
    memory: dict[str, Any] = {}

    def run(way: str) -> list[float]:
        if way == "single":
            times = single(args, m) if rank == 0 else []
        elif way == "hand":
            times = hand(args, schedule, v, m, counts)
        else:
            times = strategy(args, schedule, v, m, counts, memory)
        dist.barrier()
        return times

    times = interleave(WAYS, args.rounds, run)
    predicted = predicted_memory(args, schedule, v, m, counts) if rank == 0 else []
    dist.barrier()
    return {"schedule": schedule, "v": v, "m": m, "counts": counts, "times": times, "predicted": predicted,
            "memory": gather(memory)}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = [measure(args, item.split(":")[0], int(item.split(":")[1])) for item in args.configs.split(",")]
    write_result(args, results)
    dist.destroy_process_group()


def bound(m: int, v: int, p: int = 2) -> float:
    """The schedule's speed-up over one process with balanced stages and free communication (module docstring)."""
    return p * m / (m + (p - 1) / v)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="1f1b:4,1f1b:8,interleaved_1f1b:4,interleaved_1f1b:8",
                   help="schedule:microbatches, ...")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed steps of each way per round (after one warm-up step)")
    p.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=256)


def run(args: argparse.Namespace) -> Outcome:
    results = run_ranks("gpt2", 2, args, timeout=7200)
    lines = ["| schedule | m | tokens/s: one process | hand-written | strategy | strategy / hand-written | speed-up "
             "(strategy / one process) | bound | speed-up / bound | peak MiB per rank: measured | planner | error |",
             "|---" * 12 + "|"]
    figures: dict[str, float] = {}
    for r in results:
        tokens = r["m"] * args.rows * args.seq
        speed = {way: tokens / least_disturbed([t for rnd in r["times"][way] for t in rnd]) for way in WAYS}
        measured = [mem["static"] + mem["activations"] for mem in r["memory"]]
        errors = [(p - q) / q for p, q in zip(r["predicted"], measured)]
        theory = bound(r["m"], r["v"])
        name = f"{'interleaved' if r['v'] > 1 else '1f1b'}_m{r['m']}"
        figures[f"{name}_vs_hand"] = speed["strategy"] / speed["hand"]
        figures[f"{name}_speedup_vs_bound"] = speed["strategy"] / speed["single"] / theory
        figures[f"{name}_memory_error_max"] = max(abs(e) for e in errors)
        lines.append(f"| {r['schedule']} | {r['m']} | {speed['single']:.0f} | {speed['hand']:.0f} | "
                     f"{speed['strategy']:.0f} | {figures[f'{name}_vs_hand']:.3f} | "
                     f"{speed['strategy'] / speed['single']:.2f} | {theory:.2f} | "
                     f"{figures[f'{name}_speedup_vs_bound']:.3f} | "
                     f"{', '.join(f'{b / 2**20:.0f}' for b in measured)} | "
                     f"{', '.join(f'{b / 2**20:.0f}' for b in r['predicted'])} | "
                     f"{', '.join(f'{e:+.1%}' for e in errors)} |")
    lines.append(f"GPT {BLOCKS} blocks x {WIDTH}, {HEADS} heads, vocabulary {VOCAB}, sequence {args.seq}, "
                 f"{args.rows} sequence(s) per micro-batch, 2 CPU ranks x 1 thread; splits "
                 + "; ".join(f"{r['schedule']}: {r['counts']}" for r in results)
                 + f"; fastest of {args.rounds} rounds x {args.steps} steps per way")
    figures["strategy_vs_hand_min"] = min(v for k, v in figures.items() if k.endswith("_vs_hand"))
    figures["speedup_vs_bound_min"] = min(v for k, v in figures.items() if k.endswith("_speedup_vs_bound"))
    figures["memory_error_max"] = max(v for k, v in figures.items() if k.endswith("_memory_error_max"))
    return Outcome("\n".join(lines), figures)


BENCHMARK = Benchmark(
    "gpt2", "GPT-2 small's shapes on 2 CPU ranks (1F1B, interleaved; m = 4, 8): the strategy against one process "
    "and a hand-written torch loop, speed-up against the schedule's bound, memory against the planner", run,
    arguments, worker, quick=("--configs", "1f1b:4", "--rounds", "1", "--steps", "1", "--seq", "32"))
