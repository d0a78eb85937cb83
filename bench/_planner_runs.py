"""The runs behind the planner benchmark (``bench/planner.py``, in its rank processes): the two models, one measured
layout, and the in-run calibration probes (the real model's per-action costs and layer scales, the tiny model's step
costs)."""

from __future__ import annotations

import argparse
import json
import statistics

from bench.common import gather, gpt, residual_mlp, step_clock, trainer

REAL_SIZE = {"layers": 12, "width": 768, "heads": 12, "seq": 256}
"""The ``gpt2`` model's shapes: GPT-2 small's blocks, the byte vocabulary (bench/gpt2.py)."""


def model_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """The settings of one model of the grid: ``gpt2`` takes GPT-2 small's shapes and ``--real-batch``."""
    shapes = {**REAL_SIZE, "batch": args.real_batch} if model == "gpt2" else {}
    return argparse.Namespace(**{**vars(args), "model": model, **shapes})


def gpt_model(args: argparse.Namespace):
    return gpt(n_layer=args.layers, n_embd=args.width, block_size=args.seq, vocab_size=vocab(args),
               n_head=args.heads)


def vocab(args: argparse.Namespace) -> int:
    return 256 * args.heavy if args.model == "unbalanced" else 256


def token_rows(args: argparse.Namespace, rows: int):
    import torch

    return torch.randint(0, vocab(args), (rows, args.seq + 1), generator=torch.Generator().manual_seed(0))


def measure(args: argparse.Namespace, schedule: str, v: int, m: int, counts: tuple[int, ...],
             dp: int, probe: bool = False) -> tuple[float, float, list]:
    """(fastest full training step, fastest schedule step) in seconds, as this rank measured them, and this rank's
    recorded timeline (StepRecord dicts). The fastest of the steps: on a shared machine contention only ever adds
    time, so the least-disturbed step is the closest to the layout's own cost (the profile is read the same way)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineStrategy, PipelineTimeline

    rows = args.batch * (args.steps + args.warmup)
    if probe:  # [Note: fixed and per-micro-batch step costs]: one tiny layer per stage, same trainer and callbacks
        g = torch.Generator().manual_seed(0)
        dataset = TensorDataset(torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g))
    else:
        tokens = token_rows(args, rows)
        dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    # each replica takes batch / dp rows per step (the same rows on every replica: only the time is measured)
    data = DataLoader(dataset, batch_size=args.batch // dp, drop_last=True)
    clock = step_clock()
    timeline = PipelineTimeline(warmup_steps=args.warmup, log=False)
    strategy = PipelineStrategy(schedule=schedule, microbatches=m, stages_per_rank=v, data_parallel_size=dp,
                                partition=list(counts))
    trainer(strategy, args.steps + args.warmup, [clock, timeline]).fit(
        residual_mlp(4, sum(counts)) if probe else gpt_model(args), data)
    return (min(clock.durations(args.warmup)), min(r.wall_ns / 1e9 for r in timeline.records),
            [r.to_dict() for r in timeline.records], clock.durations(args.warmup))


def least_outside(per_rank: list) -> float:
    """Seconds of the step outside the schedule at the least-disturbed step: per step, the slowest rank's full step
    minus the slowest rank's schedule step, of the *same* step (the fastest full step and the fastest schedule step
    are often different steps, and their difference then carries the noise of both). ``per_rank``: each rank's
    (full step durations, timeline record dicts)."""
    clocks = [steps for steps, _ in per_rank]
    walls = [[r["end_ns"] - r["start_ns"] for r in sorted(records, key=lambda r: r["step"])]
             for _, records in per_rank]
    n = min(min(len(c) for c in clocks), min(len(w) for w in walls))
    return min(max(c[j] for c in clocks) - max(w[j] for w in walls) / 1e9 for j in range(n))


def probe_layouts(base, pp: int, ms: list[int]) -> dict:
    """The calibration probes: 1F1B, ZB-V and interleaved 1F1B over uniform splits, pipeline ``pp``, at each
    micro-batch count (their transfers per action differ: 1, fewer, more; [Note: host cost per transfer]);
    ``{(schedule, m): (v, compiled order, counts)}``."""
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.layers.partition import uniform_counts
    from lightning_pipe.schedules import compute_order, plan_schedule
    from lightning_pipe.schedules.simulate import compile_order

    probes = {}
    for m in sorted(set(ms)):
        for schedule, v in (("1f1b", 1), ("zbv", 2), ("interleaved_1f1b", 2)):
            plan = plan_schedule(PipelineConfig(schedule=schedule, microbatches=m, stages_per_rank=v), pp)
            compiled = compile_order(compute_order(plan), plan.num_stages)
            probes[(schedule, m)] = (v, compiled, tuple(uniform_counts(base.num_layers, plan.num_stages)))
    return probes


def calibrate(args: argparse.Namespace, base, speeds: list[float], pp: int, ms: list[int]):
    """Probe runs of the real model (:func:`probe_layouts`, ``--probe-repeats`` times each in alternating order) with
    PipelineTimeline, fitted by :func:`fit_calibration`."""
    import torch.distributed as dist

    dp = dist.get_world_size() // pp
    probes = probe_layouts(base, pp, ms)
    runs: dict = {key: [] for key in probes}
    for rep in range(args.probe_repeats):
        for schedule, m in sorted(probes, reverse=bool(rep % 2)):
            v, _, counts = probes[(schedule, m)]
            _, _, records, steps = measure(args, schedule, v, m, counts, dp)
            runs[(schedule, m)].append(gather((steps, records)))
    return fit_calibration(args, base, speeds, pp, probes, runs)


def fit_calibration(args: argparse.Namespace, base, speeds: list[float], pp: int, probes: dict, runs: dict):
    """The profile ``base`` fitted to the probe layouts' runs. ``runs[(schedule, m)]``: per run, every rank's (full
    step durations, timeline record dicts). Read at each probe's fastest step: per micro-batch size the layers'
    in-run scale per kind, and the strategy's cost per action at this model's sizes (the mean over the sizes)
    (:func:`~lightning_pipe.planner.calibrate.fit_action_costs`, each action read at its least-disturbed run), and
    the trainer's own per-step cost (full step - schedule step - predicted optimizer and all-reduce, of the same
    least-disturbed step). Also the profile's drift per kind, for the report, and each probe's fastest step."""
    import dataclasses

    import torch.distributed as dist

    from lightning_pipe.planner import to_plan
    from lightning_pipe.planner.calibrate import fit_action_costs, fit_host_costs
    from lightning_pipe.planner.drift import drift_by_kind, merge, scale_layers
    from lightning_pipe.planner.model import Candidate, CostModel, bounds_of, predict
    from lightning_pipe.planner.search import SearchResult, slowness_per_pipeline_rank

    dp = dist.get_world_size() // pp
    slowness = slowness_per_pipeline_rank(speeds, pp, dp)
    # the fastest whole step of each probe (every rank's record of it), as the grid's layouts are measured
    fastest = {key: min((fastest_step(everyone) for everyone in runs[key]), key=lambda found: found[0])
               for key in probes}
    # per micro-batch size: each size's layers were profiled at their own moment, and run at their own speed
    layers, fits = dict(base.layers), {}
    for m in sorted({m for _, m in probes}):
        n = args.batch // dp // m
        layers_only = CostModel(base, n, slowness, action_overhead=0.0)
        fits[m] = fit_action_costs([(fastest[key][1], layers_only.stage_costs(bounds_of(counts), compiled.stage_rank))
                                    for key, (_, compiled, counts) in probes.items() if key[1] == m])
        layers[n] = scale_layers(dataclasses.replace(base, layers={n: base.layers[n]}), fits[m][0]).layers[n]
    # host time per action and per transfer: one fit over every probe (their mixes of actions and transfers differ,
    # [Note: host cost per transfer]; one micro-batch count's probes alone barely tell the two apart)
    around, per_transfer = fit_host_costs([fastest[key][1] for key in probes])
    per_action = statistics.fmean(inside for _, inside, _, _ in fits.values()) + around
    # The fitted host time around an action is the real schedule's wall time beyond its compute and waits, per action
    # and per transfer: it already holds the per-micro-batch host work the tiny probe measured (step_costs), so that
    # is not added again.
    calibrated = dataclasses.replace(base, layers=layers, action_overhead=per_action, transfer_overhead=per_transfer,
                                     microbatch_overhead=0.0)
    tables, extra, steps = [], [], {}
    for (schedule, m), (v, compiled, counts) in probes.items():
        raw = predict(CostModel(base, args.batch / dp / m, slowness), compiled, counts, dp)
        plan_json = to_plan(SearchResult([(Candidate(pp, dp, schedule, v, m, counts), raw)]), args.batch)
        tables.append(drift_by_kind(plan_json, fastest[(schedule, m)][1]))
        pred = predict(CostModel(calibrated, args.batch / dp / m, slowness), compiled, counts, dp)
        outside = min(least_outside(everyone) for everyone in runs[(schedule, m)])
        extra.append(outside - (pred.step_time - pred.schedule_time))  # beyond the fixed cost
        # per run the slowest rank's fastest step; over the runs the least disturbed
        steps[json.dumps([pp, schedule, v, m, list(counts)])] = min(max(min(durations) for durations, _ in everyone)
                                                                    for everyone in runs[(schedule, m)])
    step_overhead = max(base.step_overhead + statistics.median(extra), 0.0)
    return dataclasses.replace(calibrated, step_overhead=step_overhead), merge(*tables), fits, steps


def step_costs(args: argparse.Namespace, pp: int, ms: list[int],
                latency: float) -> tuple[float, float, float, float]:
    """The strategy's cost per action and its fixed and per-micro-batch step costs: 1F1B over one tiny layer per
    stage at the grid's smallest and largest micro-batch counts, each run twice (m1, m2, m2, m1: a slow phase
    meets both counts alike); the timelines give the cost per action ([Note: the strategy's cost per action, from
    its own timeline]), then the slowest rank's fastest step per count the fixed and per-micro-batch costs
    ([Note: fixed and per-micro-batch step costs]). Returns (fixed, per micro-batch, per action inside its slice,
    per action around it), seconds."""
    import torch
    import torch.distributed as dist

    from lightning_pipe.planner import profile_model
    from lightning_pipe.planner.calibrate import action_cost_from_records, solve_step_costs
    from lightning_pipe.trace.records import StepRecord

    world = dist.get_world_size()
    counts = sorted({min(ms), max(ms)})
    rows = {m: args.batch // (world // pp) // m for m in counts}
    # the tiny layers' own time, so that only the step's host costs are left to solve for
    tiny = profile_model(residual_mlp(4, 1), (torch.zeros(args.batch, 4), torch.zeros(args.batch, 4)),
                         sorted(set(rows.values())), repeats=args.repeats)
    layer_time = {m: {"F": tiny.layers[rows[m]][0].forward, "B": tiny.layers[rows[m]][0].backward} for m in counts}
    measured: dict[int, float] = {}
    records = []
    for m in counts + counts[::-1]:
        step, _, recs = measure(args, "1f1b", 1, m, tuple([1] * pp), world // pp, probe=True)[:3]
        everyone = gather((step, recs))
        measured[m] = min(measured.get(m, float("inf")), max(e[0] for e in everyone))
        records += [StepRecord.from_dict(r) for e in everyone for r in e[1]]
    inside, around = action_cost_from_records(records, layer_time)
    fixed, per_mb = solve_step_costs("1f1b", pp, 1, measured, inside + around, latency, layer_time)
    return fixed, per_mb, inside, around


def fastest_step(per_rank: list) -> tuple[float, list]:
    """The least-disturbed whole step of one run: (its time as the slowest rank saw it, every rank's StepRecord of
    it). ``per_rank``: each rank's (full step durations, timeline record dicts). The fastest of each action on its
    own would sum to a step no run takes when slow phases come and go within a step."""
    from lightning_pipe.trace.records import StepRecord

    n = min(min(len(steps), len(records)) for steps, records in per_rank)
    j = min(range(n), key=lambda j: max(steps[j] for steps, _ in per_rank))
    return max(steps[j] for steps, _ in per_rank), [StepRecord.from_dict(records[j]) for _, records in per_rank]


def replay_measured(everyone: list, compiled, comm: list[float]) -> tuple[float, float]:
    """(measured schedule step, the replay of the same step from its measured actions) in seconds, at the fastest
    whole step of one layout. ``everyone``: per rank, its list of (full step durations, timeline record dicts) per
    round. The replay takes each (stage, kind)'s mean measured slice plus the mean host time around an action (the
    schedule's wall time minus compute and blocking waits, per action) and the cost model's link: if it lands on the
    measured step, the model's structure (order, dependencies, communication) is right and any prediction error is
    in the costs it was given."""
    from lightning_pipe.planner.calibrate import split_step
    from lightning_pipe.schedules.simulate import replay

    _, records = min((fastest_step([e[rnd] for e in everyone]) for rnd in range(min(len(e) for e in everyone))),
                     key=lambda found: found[0])
    spent: dict[tuple[int, str], float] = {}
    around = []
    for rec in records:
        slices, per_action, _ = split_step(rec)
        for (stage, kind, _), seconds in slices.items():
            spent[(stage, kind)] = spent.get((stage, kind), 0.0) + seconds
        around.append(0.0 if per_action is None else per_action)
    # per micro-batch: each (stage, kind)'s time over the step / m, plus the host time around one action
    m, host = compiled.microbatches, statistics.fmean(around)
    cost = {(s, k): spent[(s, k)] / m + host if (s, k) in spent else 0.0
            for s in range(compiled.num_stages) for k in "FBIW"}
    return max(r.wall_ns for r in records) / 1e9, replay(compiled, cost, comm).makespan
