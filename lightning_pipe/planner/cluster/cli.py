"""``python -m lightning_pipe.planner project``: predict layouts of a described cluster, best first.

    python -m lightning_pipe.planner project --model MODEL.json --cluster a100-80gb-hdr --gpus 512 \\
        --global-batch 1536 [--layout "tp=8,pp=2"] [--top 5] [--json] [--emit-config configs/experiment/x.yaml]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_pipe.planner.cluster.layout import complete, parse_layout
from lightning_pipe.planner.cluster.presets import CLUSTERS, STACKS
from lightning_pipe.planner.cluster.project import Projection, Projector
from lightning_pipe.planner.cluster.search import SearchOutcome, search
from lightning_pipe.planner.cluster.sources import load_cluster, load_model, load_stack


def add_parser(sub: Any) -> None:
    """Register ``project`` on the planner's sub-command parser."""
    p = sub.add_parser("project", help="predict layouts, step time and memory on a described GPU cluster",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model JSON, a recipe's configs/model/*.yaml, or a transformers "
                   "config.json")
    p.add_argument("--cluster", required=True, help=f"cluster JSON or a preset: {', '.join(sorted(CLUSTERS))}")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--layout", default=None, help='"tp=8,pp=12,dp=4,mbs=1,v=1,schedule=1f1b,recompute=full,zero=1"'
                   ": all fields -> one prediction; some -> the best layouts that agree; none -> every layout")
    p.add_argument("--top", type=int, default=5, help="how many layouts to list")
    p.add_argument("--json", action="store_true", help='print {"ranked": [...]} instead of a table')
    p.add_argument("--emit-config", default=None, help="write the best layout as a Hydra experiment of the GPT "
                   "recipe (e.g. configs/experiment/my_cluster.yaml)")
    p.add_argument("--stack", default="lightning_pipe", help=f"software stack: {', '.join(sorted(STACKS))} or a "
                   "JSON of its fields (default: this library's recipes)")
    p.add_argument("--gpus", type=int, default=None, help="the cluster's GPU count (replaces the file's)")
    p.add_argument("--seq", type=int, default=None, help="the training sequence length (replaces the model's)")
    p.set_defaults(fn=run)


class _Bar:
    """A progress bar on stderr for searches that replay many layouts (only on a terminal)."""

    def __init__(self) -> None:
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] replayed {done} of up to {total} layouts")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def run(args: argparse.Namespace) -> None:
    model = load_model(args.model, args.seq)
    projector = Projector(model, load_cluster(args.cluster, args.gpus), args.global_batch, load_stack(args.stack))
    fields = parse_layout(args.layout)
    layout = complete(fields)
    outcome: SearchOutcome | None = None
    if layout is not None:
        ranked = [projector.predict(layout)]
    else:
        bar = _Bar()
        outcome = search(projector, fields, max(1, args.top), None if args.json else bar)
        bar.close()
        ranked = outcome.ranked
    if args.json:
        print(json.dumps(_as_json(ranked, outcome), indent=1))
    else:
        print(_table(projector, ranked, outcome))
    if args.emit_config:
        if not ranked:
            raise SystemExit("--emit-config: no layout fits, nothing written")
        how = write_experiment_lines(ranked[0], projector, args.emit_config)
        print(f"wrote {args.emit_config}; run it with:", *how, sep="\n  ", file=sys.stderr if args.json else sys.stdout)


def write_experiment_lines(projection: Projection, projector: Projector, path: str) -> list[str]:
    from lightning_pipe.planner.cluster.emit import write_experiment

    return write_experiment(projection, projector, path)


def _as_json(ranked: list[Projection], outcome: SearchOutcome | None) -> dict[str, Any]:
    out: dict[str, Any] = {"ranked": [p.as_json() for p in ranked]}
    if outcome is not None:
        out["search"] = {"layouts": outcome.layouts, "replayed": outcome.replayed, "seconds": round(outcome.seconds, 2)}
        if not ranked and outcome.best_refused is not None:
            out["fastest_not_fitting"] = outcome.best_refused.as_json()
    return out


def _table(projector: Projector, ranked: list[Projection], outcome: SearchOutcome | None) -> str:
    c, m = projector.cluster, projector.model
    head = (f"{m.name}: {m.layers} layers x {m.hidden}, {m.heads} heads, seq {m.seq}, vocab {m.vocab} "
            f"({m.params / 1e9:.3g} B parameters) on {c.name}: {c.gpus} GPUs, {c.gpus_per_node} per node, "
            f"global batch {projector.global_batch}, stack {projector.stack.name}")
    lines = [head]
    if outcome is not None:
        lines.append(f"searched {outcome.layouts} layouts, replayed {outcome.replayed} in {outcome.seconds:.1f} s")
    lines.append(f"{'#':>2} {'step s':>9} {'TFLOP/s':>8} {'MFU':>6} {'GiB/GPU':>8} {'fits':>5} {'bubble':>7}  layout")
    for i, p in enumerate(ranked, 1):
        lines.append(f"{i:>2} {p.iteration_s:>9.4g} {p.model_tflops_per_gpu:>8.4g} {p.mfu:>6.1%} "
                     f"{p.memory_bytes / 2**30:>8.1f} {'yes' if p.fits else 'NO':>5} {p.bubble:>7.1%}  "
                     f"{p.layout.line()}  split {list(p.counts)}")
    if not ranked and outcome is not None and outcome.best_refused is not None:
        r = outcome.best_refused
        lines.append(f"no layout fits in {c.memory_gib:g} GiB; the fastest needs {r.memory_bytes / 2**30:.1f} GiB: "
                     f"{r.layout.line()}")
    return "\n".join(lines)
