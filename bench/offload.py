"""Activation offload and recomputation on the CPU: what stays with the device, what goes to the host, the step time.

Through the real Lightning strategy, 1F1B, GPT-like model (8 blocks, 64 wide, 64 tokens), m = 8 micro-batches, per
rank: *device* = peak bytes autograd keeps outside offloaded layers (``ActivationMeter``: saved tensors, deduplicated
by storage, parameters excluded); *host* = peak bytes the offload hooks hold (``OffloadStats``, unique tensors).
On a CPU device offload moves nothing ([Note: activation offload] in lightning_pipe/layers/offload.py), so the
step times say what the hooks' bookkeeping costs, not what host copies would; bench/gpu's ``c_offload`` row measures
those on a GPU. Last line: ``device_bytes_offload_all_vs_none=<x>`` on rank 0.

    python -m bench offload [--sizes 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.common import Benchmark, Outcome, gather, gpt, run_ranks, token_batches, trainer, write_result

M = 8
CONFIGS: list[tuple[str, Any]] = [  # (recompute, offload)
    ("none", "none"),
    ("none", "all"),
    ("none", 2),
    ("all", "none"),
    ("all", "all"),
]


def worker(args: argparse.Namespace) -> None:
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe import PipelineStrategy
    from lightning_pipe.trace.memory import ActivationMeter

    class Meter(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.host = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.meter = ActivationMeter.attach(trainer.strategy.engine)

        def on_train_batch_start(self, *_: Any) -> None:
            self.t = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            self.times.append(time.perf_counter() - self.t)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.host = sum(sm.offload_stats.peak_bytes for sm in trainer.strategy.engine.stage_modules)

    rows = []
    for recompute, offload in CONFIGS:
        model = gpt(n_layer=8, n_embd=64, block_size=64, warmup_steps=1, max_steps=100)
        meter = Meter()
        strategy = PipelineStrategy(schedule="1f1b", microbatches=M, recompute=recompute, offload=offload)
        trainer(strategy, args.steps, [meter]).fit(model, token_batches(M * 4 * args.steps, 64, M * 4))
        gathered = gather((meter.meter.peak_bytes, meter.host, statistics.median(meter.times[1:])))
        rows.append({"recompute": recompute, "offload": offload, "device": [x[0] for x in gathered],
                     "host": [x[1] for x in gathered], "step_s": max(x[2] for x in gathered)})
    write_result(args, rows)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="2", help="pipeline sizes to run (ranks)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per configuration (the first is untimed)")


def run(args: argparse.Namespace) -> Outcome:
    lines = ["| p | recompute | offload | device activation MiB per rank | host MiB per rank | device vs none, rank 0 "
             "| ms/step |", "|---|---|---|---|---|---|---|"]
    ratio = 0.0
    for size in (int(s) for s in args.sizes.split(",")):
        rows = run_ranks("offload", size, args)
        base = rows[0]["device"][0]
        for r in rows:
            dev = ", ".join(f"{b / 2**20:.2f}" for b in r["device"])
            host = ", ".join(f"{b / 2**20:.2f}" for b in r["host"])
            lines.append(f"| {size} | {r['recompute']} | {r['offload']} | {dev} | {host} | "
                         f"{r['device'][0] / base:.2f} | {r['step_s'] * 1e3:.0f} |")
        ratio = next(r for r in rows if r["recompute"] == "none" and r["offload"] == "all")["device"][0] / base
    return Outcome("\n".join(lines), {"device_bytes_offload_all_vs_none": ratio})


BENCHMARK = Benchmark(
    "offload", "activation offload and recomputation on the CPU: device bytes autograd keeps, host bytes offload "
    "holds, the step time (1F1B, m = 8)", run, arguments, worker, quick=("--steps", "3"))
