"""The planner against measurement: a grid of (pipeline x replicas, schedule, micro-batches, split) is trained for
real on CPU ranks; the planner (profiled on the same ranks, inside the run) predicts each one and picks its layout
from the same candidates. Two models: the GPT recipe's (``gpt``) and the same GPT with a 16x vocabulary, so the
embedding and the tied head outweigh several blocks (``unbalanced``); on 2 ranks (pipeline 2) and on 4 ranks, where
the planner weighs pipeline 4 x replicas 1 against pipeline 2 x replicas 2 and both are measured. Prints each grid
(measured vs predicted: the full training step, and the schedule's step as PipelineTimeline records it), then

    planner_pick_vs_best=<worst over the grids of: measured step of the planner's pick / best measured>  (goal <= 1.05)
    prediction_error_max=<max |predicted - measured| / measured step over every grid>                    (goal <= 0.10)
    structure_error_max=<the same for the schedule replayed from each layout's own measured actions>
    prediction_error_max_grid_calibrated=<the prediction error when the calibration is fitted to the probe layouts'
        own rounds in the grid instead of their runs before it (the layouts other than the probes)>

The planner calibrates before the grid, as ``schedule="auto"`` does before training; this machine's speed then moves
5-15 % over the minutes the grid takes, which no calibration made earlier can know. The last metric refits the same
calibration (:func:`~bench._planner_runs.fit_calibration`) to the probe layouts' measurements taken in the grid's
rounds, so that the cost model is judged on costs of the same minutes; the gap between the two errors is the drift.

Profiling happens in the workers, all ranks at once (the machine is as busy as when training): the layer costs, the
link's latency/bandwidth, each rank's relative speed, and the strategy's cost per action and its fixed and
per-micro-batch step costs (the strategy training one tiny layer per stage at two micro-batch counts, read from its
timeline: [Note: the strategy's cost per action, from its own timeline] and [Note: fixed and per-micro-batch step
costs] in lightning_pipe/planner/calibrate.py).

Measuring on a shared machine: slow phases last from one step (a step 1.5x its neighbours) to minutes (every layout
1.3-1.5x slower in the later rounds of one run), and contention only ever adds time. Each layout is therefore its
least-disturbed step: the fastest of ``--steps`` steps, in each of ``--rounds`` rounds that sweep the whole grid in
a different (seeded, shuffled) order, so that a slow phase of minutes meets different layouts in different rounds
instead of the same stretch of the grid each time; the layout's time is the fastest round (the profile reads layers
the same way). A median of rounds would be biased up whenever a slow phase covers half of them; a reference layout
run next to each one would carry the noise of both runs (slowdowns change within a second, faster than one layout
is measured). ``floor_spread_max``: the two fastest rounds of one layout differ by this factor (how well its floor
is pinned down); ``round_to_round_spread_max``: the slowest round over the fastest. ``--dump`` writes every step and
timeline for offline analysis.

    python -m bench planner [--configs gpt:2,unbalanced:2,gpt:4,unbalanced:4] [--rounds 5] [--steps 6] [--dump P]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

from bench._analytic import analytic_profiles
from bench._planner_runs import (
    calibrate,
    fit_calibration,
    gpt_model,
    measure,
    model_args,
    probe_layouts,
    replay_measured,
    step_costs,
    token_rows,
    vocab,
)
from bench.common import Benchmark, Outcome, gather, kendall_tau, run_ranks, write_result

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)]


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


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.planner import ModelProfile, measure_link, profile_model, rank_speeds, search
    from lightning_pipe.planner.calibrate import measure_action_overhead
    from lightning_pipe.planner.model import CostModel, bounds_of, predict
    from lightning_pipe.planner.search import slowness_per_pipeline_rank
    from lightning_pipe.schedules import compute_order, plan_schedule
    from lightning_pipe.schedules.simulate import compile_order

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ms = [int(m) for m in args.microbatches.split(",")]
    t0 = time.perf_counter()
    tokens = token_rows(args, args.batch)
    pps = [pp for pp in (2, 4) if world % pp == 0 and pp <= world]
    sizes = sorted({args.batch * pp // world // m for pp in pps for m in ms} - {0})
    prof = profile_model(gpt_model(args), (tokens[:, :-1], tokens[:, 1:]), sizes, repeats=args.repeats,
                         passes=args.passes)
    prof.link_latency, prof.link_bandwidth = measure_link(repeats=20)  # fastest of 20: one slow phase is not the link
    overhead = measure_action_overhead(latency=prof.link_latency, repeats=8) if not args.no_overhead else 0.0
    profiles = [ModelProfile.from_json(g) for g in gather(prof.to_json())]
    base = profiles[0]
    base.link_latency, base.link_bandwidth, base.action_overhead = prof.link_latency, prof.link_bandwidth, overhead
    speeds = rank_speeds(profiles, max(sizes))  # as schedule="auto" reads them: the largest size, the least noisy
    tiny: tuple = (0.0, 0.0)  # the tiny probe's cost per action (in, around its slices)
    if not args.no_step_costs:
        base.step_overhead, base.microbatch_overhead, *tiny = step_costs(args, max(pps), ms, prof.link_latency)
    raw = base
    # the cluster planner's analytic source, given this machine's description (docs/planner.md, "Planning a cluster")
    analytic, analytic_host, machine = analytic_profiles(args, world, prof.link_latency, prof.link_bandwidth, raw,
                                                         overhead, sizes)
    rows_cal: list = []
    fitted: dict = {}
    probe_steps: dict[str, float] = {}
    if not args.no_calibrate:
        base, rows_cal, fitted, probe_steps = calibrate(args, raw, speeds, max(pps), ms)
        if args.no_overhead:
            base.action_overhead = 0.0
    profile_s = time.perf_counter() - t0
    result = search(base, world, args.batch, schedules=[s for s, _ in SCHEDULES], microbatches=ms,
                    pipeline_sizes=pps, speeds=speeds)
    search_s = time.perf_counter() - t0 - profile_s
    pick = result.best[0]
    # 4 ranks share 2-16 cores here: the grid keeps the one-stage-per-rank schedules there
    grid = [(pp, s, v, m, c) for pp in pps for s, v in SCHEDULES for m in ms
            for c in _splits(prof.num_layers, pp * v, world) if pp * v <= prof.num_layers and (world == 2 or v == 1)]
    pick_key = (pick.pipeline_size, pick.schedule, pick.stages_per_rank, pick.microbatches, tuple(pick.counts))
    for key in [pick_key] + [tuple(json.loads(k)[:4]) + (tuple(json.loads(k)[4]),) for k in probe_steps]:
        if key not in grid:
            grid.append(key)
    measured: dict[str, list[tuple[float, float]]] = {}
    timelines: dict[str, list[tuple[list[float], list]]] = {}  # per round: (full steps, records) for replay_measured
    dumped: dict[str, list] = {}
    for rnd in range(args.rounds):
        # interleaved rounds (bench.common.interleave's order): a drift of the machine falls on every layout alike
        for pp, s, v, m, c in (grid if rnd % 2 == 0 else grid[::-1]):
            key = json.dumps([pp, s, v, m, list(c)])
            out = measure(args, s, v, m, c, world // pp)
            measured.setdefault(key, []).append(out[:2])
            timelines.setdefault(key, []).append((out[3], out[2]))
            if args.dump:
                dumped.setdefault(key, []).append({"t": time.time(), "round": rnd, "steps": out[3], "records": out[2]})
            dist.barrier()
    if args.dump:
        every_dump = gather(dumped)
        if rank == 0:
            Path(f"{args.dump}.{args.model}{world}.json").write_text(json.dumps(
                {"dumped": every_dump, "base": base.to_json(), "raw": raw.to_json(), "speeds": speeds,
                 "batch": args.batch, "grid": grid}))
    everyone, every_timeline = gather(measured), gather(timelines)
    # the same fit, from the probe layouts' own rounds in the grid (prediction_error_max_grid_calibrated)
    at_grid = None
    if probe_steps:
        probes = probe_layouts(raw, max(pps), ms)
        runs = {(s, m): [[t[json.dumps([max(pps), s, v, m, list(c)])][rnd] for t in every_timeline]
                         for rnd in range(args.rounds)] for (s, m), (v, _, c) in probes.items()}
        at_grid = fit_calibration(args, raw, speeds, max(pps), probes, runs)[0]
    rows = []
    for pp, s, v, m, c in grid:
        dp = world // pp
        plan = plan_schedule(PipelineConfig(schedule=s, microbatches=m, stages_per_rank=v), pp)
        compiled = compile_order(compute_order(plan), plan.num_stages)
        slowness = slowness_per_pipeline_rank(speeds, pp, dp)
        pred = predict(CostModel(base, args.batch / dp / m, slowness), compiled, c, dp)
        pred_raw = predict(CostModel(raw, args.batch / dp / m, slowness), compiled, c, dp)
        pred_grid = predict(CostModel(at_grid, args.batch / dp / m, slowness), compiled, c, dp) if at_grid else pred
        pred_an = predict(CostModel(analytic, args.batch / dp / m, [1.0] * pp), compiled, c, dp)
        pred_an_host = predict(CostModel(analytic_host, args.batch / dp / m, [1.0] * pp), compiled, c, dp)
        key = json.dumps([pp, s, v, m, list(c)])
        # per round, the slowest rank's view; over rounds, the least disturbed
        per_round = [max(r[key][i] for r in everyone) for i in range(args.rounds)]
        steps = sorted(x[0] for x in per_round)
        # [the model's structure]: the same order replayed from the measured actions of the fastest step
        at_best, replayed = replay_measured([t[key] for t in every_timeline], compiled,
                                            CostModel(base, args.batch / dp / m, slowness).comm(bounds_of(c)))
        rows.append({"pp": pp, "dp": dp, "schedule": s, "v": v, "m": m, "counts": list(c),
                     "pred": pred.step_time, "pred_sched": pred.schedule_time, "pred_raw": pred_raw.step_time,
                     "pred_grid": pred_grid.step_time, "probe": key in probe_steps,
                     "pred_analytic": pred_an.step_time, "pred_analytic_host": pred_an_host.step_time,
                     "meas": min(x[0] for x in per_round), "meas_sched": min(x[1] for x in per_round),
                     "structure_error": (replayed - at_best) / at_best,
                     "spread": steps[-1] / steps[0], "floor": steps[min(1, len(steps) - 1)] / steps[0],
                     "pick": (pp, s, v, m, c) == pick_key})
    # [the machine's drift]: the probe layouts' fastest round over their fastest step when calibrated
    floors = {json.dumps([r["pp"], r["schedule"], r["v"], r["m"], r["counts"]]): r["meas"] for r in rows}
    drift = statistics.geometric_mean([floors[k] / t for k, t in probe_steps.items()]) if probe_steps else 1.0
    write_result(args, {"drift": drift,
            "rows": rows, "speeds": speeds, "profile_s": profile_s, "search_s": search_s, "overhead": overhead,
            "tiny_action": list(tiny), "fitted": fitted,
            "calibration": {r.what: [r.measured, r.predicted] for r in rows_cal},
            "step_overhead": base.step_overhead, "action_overhead": base.action_overhead,
            "transfer_overhead": base.transfer_overhead, "measured_step_costs": [raw.step_overhead, raw.microbatch_overhead],
            "link": [base.link_latency, base.link_bandwidth], "replayed": result.considered,
            "machine": [machine.peak_tflops * 1e3, machine.hbm_gbps, machine.kernel_us],
            "pick_pred": result.best[1].step_time})


def _report(args: argparse.Namespace, model: str, ranks: int, res: dict, say: list[str]) -> dict[str, float]:
    rows = res["rows"]
    speeds = [round(s, 2) for s in res["speeds"]]
    say.append(f"\n### {model}: GPT {args.layers} blocks, width {args.width}, {args.heads} heads, vocab {vocab(args)}, "
          f"seq {args.seq}, batch "
          f"{args.batch}; {ranks} CPU ranks x 1 thread\nprofiled in {res['profile_s']:.1f} s (rank speeds {speeds}, "
          f"link {res['link'][0] * 1e6:.0f} us + {res['link'][1] / 1e9:.2f} GB/s, "
          f"{res['overhead'] * 1e3:.2f} ms per action on torch's bare stages, the strategy's on one tiny layer "
          f"{sum(res['tiny_action']) * 1e3:.2f}; per step {res['measured_step_costs'][0] * 1e3:.2f} ms "
          f"+ {res['measured_step_costs'][1] * 1e3:.2f} ms per micro-batch), searched in {res['search_s']:.2f} s")
    if res["calibration"]:
        cal = ", ".join(f"{k} x{m / p:.2f}" if k != "bubble" else f"bubble {m:.0%} vs {p:.0%}"
                        for k, (m, p) in res["calibration"].items() if p)
        fit = "; ".join(f"m={m}: layers " + " ".join(f"{k} x{v:.2f}" for k, v in sorted(scales.items()))
                        + f", per action {inside * 1e3:.2f} ms in its slices"
                        for m, (scales, inside, _, _) in res["fitted"].items())
        say.append(f"probe runs (measured / profile-predicted): {cal}\nfitted: {fit}; charged per action (in + around) "
              f"{res['action_overhead'] * 1e3:.2f} ms, per transfer {res['transfer_overhead'] * 1e3:.2f} ms (every "
              f"probe's host time); trainer per step {res['step_overhead'] * 1e3:.1f} ms")
    say.append("\n| pp x dp | schedule | v | m | split | step meas ms | pred (profile only) | pred (calibrated) | error | "
          "calibrated in the grid's rounds: pred | error | schedule meas ms | schedule pred | error | "
          "replayed from its measured actions | analytic (+ host costs) |")
    say.append("|---" * 17 + "|")
    for r in sorted(rows, key=lambda r: r["meas"]):
        err = (r["pred"] - r["meas"]) / r["meas"]
        serr = (r["pred_sched"] - r["meas_sched"]) / r["meas_sched"]
        gerr = (r["pred_grid"] - r["meas"]) / r["meas"]
        mark = (" **(pick)**" if r["pick"] else "") + (" (probe)" if r["probe"] else "")
        say.append(f"| {r['pp']} x {r['dp']} | {r['schedule']}{mark} | {r['v']} | {r['m']} | {r['counts']} | "
              f"{r['meas'] * 1e3:.1f} | {r['pred_raw'] * 1e3:.1f} | {r['pred'] * 1e3:.1f} | {err:+.1%} | "
              f"{r['pred_grid'] * 1e3:.1f} | {gerr:+.1%} | "
              f"{r['meas_sched'] * 1e3:.1f} | {r['pred_sched'] * 1e3:.1f} | {serr:+.1%} | "
              f"{r['structure_error']:+.1%} | {r['pred_analytic_host'] * 1e3:.1f} |")
    best = min(r["meas"] for r in rows)
    pick = next(r for r in rows if r["pick"])
    if ranks == 4:
        shapes: dict = {}
        for r in rows:
            shapes.setdefault((r["pp"], r["dp"]), []).append(r["meas"])
        text = ", ".join(f"pp {pp} x dp {dp}: {min(v) * 1e3:.1f} ms" for (pp, dp), v in sorted(shapes.items()))
        faster = min(shapes, key=lambda k: min(shapes[k]))
        say.append(f"\nbest measured per shape: {text}; the planner picked pp {pick['pp']} x dp {pick['dp']} "
              f"({'the faster shape' if (pick['pp'], pick['dp']) == faster else 'NOT the faster shape'})")
    error = max(abs(r["pred"] - r["meas"]) / r["meas"] for r in rows)
    raw_error = max(abs(r["pred_raw"] - r["meas"]) / r["meas"] for r in rows)
    sched_error = max(abs(r["pred_sched"] - r["meas_sched"]) / r["meas_sched"] for r in rows)
    spread = max(r["spread"] for r in rows)
    floor = max(r["floor"] for r in rows)
    drifted = max(abs(r["pred"] * res["drift"] - r["meas"]) / r["meas"] for r in rows)
    structure = max(abs(r["structure_error"]) for r in rows)
    at_grid = max(abs(r["pred_grid"] - r["meas"]) / r["meas"] for r in rows if not r["probe"])
    say.append(f"the probe layouts measured x{res['drift']:.2f} their speed at calibration; predictions x that: error max "
          f"{drifted:.3f}\nthe schedule replayed from each layout's measured actions (the model's structure, its costs "
          f"measured): error max {structure:.3f}\ncalibrated from the probe layouts' own rounds in the grid (the "
          f"machine's drift since calibration taken out): error max over the other layouts {at_grid:.3f}")
    an = [(r["pred_analytic"] - r["meas"]) / r["meas"] for r in rows]
    an_host = [(r["pred_analytic_host"] - r["meas"]) / r["meas"] for r in rows]
    say.append(f"analytic source (this machine: {res['machine'][0]:.0f} GFLOP/s matmul, {res['machine'][1]:.1f} GB/s, "
               f"{res['machine'][2]:.2f} us per op, the gloo link): error max {max(map(abs, an)):.3f} (per layout "
               f"{min(an):+.1%} to {max(an):+.1%}); with the runtime's host costs measured on the tiny probe "
               f"{max(map(abs, an_host)):.3f} ({min(an_host):+.1%} to {max(an_host):+.1%}); the profiled planner's "
               f"{error:.3f} (its profile with the same host costs {raw_error:.3f})\n"
               f"analytic against the measured layer profile (the same host costs): "
               f"{min(r['pred_analytic_host'] / r['pred_raw'] for r in rows):.2f}x to "
               f"{max(r['pred_analytic_host'] / r['pred_raw'] for r in rows):.2f}x its prediction")
    # the planner's use: choosing. Does it order the layouts as measurement does (Kendall's tau over the grid)?
    tau = kendall_tau([r["pred"] for r in rows], [r["meas"] for r in rows])
    tau_raw = kendall_tau([r["pred_raw"] for r in rows], [r["meas"] for r in rows])
    say.append(f"rank_correlation={tau:.3f} (profile only {tau_raw:.3f}) pick_vs_best={pick['meas'] / best:.3f} "
               f"prediction_error_max={error:.3f} (profile only {raw_error:.3f}; the machine's drift during the run "
               f"x{res['drift']:.2f}) schedule_prediction_error_max={sched_error:.3f} "
               f"round_to_round_spread_max={spread:.2f} floor_spread_max={floor:.2f}")
    return {"pick": pick["meas"] / best, "error": error, "sched_error": sched_error, "raw_error": raw_error,
            "spread": spread, "floor": floor, "structure": structure, "at_grid": at_grid, "tau": tau,
            "drift": abs(res["drift"] - 1), "analytic": max(map(abs, an)), "analytic_host": max(map(abs, an_host))}


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="gpt:2,unbalanced:2,gpt:4,unbalanced:4", help="model:ranks, ...")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heavy", type=int, default=16, help="unbalanced: vocabulary = 256 x this")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--real-batch", type=int, default=8, help="gpt2: sequences per step")
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--passes", type=int, default=4, help="profiling sweeps (each layer: its fastest)")
    p.add_argument("--probe-repeats", type=int, default=3, help="runs of each calibration probe")
    p.add_argument("--no-overhead", action="store_true", help="the cost model without the per-action cost")
    p.add_argument("--no-calibrate", action="store_true", help="plan from the layer profile alone (no probe runs)")
    p.add_argument("--no-step-costs", action="store_true",
                   help="the cost model without the measured fixed and per-micro-batch step costs")
    p.add_argument("--dump", help="also write every measured step and timeline to DUMP.<model><ranks>.json")


def run(args: argparse.Namespace) -> Outcome:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    say = [f"load before: {os.getloadavg()[0]:.2f}"]
    grids: dict[str, dict[str, float]] = {}
    for item in args.configs.split(","):
        model, ranks = item.split(":")
        settings = model_args(args, model)
        grids[f"{model}_{ranks}"] = _report(settings, model, int(ranks), run_ranks("planner", int(ranks), settings),
                                           say)
    say.append(f"\n(total bench time {time.perf_counter() - t0:.0f} s, load average after {os.getloadavg()[0]:.2f})")
    worst = {key: max(g[key] for g in grids.values()) for key in next(iter(grids.values()))}
    return Outcome("\n".join(say), {
        # the same layout measured in two rounds differed by this factor: the floor of any error measured here
        "round_to_round_spread_max": worst["spread"],
        # the two quietest rounds of one layout differed by this factor: how well its floor is pinned down
        "floor_spread_max": worst["floor"],
        "schedule_prediction_error_max": worst["sched_error"],
        # the schedule replayed from its own measured actions: what the model's structure alone gets wrong
        "structure_error_max": worst["structure"],
        # the cost model with its calibration measured in the grid's own rounds: the error without the machine's drift
        "prediction_error_max_grid_calibrated": worst["at_grid"],
        "prediction_error_max_profile_only": worst["raw_error"],
        "planner_pick_vs_best": worst["pick"],
        "prediction_error_max": worst["error"],
        # the probe layouts' speed in the grid's rounds against their calibration runs: |x - 1|, the worst grid
        "drift_max": worst["drift"],
        # the cluster planner's analytic costs for this machine (alone; with the runtime's measured host costs)
        "analytic_prediction_error_max": worst["analytic"],
        "analytic_host_prediction_error_max": worst["analytic_host"],
        # Kendall's tau between predicted and measured step times over each grid: the worst grid, then each
        "rank_correlation": min(g["tau"] for g in grids.values()),
        **{f"rank_correlation_{name}": g["tau"] for name, g in grids.items()},
        **{f"pick_vs_best_{name}": g["pick"] for name, g in grids.items()}})


BENCHMARK = Benchmark(
    "planner", "the planner against measurement: a grid of layouts trained for real, each predicted from a profile "
    "taken in the run; the planner's pick against the best measured", run, arguments, worker,
    quick=("--configs", "gpt:2", "--rounds", "1", "--steps", "3", "--probe-repeats", "1", "--passes", "1",
           "--repeats", "1"))
