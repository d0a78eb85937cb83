"""``python -m lightning_pipe.planner profile|search|explain|validate|project``.

    python -m lightning_pipe.planner profile recipes.gpt.model:GPT --kwargs '{"n_layer": 4}' --tokens 256,64 \\
        --micro-batch-sizes 2,8 -o profile.json
    python -m lightning_pipe.planner search profile.json --world 2 --batch-size 32 --memory-budget 2GiB -o plan.json
    python -m lightning_pipe.planner explain plan.json
    python -m lightning_pipe.planner validate plan.json --world 2 --measured-step-ms 310
    python -m lightning_pipe.planner validate plan.json --records timeline/records.json \\
        [--profile profile.json --calibrated-out calibrated.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from lightning_pipe.config import PipelineConfig, PipelineConfigError


def _factory(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"a model is given as module.path:factory (e.g. recipes.gpt.model:GPT); got {spec!r}")
    sys.path.insert(0, str(Path.cwd()))
    return getattr(importlib.import_module(module), attr)


def _profile(args: argparse.Namespace) -> None:
    import torch

    from lightning_pipe.planner.profile import profile_model

    torch.manual_seed(0)
    model = _factory(args.model)(**json.loads(args.kwargs))
    sizes = [int(s) for s in args.micro_batch_sizes.split(",")]
    rows = max(sizes)
    if args.batch:
        batch = _factory(args.batch)(rows)
    elif args.tokens:
        vocab, seq = (int(x) for x in args.tokens.split(","))
        data = torch.randint(0, vocab, (rows, seq + 1))
        batch = (data[:, :-1], data[:, 1:])
    else:
        raise SystemExit("profile needs a sample batch: --tokens VOCAB,SEQ (language models) or --batch module:fn")
    profile = profile_model(model, batch, sizes, layers_attr=args.layers_attr, device=args.device,
                            repeats=args.repeats)
    profile.link_latency, profile.link_bandwidth = args.link_latency_us * 1e-6, args.link_gbps * 1e9
    profile.meta.update(model=args.model, kwargs=json.loads(args.kwargs))
    Path(args.out).write_text(json.dumps(profile.to_json(), indent=1))
    total = {s: sum(c.forward + c.backward for c in cs) * 1e3 for s, cs in profile.layers.items()}
    print(f"profiled {profile.num_layers} layers at micro-batch sizes {sizes}: forward + backward "
          + ", ".join(f"{t:.1f} ms @ {s}" for s, t in total.items()) + f" -> {args.out}")


def _activations(args: argparse.Namespace) -> Any:
    """--recompute / --offload, read and checked as the strategy's settings (an ActivationPolicy)."""
    from lightning_pipe.planner.model import ActivationPolicy

    offload = json.loads(args.offload) if args.offload.lstrip().startswith("[") else args.offload
    return ActivationPolicy.of(PipelineConfig(recompute=args.recompute, offload=offload))


def _search(args: argparse.Namespace) -> None:
    from lightning_pipe.planner.plan import explain, save_plan, to_plan
    from lightning_pipe.planner.profile import ModelProfile
    from lightning_pipe.planner.search import search

    profile = ModelProfile.from_json(json.loads(Path(args.profile).read_text()))
    result = search(profile, args.world, args.batch_size, args.memory_budget,
                    schedules=args.schedules.split(",") if args.schedules else None,
                    speeds=[float(x) for x in args.speeds.split(",")] if args.speeds else None,
                    action_overhead=None if args.action_overhead_ms is None else args.action_overhead_ms * 1e-3,
                    activations=_activations(args))
    plan = to_plan(result, args.batch_size, args.top_k, profile=args.profile)
    save_plan(plan, args.out)
    print(explain(plan))
    print(f"-> {args.out}")


def _explain(args: argparse.Namespace) -> None:
    from lightning_pipe.planner.plan import explain, load_plan

    print(explain(load_plan(args.plan)))


def _validate(args: argparse.Namespace) -> None:
    from lightning_pipe.planner.plan import apply_plan, load_plan

    kwargs = apply_plan(args.plan, args.world, args.layers)
    print("valid: PipelineStrategy(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")")
    plan = load_plan(args.plan)
    if args.measured_step_ms is not None:
        pred = plan["predicted_step_ms"]
        drift = (args.measured_step_ms - pred) / pred
        print(f"step: predicted {pred:.1f} ms, measured {args.measured_step_ms:.1f} ms, drift {drift:+.1%}")
    if args.records:
        _drift(args, plan)


def _drift(args: argparse.Namespace, plan: dict[str, Any]) -> None:
    from lightning_pipe.planner.drift import calibrate, drift_by_kind, format_drift
    from lightning_pipe.planner.profile import ModelProfile
    from lightning_pipe.trace.records import load_records

    records, meta = load_records(args.records)
    layout = (meta.get("schedule"), meta.get("m"), meta.get("v"))
    if layout != (plan["schedule"], plan["microbatches"], plan["stages_per_rank"]):
        raise SystemExit(f"the records are of schedule={layout[0]} m={layout[1]} v={layout[2]}, the plan is "
                         f"{plan['layout']}: record a run of this plan (PipelineStrategy(plan=...) + "
                         "PipelineTimeline(export_dir=...))")
    counts, partition = meta.get("counts"), plan["partition"]
    if counts is not None and meta.get("counts_at_end", counts) != counts:
        raise SystemExit(f"the records span a rebalance (split {counts} -> {meta['counts_at_end']}): their steps ran "
                         "on two splits. Record a run of this plan without rebalance_every_n_steps.")
    if counts is not None and isinstance(partition, list) and list(counts) != list(partition):
        raise SystemExit(f"the records are of the split {counts}, the plan's is {partition}: record a run of this "
                         "plan (PipelineStrategy(plan=...) + PipelineTimeline(export_dir=...))")
    rows = drift_by_kind(plan, records)
    print(f"drift of {len(records)} recorded rank-steps against the plan ({plan['layout']}):")
    print(format_drift(rows))
    if args.profile and args.calibrated_out:
        profile = calibrate(ModelProfile.from_json(json.loads(Path(args.profile).read_text())), rows)
        Path(args.calibrated_out).write_text(json.dumps(profile.to_json(), indent=1))
        print(f"calibrated profile (F/B/I/W x {profile.meta['calibrated']}) -> {args.calibrated_out}; "
              "search it again for a plan with in-run costs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure a model's layers")
    p.add_argument("model", help="module.path:factory, e.g. recipes.gpt.model:GPT")
    p.add_argument("--kwargs", default="{}", help="JSON keyword arguments of the factory")
    p.add_argument("--tokens", help="VOCAB,SEQ: a random token batch (language models)")
    p.add_argument("--batch", help="module.path:fn(rows) -> a batch the module's split_batch accepts")
    p.add_argument("--micro-batch-sizes", default="1,4")
    p.add_argument("--layers-attr", default="layers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--link-latency-us", type=float, default=50.0, help="point-to-point latency (measure_link)")
    p.add_argument("--link-gbps", type=float, default=1.0, help="point-to-point bandwidth, GB/s")
    p.add_argument("-o", "--out", default="profile.json")
    p.set_defaults(fn=_profile)
    s = sub.add_parser("search", help="find the fastest layout that fits")
    s.add_argument("profile")
    s.add_argument("--world", type=int, required=True, help="number of devices")
    s.add_argument("--batch-size", type=int, required=True, help="global batch per optimizer step")
    s.add_argument("--memory-budget", default=None, help="per device, e.g. 20GiB")
    s.add_argument("--schedules", default=None, help="comma-separated (default: all)")
    s.add_argument("--speeds", default=None, help="slowness per rank, e.g. 1,1.5")
    s.add_argument("--recompute", default="none", help="as strategy.recompute: none, all or k (its memory and time)")
    s.add_argument("--offload", default="none",
                   help="as strategy.offload: none, all, k or a JSON list of layer indices such as [1,3]")
    s.add_argument("--action-overhead-ms", type=float, default=None,
                   help="runtime cost per stage call (default: the profile's measured one)")
    s.add_argument("--top-k", type=int, default=3)
    s.add_argument("-o", "--out", default="plan.json")
    s.set_defaults(fn=_search)
    e = sub.add_parser("explain", help="print a plan")
    e.add_argument("plan")
    e.set_defaults(fn=_explain)
    v = sub.add_parser("validate", help="check a plan against a world / model; compare with a measured step")
    v.add_argument("plan")
    v.add_argument("--world", type=int, default=None)
    v.add_argument("--layers", type=int, default=None)
    v.add_argument("--measured-step-ms", type=float, default=None)
    v.add_argument("--records", default=None, help="PipelineTimeline's records.json of a run of this plan: the "
                   "drift per action kind")
    v.add_argument("--profile", default=None, help="with --records: the profile the plan was searched from")
    v.add_argument("--calibrated-out", default=None, help="with --records and --profile: write the profile "
                   "scaled to the recorded costs")
    v.set_defaults(fn=_validate)
    from lightning_pipe.planner.cluster.cli import add_parser as add_project_parser

    add_project_parser(sub)  # project: a described GPU cluster, analytic costs (docs/planner.md)
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except PipelineConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
