"""The planner against measurement: a grid of (pipeline x replicas, schedule, micro-batches, split) is trained for
real on CPU ranks; the planner (profiled on the same ranks, inside the run) predicts each one and picks its layout
from the same candidates. Two models: the GPT recipe's (``gpt``) and the same GPT with a 16x vocabulary, so the
embedding and the tied head outweigh several blocks (``unbalanced``); on 2 ranks (pipeline 2) and on 4 ranks, where
the planner weighs pipeline 4 x replicas 1 against pipeline 2 x replicas 2 and both are measured. Prints each grid
(measured vs predicted: the full training step, and the schedule's step as PipelineTimeline records it), then

    planner_pick_vs_best=<worst over the grids of: measured step of the planner's pick / best measured>  (goal <= 1.05)
    prediction_error_max=<max |predicted - measured| / measured step over every grid>                    (goal <= 0.10)

Profiling happens in the workers, all ranks at once (the machine is as busy as when training): the layer costs, the
link's latency/bandwidth and the runtime's cost per action on the real gloo group, each rank's relative speed, and
the step's fixed and per-micro-batch costs (the strategy training one tiny layer per stage at two micro-batch
counts: [Note: fixed and per-micro-batch step costs] in lightning_pipe/planner/calibrate.py).

    python bench/planner.py [--configs gpt:2,unbalanced:2,gpt:4,unbalanced:4] [--rounds 2] [--steps 4]
"""

from __future__ import annotations

import argparse
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
from bench.rebalance import measure_rebalance_speedup  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)]


def _model(args: argparse.Namespace):
    import torch

    from recipes.gpt.model import GPT

    torch.manual_seed(0)
    vocab = 256 if args.model == "gpt" else 256 * args.heavy
    return GPT(vocab_size=vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0,
               warmup_steps=5, max_steps=1000)


def _tokens(args: argparse.Namespace, rows: int):
    import torch

    vocab = 256 if args.model == "gpt" else 256 * args.heavy
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (rows, args.seq + 1), generator=g)


def _splits(n_layers: int, stages: int, world: int = 2) -> list[tuple[int, ...]]:
    """Uniform, blocks-balanced (embedding first, norm + head last) and one deliberately front-heavy split."""
    from lightning_pipe.layers.partition import uniform_counts

    blocks = n_layers - 3
    base, extra = divmod(blocks, stages)
    balanced = [base + (1 if s < extra else 0) for s in range(stages)]
    balanced[0] += 1
    balanced[-1] += 2
    out = {tuple(uniform_counts(n_layers, stages)), tuple(balanced)}
    if stages == 2 and world == 2:
        out.add((n_layers - 3, 3))
    return sorted(out)


def _measure(args: argparse.Namespace, schedule: str, v: int, m: int, counts: tuple[int, ...],
             dp: int, probe: bool = False) -> tuple[float, float, list]:
    """(fastest full training step, fastest schedule step) in seconds, as this rank measured them, and this rank's
    recorded timeline (StepRecord dicts). The fastest of the steps: on a shared machine contention only ever adds
    time, so the least-disturbed step is the closest to the layout's own cost (the profile is read the same way)."""
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from bench._models import residual_mlp
    from bench._timing import StepClock
    from lightning_pipe import PipelineStrategy, PipelineTimeline

    rows = args.batch * (args.steps + args.warmup)
    if probe:  # [Note: fixed and per-micro-batch step costs]: one tiny layer per stage, same trainer and callbacks
        g = torch.Generator().manual_seed(0)
        dataset = TensorDataset(torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g))
    else:
        tokens = _tokens(args, rows)
        dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    # each replica takes batch / dp rows per step (the same rows on every replica: only the time is measured)
    data = DataLoader(dataset, batch_size=args.batch // dp, drop_last=True)
    clock = StepClock()
    timeline = PipelineTimeline(warmup_steps=args.warmup, log=False)
    strategy = PipelineStrategy(schedule=schedule, microbatches=m, stages_per_rank=v, data_parallel_size=dp,
                                partition=list(counts))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        max_steps=args.steps + args.warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, timeline],
                        limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(residual_mlp(4, sum(counts)) if probe else _model(args), data)
    return (min(clock.durations(args.warmup)), min(r.wall_ns / 1e9 for r in timeline.records),
            [r.to_dict() for r in timeline.records])


def _calibrate(args: argparse.Namespace, base, speeds: list[float], pp: int, ms: list[int]):
    """Two short probe runs (1F1B and ZB-V, uniform splits, pipeline ``pp``) with PipelineTimeline: the profile's
    F / B / I / W scaled to the in-run durations (``validate --records`` does the same from the shell), and the
    trainer's own per-step cost (full step - schedule step - predicted optimizer and all-reduce)."""
    import dataclasses

    import torch.distributed as dist

    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.layers.partition import uniform_counts
    from lightning_pipe.planner import to_plan
    from lightning_pipe.planner.drift import calibrate, drift_by_kind, merge
    from lightning_pipe.planner.model import Candidate, CostModel, predict
    from lightning_pipe.planner.search import SearchResult, slowness_per_pipeline_rank
    from lightning_pipe.schedules import compute_order, plan_schedule
    from lightning_pipe.schedules.simulate import compile_order
    from lightning_pipe.trace.records import StepRecord

    world = dist.get_world_size()
    tables, extra = [], []
    for schedule, v in (("1f1b", 1), ("zbv", 2)):
        m = max(ms)
        plan = plan_schedule(PipelineConfig(schedule=schedule, microbatches=m, stages_per_rank=v), pp)
        counts = tuple(uniform_counts(base.num_layers, plan.num_stages))
        model = CostModel(base, args.batch / (world // pp) / m, slowness_per_pipeline_rank(speeds, pp, world // pp))
        pred = predict(model, compile_order(compute_order(plan), plan.num_stages), counts, world // pp)
        plan_json = to_plan(SearchResult([(Candidate(pp, world // pp, schedule, v, m, counts), pred)]), args.batch)
        step, sched, records = _measure(args, schedule, v, m, counts, world // pp)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (step, sched, records))
        recs = [StepRecord.from_dict(r) for _, _, rs in everyone for r in rs]
        tables.append(drift_by_kind(plan_json, recs, least=True))  # least-disturbed, like the profile
        step = max(e[0] for e in everyone)
        sched = max(e[1] for e in everyone)
        extra.append(step - sched - (pred.step_time - pred.schedule_time))  # beyond the measured fixed cost
    rows = merge(*tables)
    calibrated = calibrate(base, rows)
    return dataclasses.replace(calibrated, step_overhead=max(base.step_overhead + statistics.median(extra), 0.0)), rows


def _step_costs(args: argparse.Namespace, pp: int, ms: list[int], action_cost: float,
                latency: float) -> tuple[float, float]:
    """The fixed and per-micro-batch step costs ([Note: fixed and per-micro-batch step costs]): 1F1B over one
    tiny layer per stage at the grid's smallest and largest micro-batch counts, the slowest rank's fastest step."""
    import torch
    import torch.distributed as dist

    from bench._models import residual_mlp
    from lightning_pipe.planner import profile_model
    from lightning_pipe.planner.calibrate import solve_step_costs

    world = dist.get_world_size()
    counts = sorted({min(ms), max(ms)})
    rows = {m: args.batch // (world // pp) // m for m in counts}
    # the tiny layers' own time, so that only the step's host costs are left to solve for
    tiny = profile_model(residual_mlp(4, 1), (torch.zeros(args.batch, 4), torch.zeros(args.batch, 4)),
                         sorted(set(rows.values())), repeats=args.repeats)
    layer_time = {m: {"F": tiny.layers[rows[m]][0].forward, "B": tiny.layers[rows[m]][0].backward} for m in counts}
    measured = {}
    for m in counts:
        step = _measure(args, "1f1b", 1, m, tuple([1] * pp), world // pp, probe=True)[0]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, step)
        measured[m] = max(everyone)
    return solve_step_costs("1f1b", pp, 1, measured, action_cost, latency, layer_time)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.planner import ModelProfile, measure_link, profile_model, rank_speeds, search
    from lightning_pipe.planner.calibrate import measure_action_overhead
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
    pps = [pp for pp in (2, 4) if world % pp == 0 and pp <= world]
    sizes = sorted({args.batch * pp // world // m for pp in pps for m in ms} - {0})
    prof = profile_model(_model(args), (tokens[:, :-1], tokens[:, 1:]), sizes, repeats=args.repeats)
    prof.link_latency, prof.link_bandwidth = measure_link()
    overhead = measure_action_overhead(latency=prof.link_latency, repeats=8) if not args.no_overhead else 0.0
    gathered: list = [None] * world
    dist.all_gather_object(gathered, prof.to_json())
    profiles = [ModelProfile.from_json(g) for g in gathered]
    base = profiles[0]
    base.link_latency, base.link_bandwidth, base.action_overhead = prof.link_latency, prof.link_bandwidth, overhead
    speeds = rank_speeds(profiles, min(sizes))
    if not args.no_step_costs:
        base.step_overhead, base.microbatch_overhead = _step_costs(args, max(pps), ms, overhead, prof.link_latency)
    raw = base
    rows_cal: list = []
    if not args.no_calibrate:
        base, rows_cal = _calibrate(args, raw, speeds, max(pps), ms)
    profile_s = time.perf_counter() - t0
    result = search(base, world, args.batch, schedules=[s for s, _ in SCHEDULES], microbatches=ms,
                    pipeline_sizes=pps, speeds=speeds)
    search_s = time.perf_counter() - t0 - profile_s
    pick = result.best[0]
    # 4 ranks share 2-16 cores here: the grid keeps the one-stage-per-rank schedules there
    grid = [(pp, s, v, m, c) for pp in pps for s, v in SCHEDULES for m in ms
            for c in _splits(prof.num_layers, pp * v, world) if pp * v <= prof.num_layers and (world == 2 or v == 1)]
    pick_key = (pick.pipeline_size, pick.schedule, pick.stages_per_rank, pick.microbatches, tuple(pick.counts))
    if pick_key not in grid:
        grid.append(pick_key)
    measured: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for pp, s, v, m, c in grid:
            key = json.dumps([pp, s, v, m, list(c)])
            measured.setdefault(key, []).append(_measure(args, s, v, m, c, world // pp)[:2])
            dist.barrier()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, measured)
    rows = []
    for pp, s, v, m, c in grid:
        dp = world // pp
        plan = plan_schedule(PipelineConfig(schedule=s, microbatches=m, stages_per_rank=v), pp)
        compiled = compile_order(compute_order(plan), plan.num_stages)
        slowness = slowness_per_pipeline_rank(speeds, pp, dp)
        pred = predict(CostModel(base, args.batch / dp / m, slowness), compiled, c, dp)
        pred_raw = predict(CostModel(raw, args.batch / dp / m, slowness), compiled, c, dp)
        key = json.dumps([pp, s, v, m, list(c)])
        # per round, the slowest rank's view; over rounds, the least disturbed
        per_round = [max(r[key][i] for r in everyone) for i in range(args.rounds)]
        rows.append({"pp": pp, "dp": dp, "schedule": s, "v": v, "m": m, "counts": list(c),
                     "pred": pred.step_time, "pred_sched": pred.schedule_time, "pred_raw": pred_raw.step_time,
                     "meas": min(x[0] for x in per_round), "meas_sched": min(x[1] for x in per_round),
                     "spread": max(x[0] for x in per_round) / min(x[0] for x in per_round),
                     "pick": (pp, s, v, m, c) == pick_key})
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "rows": rows, "speeds": speeds, "profile_s": profile_s, "search_s": search_s, "overhead": overhead,
            "calibration": {r.what: [r.measured, r.predicted] for r in rows_cal},
            "step_overhead": base.step_overhead, "measured_step_costs": [raw.step_overhead, raw.microbatch_overhead],
            "link": [base.link_latency, base.link_bandwidth], "replayed": result.considered,
            "pick_pred": result.best[1].step_time}))


def _report(args: argparse.Namespace, model: str, ranks: int,
            res: dict) -> tuple[float, float, float, float, float]:
    rows = res["rows"]
    speeds = [round(s, 2) for s in res["speeds"]]
    vocab = 256 if model == "gpt" else 256 * args.heavy
    print(f"\n### {model}: GPT {args.layers} blocks, width {args.width}, vocab {vocab}, seq {args.seq}, batch "
          f"{args.batch}; {ranks} CPU ranks x 1 thread\nprofiled in {res['profile_s']:.1f} s (rank speeds {speeds}, "
          f"link {res['link'][0] * 1e6:.0f} us + {res['link'][1] / 1e9:.2f} GB/s, "
          f"{res['overhead'] * 1e3:.2f} ms per action; per step {res['measured_step_costs'][0] * 1e3:.2f} ms "
          f"+ {res['measured_step_costs'][1] * 1e3:.2f} ms per micro-batch), searched in {res['search_s']:.2f} s")
    if res["calibration"]:
        cal = ", ".join(f"{k} x{m / p:.2f}" if k != "bubble" else f"bubble {m:.0%} vs {p:.0%}"
                        for k, (m, p) in res["calibration"].items() if p)
        print(f"probe runs (measured / profile-predicted): {cal}; trainer per step "
              f"{res['step_overhead'] * 1e3:.1f} ms")
    print("\n| pp x dp | schedule | v | m | split | step meas ms | pred (profile only) | pred (calibrated) | error | "
          "schedule meas ms | schedule pred | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["meas"]):
        err = (r["pred"] - r["meas"]) / r["meas"]
        serr = (r["pred_sched"] - r["meas_sched"]) / r["meas_sched"]
        mark = " **(pick)**" if r["pick"] else ""
        print(f"| {r['pp']} x {r['dp']} | {r['schedule']}{mark} | {r['v']} | {r['m']} | {r['counts']} | "
              f"{r['meas'] * 1e3:.1f} | {r['pred_raw'] * 1e3:.1f} | {r['pred'] * 1e3:.1f} | {err:+.1%} | "
              f"{r['meas_sched'] * 1e3:.1f} | {r['pred_sched'] * 1e3:.1f} | {serr:+.1%} |")
    best = min(r["meas"] for r in rows)
    pick = next(r for r in rows if r["pick"])
    if ranks == 4:
        shapes: dict = {}
        for r in rows:
            shapes.setdefault((r["pp"], r["dp"]), []).append(r["meas"])
        text = ", ".join(f"pp {pp} x dp {dp}: {min(v) * 1e3:.1f} ms" for (pp, dp), v in sorted(shapes.items()))
        faster = min(shapes, key=lambda k: min(shapes[k]))
        print(f"\nbest measured per shape: {text}; the planner picked pp {pick['pp']} x dp {pick['dp']} "
              f"({'the faster shape' if (pick['pp'], pick['dp']) == faster else 'NOT the faster shape'})")
    error = max(abs(r["pred"] - r["meas"]) / r["meas"] for r in rows)
    raw_error = max(abs(r["pred_raw"] - r["meas"]) / r["meas"] for r in rows)
    sched_error = max(abs(r["pred_sched"] - r["meas_sched"]) / r["meas_sched"] for r in rows)
    spread = max(r["spread"] for r in rows)
    print(f"pick_vs_best={pick['meas'] / best:.3f} prediction_error_max={error:.3f} (profile only {raw_error:.3f}) "
          f"schedule_prediction_error_max={sched_error:.3f} round_to_round_spread_max={spread:.2f}")
    return pick["meas"] / best, error, sched_error, raw_error, spread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="gpt:2,unbalanced:2,gpt:4,unbalanced:4", help="model:ranks, ...")
    p.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heavy", type=int, default=16, help="unbalanced: vocabulary = 256 x this")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-overhead", action="store_true", help="the cost model without the per-action cost")
    p.add_argument("--no-calibrate", action="store_true", help="plan from the layer profile alone (no probe runs)")
    p.add_argument("--no-step-costs", action="store_true",
                   help="the cost model without the measured fixed and per-micro-batch step costs")
    p.add_argument("--no-rebalance", action="store_true", help="skip the rebalancing run (rebalance_speedup)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    results = []
    for item in args.configs.split(","):
        model, ranks = item.split(":")
        argv = [a for a in sys.argv[1:]] + ["--model", model]
        results.append(_report(args, model, int(ranks), run_ranks(__file__, int(ranks), argv)))
    print(f"\n(total bench time {time.perf_counter() - t0:.0f} s, load average after {os.getloadavg()[0]:.2f})")
    # the same layout measured in two rounds differed by this factor: the floor of any error measured here
    print(f"round_to_round_spread_max={max(r[4] for r in results):.2f}")
    print(f"schedule_prediction_error_max={max(r[2] for r in results):.3f}")
    print(f"prediction_error_max_profile_only={max(r[3] for r in results):.3f}")
    print(f"planner_pick_vs_best={max(r[0] for r in results):.3f}")
    print(f"prediction_error_max={max(r[1] for r in results):.3f}")
    if not args.no_rebalance:  # dynamic rebalancing from a bad split (bench/rebalance.py, its own 2-rank run)
        print(f"rebalance_speedup={measure_rebalance_speedup():.3f}")


if __name__ == "__main__":
    main()
