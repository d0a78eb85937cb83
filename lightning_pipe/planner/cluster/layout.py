"""A layout on a cluster: tensor x pipeline x data parallel sizes, micro-batch size, stages per rank, schedule,
recomputation, ZeRO; parsed from ``"tp=8,pp=12,dp=4,mbs=1,v=1,schedule=1f1b,recompute=full,zero=1"``."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, SpecError, Stack, spec_error
from lightning_pipe.schedules import SchedulePlan, plan_schedule

FIELDS = ("tp", "pp", "dp", "mbs", "v", "schedule", "recompute", "zero")
INT_FIELDS = ("tp", "pp", "dp", "mbs", "v", "zero")
SPLITS = ("balanced", "uniform")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    mbs: int
    """Sequences per micro-batch."""
    v: int
    """Stages per pipeline rank."""
    schedule: str
    recompute: str
    """``none``, ``selective`` (the attention core) or ``full`` (whole layers)."""
    zero: int
    """1: optimizer state and fp32 weights sharded over the data-parallel replicas (ZeRO-1)."""
    split: str = "balanced"
    """``balanced``: layers cut by predicted time (the head's stage takes fewer blocks); ``uniform``: the blocks
    evenly, the embedding with the first stage and the norm and head with the last (Megatron)."""

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    def line(self) -> str:
        """``tp=8,pp=12,dp=4,mbs=1,v=1,schedule=1f1b,recompute=full,zero=1`` (``--layout``'s own form)."""
        return ",".join(f"{k}={getattr(self, k)}" for k in FIELDS)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (*FIELDS, "split")}


def parse_layout(text: str | None) -> dict[str, Any]:
    """``"tp=8,pp=12"`` -> ``{"tp": 8, "pp": 12}``; any subset of the fields (and ``split``)."""
    out: dict[str, Any] = {}
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or key not in (*FIELDS, "split"):
            raise spec_error(f"A layout is key=value pairs of {', '.join(FIELDS)} (and split).", f"{part!r}",
                             "--layout")
        if key in INT_FIELDS:
            if not value.isdigit() or int(value) < (0 if key == "zero" else 1):
                raise spec_error(f"Layout field {key} is a positive integer (zero: 0 or 1).", f"{key}={value!r}",
                                 "--layout")
            out[key] = int(value)
        else:
            out[key] = value.lower()
    return out


def plan_of(layout: Layout, global_batch: int) -> SchedulePlan:
    """The schedule's plan (stages, micro-batches), or the schedule's own rule as a :class:`SpecError`."""
    plan = _plan(layout.schedule, layout.pp, layout.v, layout.microbatches(global_batch))
    if isinstance(plan, str):
        raise SpecError(f"Layout {layout.line()}: {plan}")
    return plan


@functools.lru_cache(maxsize=4096)
def _plan(schedule: str, pp: int, v: int, microbatches: int) -> SchedulePlan | str:
    """Plans are cached: some schedules build and check their action lists to plan (V-Half, V-Min: 0.1 s)."""
    try:
        return plan_schedule(PipelineConfig(schedule=schedule, microbatches=microbatches, stages_per_rank=v), pp)
    except PipelineConfigError as err:
        return str(err)


def check_layout(layout: Layout, model: ModelSpec, cluster: ClusterSpec, stack: Stack, global_batch: int) -> None:
    """Refuse a layout the cluster, the model, the batch or the stack cannot run, naming the rule."""
    line, change = layout.line(), "--layout (or --cluster / --global-batch)"
    if layout.tp * layout.pp * layout.dp != cluster.gpus:
        raise spec_error("tp x pp x dp is the cluster's GPU count.", f"{line} on {cluster.gpus} GPUs", change)
    if cluster.gpus_per_node % layout.tp and layout.tp > 1:
        raise spec_error("Tensor parallelism stays inside a node: tp divides gpus_per_node.",
                         f"tp={layout.tp}, gpus_per_node={cluster.gpus_per_node}", "tp in --layout")
    if model.heads % layout.tp or model.kv_heads % layout.tp:
        raise spec_error("tp divides the attention heads (and the key/value heads).",
                         f"tp={layout.tp}, heads={model.heads}, kv_heads={model.kv_heads}", "tp in --layout")
    if global_batch % (layout.dp * layout.mbs):
        raise spec_error("The global batch divides into dp x mbs sequences per micro-batch round.",
                         f"global batch {global_batch}, dp={layout.dp}, mbs={layout.mbs}", "dp or mbs in --layout")
    if layout.pp * layout.v > model.layers + 3:
        raise spec_error("Every stage needs a layer: pp x v is at most the layer count (blocks + 3).",
                         f"pp={layout.pp}, v={layout.v}, {model.layers} blocks", "pp or v in --layout")
    if layout.split == "uniform" and model.layers % (layout.pp * layout.v):
        raise spec_error("A uniform split gives every stage as many blocks: pp x v divides the block count.",
                         f"pp={layout.pp}, v={layout.v}, {model.layers} blocks", "split=balanced or pp / v")
    if layout.split not in SPLITS:
        raise spec_error(f"split is one of {SPLITS}.", f"split={layout.split!r}", "split in --layout")
    if layout.recompute not in stack.recompute_modes:
        raise spec_error(f"Stack {stack.name!r} recomputes {list(stack.recompute_modes)}.",
                         f"recompute={layout.recompute!r}", "recompute in --layout (or --stack)")
    if layout.zero not in stack.zero_modes:
        raise spec_error(f"Stack {stack.name!r} supports zero in {list(stack.zero_modes)}.", f"zero={layout.zero}",
                         "zero in --layout (or --stack)")
    plan = plan_of(layout, global_batch)
    if (layout.zero and model.tied_embeddings and not stack.zero_tied_on_one_rank
            and plan.stage_to_rank(0) == plan.stage_to_rank(plan.num_stages - 1)):
        raise spec_error(f"Stack {stack.name!r} cannot shard (ZeRO-1 / FSDP) tied embeddings whose two ends share a "
                         "rank, as V schedules place them.", f"{line}", "zero=0 or the schedule in --layout")


def complete(fields: dict[str, Any]) -> Layout | None:
    """A :class:`Layout` when every field is given, else ``None`` (a partial layout constrains a search)."""
    if not all(k in fields for k in FIELDS):
        return None
    return Layout(**{k: fields[k] for k in FIELDS}, split=fields.get("split", "balanced"))


def replace(layout: Layout, **changes: Any) -> Layout:
    return dataclasses.replace(layout, **changes)
