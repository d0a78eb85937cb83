"""Dynamic rebalancing, measured in one run: the GPT recipe's model on 2 CPU ranks starts from a deliberately bad
split (the embedding and every block on rank 0, only the final norm and head on rank 1); after N steps the strategy
measures the layers, moves them (``rebalance_every_n_steps=N``) and training goes on. Prints the step times around
the move, the split chosen, and

    rebalance_speedup=<median step time before the rebalance / median step time after it>

Excluded from both medians: the first step (warm-up), the step that ran the move, and the first step after it
(torch infers the new stages' shapes).

    python -m bench rebalance [--layers 6] [--width 128] [--seq 64] [--batch 16] [--every 6]
"""

from __future__ import annotations

import argparse
import logging
import statistics

from bench.common import Benchmark, Outcome, gpt, run_ranks, step_clock, token_batches, trainer, write_result


def worker(args: argparse.Namespace) -> None:
    from lightning_pipe import PipelineStrategy

    steps = 2 * args.every - 1  # one decision, at step N
    model = gpt(n_layer=args.layers, n_embd=args.width, block_size=args.seq)
    n = len(model.layers)
    clock = step_clock()
    strategy = PipelineStrategy(schedule="1f1b", microbatches=args.microbatches, partition=[n - 2, 2],
                                rebalance_every_n_steps=args.every, rebalance_threshold=0.05)
    trainer(strategy, steps, [clock]).fit(model, token_batches(args.batch * steps, args.seq, args.batch))
    assert strategy.rebalancer is not None
    d = [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # d[k - 1]: batch k's time, k >= 1
    before = d[: args.every - 2]  # batches 1 .. N-2 (batch N-1 runs the move)
    after = d[args.every:]  # batches N+1 .. (batch N re-infers shapes)
    events = [{"step": e.step, "split": [list(e.decision.current), list(e.decision.proposed)],
               "gain": e.decision.gain, "moves": len(e.decision.moves)} for e in strategy.rebalancer.history]
    write_result(args, {"before": statistics.median(before), "after": statistics.median(after),
                        "move_step": d[args.every - 2], "events": events})


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--every", type=int, default=6, help="rebalance_every_n_steps")


def run(args: argparse.Namespace) -> Outcome:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    res = run_ranks("rebalance", 2, args)
    lines = [f"GPT: {args.layers} blocks, width {args.width}, seq {args.seq}, batch {args.batch}, "
             f"m={args.microbatches}, 1f1b on 2 CPU ranks x 1 thread; start split [all but 2, 2]"]
    lines += [f"  step {e['step']}: split {e['split'][0]} -> {e['split'][1]} (predicted gain {e['gain']:.0%}, "
              f"{e['moves']} layers moved)" for e in res["events"]]
    lines.append(f"  step before {res['before'] * 1e3:.1f} ms, after {res['after'] * 1e3:.1f} ms; the step that moved "
                 f"{res['move_step'] * 1e3:.1f} ms")
    return Outcome("\n".join(lines), {"rebalance_speedup": res["before"] / res["after"]})


BENCHMARK = Benchmark(
    "rebalance", "dynamic rebalancing in one run: a GPT started from a bad split on 2 ranks, step time before and "
    "after the move", run, arguments, worker, quick=())
