"""The planner against measurement: on the GPT recipe's model, 2 CPU ranks, a grid of (schedule x micro-batches x
split) is trained for real; the planner (profiled on the same ranks, inside the run) predicts each one and picks
its layout from the same candidates. Prints the grid (measured vs predicted step), then

    planner_pick_vs_best=<measured step of the planner's pick / best measured in the grid>   (goal <= 1.05)
    prediction_error_max=<max |predicted - measured| / measured over the grid>                (goal <= 0.10)

Profiling happens in the workers, both ranks at once (the machine is as busy as when training): the layer costs,
the link's latency/bandwidth on the real gloo group, and each rank's relative speed.

    python bench/planner.py [--layers 6] [--width 128] [--seq 64] [--batch 16] [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._ranks import run_ranks  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)]


def _model(args: argparse.Namespace):
    import torch

    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0,
               warmup_steps=5, max_steps=1000)


def _tokens(args: argparse.Namespace, rows: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (rows, args.seq + 1), generator=g)


def _splits(n_layers: int, stages: int) -> list[tuple[int, ...]]:
    """Uniform, blocks-balanced (embedding first, norm + head last) and one deliberately front-heavy split."""
    from lightning_pipe.partition import uniform_counts

    blocks = n_layers - 3
    base, extra = divmod(blocks, stages)
    balanced = [base + (1 if s < extra else 0) for s in range(stages)]
    balanced[0] += 1
    balanced[-1] += 2
    out = {tuple(uniform_counts(n_layers, stages)), tuple(balanced)}
    if stages == 2:
        out.add((n_layers - 3, 3))
    return sorted(out)


def _measure(args: argparse.Namespace, schedule: str, v: int, m: int, counts: tuple[int, ...], dp: int) -> float:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from bench._timing import StepClock
    from lightning_pipe import PipelineStrategy
    from lightning_pipe.config import PipelineConfig

    key = "partition" if "partition" in {f.name for f in dataclasses.fields(PipelineConfig)} else "split"
    tokens = _tokens(args, args.batch * (args.steps + args.warmup))
    # each replica takes batch / dp rows per step (the same rows on every replica: only the time is measured)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch // dp, drop_last=True)
    clock = StepClock()
    strategy = PipelineStrategy(schedule=schedule, microbatches=m, stages_per_rank=v, data_parallel_size=dp,
                                **{key: list(counts)})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        max_steps=args.steps + args.warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                        limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(_model(args), data)
    return statistics.median(clock.durations(args.warmup))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.planner import ModelProfile, measure_link, profile_model, rank_speeds, search
    from lightning_pipe.planner.model import CostModel, predict
    from lightning_pipe.planner.search import slowness_per_pipeline_rank
    from lightning_pipe.schedules import compute_order, plan_schedule
    from lightning_pipe.schedules.simulate import compile_order

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ms = [int(m) for m in args.microbatches.split(",")]
    t0 = time.perf_counter()
    tokens = _tokens(args, args.batch)
    pps = [pp for pp in (2, 4, 8) if world % pp == 0]
    sizes = sorted({args.batch * pp // world // m for pp in pps for m in ms} - {0})
    prof = profile_model(_model(args), (tokens[:, :-1], tokens[:, 1:]), sizes, repeats=args.repeats)
    prof.link_latency, prof.link_bandwidth = measure_link()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, prof.to_json())
    profiles = [ModelProfile.from_json(g) for g in gathered]
    speeds = rank_speeds(profiles, args.batch // max(ms))
    profile_s = time.perf_counter() - t0
    result = search(profiles[0], world, args.batch, schedules=[s for s, _ in SCHEDULES], microbatches=ms,
                    pipeline_sizes=pps, speeds=speeds, action_overhead=args.overhead_ms * 1e-3)
    search_s = time.perf_counter() - t0 - profile_s
    pick = result.best[0]
    grid = [(pp, s, v, m, c) for pp in pps for s, v in SCHEDULES for m in ms
            for c in _splits(prof.num_layers, pp * v) if pp * v <= prof.num_layers and (world == 2 or v == 1)]
    pick_key = (pick.pipeline_size, pick.schedule, pick.stages_per_rank, pick.microbatches, tuple(pick.counts))
    if pick_key not in grid:
        grid.append(pick_key)
    measured: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for pp, s, v, m, c in grid:
            key = json.dumps([pp, s, v, m, list(c)])
            measured.setdefault(key, []).append(_measure(args, s, v, m, c, world // pp))
            dist.barrier()
    rows = []
    for pp, s, v, m, c in grid:
        dp = world // pp
        plan = plan_schedule(PipelineConfig(schedule=s, microbatches=m, stages_per_rank=v), pp)
        model = CostModel(profiles[0], args.batch / dp / m, slowness_per_pipeline_rank(speeds, pp, dp),
                          args.overhead_ms * 1e-3)
        pred = predict(model, compile_order(compute_order(plan), plan.num_stages), c, dp)
        rows.append({"pp": pp, "dp": dp, "schedule": s, "v": v, "m": m, "counts": list(c), "pred": pred.step_time,
                     "meas": min(measured[json.dumps([pp, s, v, m, list(c)])]),
                     "pick": (pp, s, v, m, c) == pick_key})
    if rank == 0:
        Path(args.out).write_text(json.dumps({"rows": rows, "speeds": speeds, "profile_s": profile_s,
                                              "search_s": search_s, "link": [prof.link_latency, prof.link_bandwidth],
                                              "replayed": result.considered}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="2: pipeline 2; 4: pipeline 4 x 1 against 2 x 2")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--overhead-ms", type=float, default=0.0, help="planner's cost per stage call")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    res = run_ranks(__file__, args.ranks, sys.argv[1:])
    rows = res["rows"]
    speeds = [round(s, 2) for s in res["speeds"]]
    print(f"GPT: {args.layers} blocks, width {args.width}, seq {args.seq}, batch {args.batch}, "
          f"{args.ranks} CPU ranks x 1 thread; profiled in {res['profile_s']:.1f} s (rank speeds {speeds}, link "
          f"{res['link'][0] * 1e6:.0f} us + {res['link'][1] / 1e9:.2f} GB/s), searched in {res['search_s']:.2f} s\n")
    print("| pp x dp | schedule | v | m | split | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["meas"]):
        err = (r["pred"] - r["meas"]) / r["meas"]
        mark = " **(planner's pick)**" if r["pick"] else ""
        print(f"| {r['pp']} x {r['dp']} | {r['schedule']}{mark} | {r['v']} | {r['m']} | {r['counts']} | "
              f"{r['meas'] * 1e3:.1f} | {r['pred'] * 1e3:.1f} | {err:+.1%} |")
    best = min(r["meas"] for r in rows)
    pick = next(r for r in rows if r["pick"])
    print(f"\n(total bench time {time.perf_counter() - t0:.0f} s)")
    print(f"planner_pick_vs_best={pick['meas'] / best:.3f}")
    print(f"prediction_error_max={max(abs(r['pred'] - r['meas']) / r['meas'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
