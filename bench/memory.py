"""Peak activation memory per stage: GPipe vs 1F1B vs ZeroBubble-V vs V-Half / V-Min, with and without recomputation.

What is measured: bytes autograd keeps for backward (saved tensors, deduplicated by storage, parameters excluded),
live, at their peak during a training step — per rank, through the real Lightning strategy
(``lightning_pipe.trace.memory.ActivationMeter``). GPT-like model, m = 8 micro-batches, pipeline sizes 2 and 4 on CPU.
Theory: GPipe keeps all m micro-batches' activations on the first stage, 1F1B at most p, so 1F1B / GPipe ≈ p / m.
1F1B stage r holds at most p - r micro-batches in flight, so per rank the ratio is (p - r)/m.
V-Half / V-Min (two half-size stages per rank, held from forward to weight backward) cap a rank at p and
max(2, ceil(2p/3)) stage-micro-batches: 0.5 and 0.375 (p = 4) of 1F1B's peak, which is its first rank's p micro-batches.
Every schedule gets the same balanced split (blocks evenly, embedding with the first, norm + head with the last).
Lines ``v_half_vs_1f1b=<x>`` / ``v_min_vs_1f1b=<x>``: the busiest rank's peak over 1F1B's busiest, for the largest p.
Last line: ``activation_ratio_1f1b_vs_gpipe=<x>`` on the first stage for the largest p (theory p/m = 0.5 at p = 4).

    python -m bench memory [--sizes 2,4]
"""

from __future__ import annotations

import argparse

from bench.common import (
    Benchmark,
    Outcome,
    balanced_split,
    gather,
    gpt,
    run_ranks,
    token_batches,
    trainer,
    write_result,
)

M = 8
CONFIGS = [  # (schedule, stages_per_rank, recompute)
    ("gpipe", None, "none"),
    ("1f1b", None, "none"),
    ("zbv", 2, "none"),
    ("v_half", 2, "none"),
    ("v_min", 2, "none"),
    ("gpipe", None, "all"),
    ("1f1b", None, "all"),
]


def worker(args: argparse.Namespace) -> None:
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PipelineStrategy
    from lightning_pipe.trace.memory import ActivationMeter

    class Meter(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.meter = ActivationMeter.attach(trainer.strategy.engine)

    world = args.size
    rows = []
    for schedule, v, recompute in CONFIGS:
        # 8 blocks: enough layers for 2 stages per rank at p = 4 (2 + 8 + ... = 11 layers >= 8 stages)
        model = gpt(n_layer=8, n_embd=64, block_size=64, warmup_steps=1, max_steps=100)
        meter = Meter()
        strategy = PipelineStrategy(schedule=schedule, microbatches=M, stages_per_rank=v, recompute=recompute,
                                    partition=balanced_split(8, world * (v or 1)))
        trainer(strategy, 2, [meter]).fit(model, token_batches(M * 4 * 3, 64, M * 4))
        rows.append({"schedule": schedule, "v": v or 1, "recompute": recompute, "peaks": gather(meter.meter.peak_bytes)})
    write_result(args, rows)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="2,4", help="pipeline sizes to run (ranks)")


def run(args: argparse.Namespace) -> Outcome:
    lines = ["| p | schedule | stages/rank | recompute | peak activation MiB per rank (rank 0 first) | "
             "vs GPipe, per rank |", "|---|---|---|---|---|---|"]
    first_stage_ratio, v_ratios = 0.0, {}
    for size in (int(s) for s in args.sizes.split(",")):
        rows = run_ranks("memory", size, argparse.Namespace(size=size))
        gpipe = next(r for r in rows if r["schedule"] == "gpipe" and r["recompute"] == "none")["peaks"]
        for r in rows:
            mib = ", ".join(f"{b / 2**20:.2f}" for b in r["peaks"])
            rel = ", ".join(f"{b / g:.2f}" for b, g in zip(r["peaks"], gpipe))
            lines.append(f"| {size} | {r['schedule']} | {r['v']} | {r['recompute']} | {mib} | {rel} |")
        theory = ", ".join(f"{(size - rank) / M:.2f}" for rank in range(size))
        lines.append(f"| {size} | theory 1F1B: stage r holds p-r of m={M} micro-batches | | | | {theory} |")
        one = next(r for r in rows if r["schedule"] == "1f1b" and r["recompute"] == "none")["peaks"]
        first_stage_ratio = one[0] / gpipe[0]
        for name in ("zbv", "v_half", "v_min"):
            peaks = next(r for r in rows if r["schedule"] == name)["peaks"]
            v_ratios[name] = max(peaks) / max(one)
            per_rank = ", ".join(f"{b / max(one):.3f}" for b in peaks)
            lines.append(f"| {size} | {name} vs 1F1B's peak (busiest rank {v_ratios[name]:.3f}) | | | | {per_rank} |")
    # The first stage is where 1F1B's p/m saving applies in full (theory: p/m; here for the largest p run).
    return Outcome("\n".join(lines), {"v_half_vs_1f1b": v_ratios["v_half"], "v_min_vs_1f1b": v_ratios["v_min"],
                                      "activation_ratio_1f1b_vs_gpipe": first_stage_ratio})


BENCHMARK = Benchmark(
    "memory", "peak activation bytes per rank for GPipe, 1F1B, ZB-V, V-Half, V-Min, with and without recomputation "
    "(p = 2 and 4, m = 8)", run, arguments, worker, quick=("--sizes", "4"))
