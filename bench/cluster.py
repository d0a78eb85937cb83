"""The cluster planner on Megatron-LM SC'21 Table 1: each row's published layout predicted (iteration time against
the one its TFLOP/s imply, memory per GPU), then the search over every layout of the row's GPUs and batch, timed:
its best, and its best with full recomputation as the published runs used (docs/planner.md, "Planning a cluster").

    python -m bench cluster [--rows 1,10] [--stack megatron_sc21]

Last lines: ``table1_error_max=<max |predicted - published| / published>``, ``search_best_vs_published_min=<the
search's best / published, lowest row>`` (and the same with recompute=full), ``search_seconds_max=<slowest search>``.
"""

from __future__ import annotations

import argparse
import time

from bench.common import Benchmark, Outcome


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default=None, help="1-based rows, e.g. 1,10 (default: all)")
    p.add_argument("--stack", default="megatron_sc21")


def run(args: argparse.Namespace) -> Outcome:
    from lightning_pipe.planner.cluster import STACKS, Projector, search
    from lightning_pipe.planner.cluster.published import SC21_TABLE_1

    rows = [int(r) for r in args.rows.split(",")] if args.rows else range(1, len(SC21_TABLE_1) + 1)
    stack = STACKS[args.stack]
    lines = ["| row | model | GPUs | batch | published s | predicted s | error | GiB/GPU | search s | best (all) s | "
             "/ published | best layout | best (recompute=full) s | / published |", "|---" * 14 + "|"]
    errors, ratios, ratios_full, seconds = [], [], [], []
    for i in rows:
        row = SC21_TABLE_1[i - 1]
        proj = Projector(row.model, row.cluster, row.batch, stack)
        pred = proj.predict(row.layout)
        error = (pred.iteration_s - row.iteration_s) / row.iteration_s
        start = time.perf_counter()
        best = search(proj, top=1).ranked[0]
        took = time.perf_counter() - start
        best_full = search(proj, {"recompute": "full"}, top=1).ranked[0]
        errors.append(abs(error))
        ratios.append(best.iteration_s / row.iteration_s)
        ratios_full.append(best_full.iteration_s / row.iteration_s)
        seconds.append(took)
        lines.append(f"| {i} | {row.layers} x {row.hidden} | {row.gpus} | {row.batch} | {row.iteration_s:.2f} | "
                     f"{pred.iteration_s:.2f} | {error:+.1%} | {pred.memory_bytes / 2**30:.1f} | {took:.1f} | "
                     f"{best.iteration_s:.2f} | {ratios[-1]:.3f} | {best.layout.line()} | "
                     f"{best_full.iteration_s:.2f} | {ratios_full[-1]:.3f} |")
    return Outcome("\n".join(lines), {
        "table1_error_max": max(errors), "search_best_vs_published_min": min(ratios),
        "search_best_full_recompute_vs_published_min": min(ratios_full), "search_seconds_max": max(seconds)})


BENCHMARK = Benchmark(
    "cluster", "the cluster planner on Megatron-LM SC'21 Table 1: each published layout predicted, then the search "
    "over every layout of its GPUs and batch (no processes)", run, arguments, quick=("--rows", "1,10"))
