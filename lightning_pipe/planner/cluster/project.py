"""Predict one layout on a described cluster: analytic costs, replayed by the planner's schedule simulator.

The stage costs (F / B / I / W per stage, the transfer on every stage boundary) come from the analytic layer costs
(:mod:`~lightning_pipe.planner.cluster.layers`); the schedule's own action order is replayed with them by
:func:`lightning_pipe.schedules.simulate.replay`, the function the profiled planner replays measured costs with, and
the activations each rank holds at once come from the same order (:func:`~lightning_pipe.schedules.simulate.
peak_activations`). Around the schedule: the data-parallel gradient reduction (the part not hidden under the
backward, [Note: gradient reduction under the backward]), the tied embedding's sum between the first and last stage,
and the optimizer step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_pipe.planner.cluster.comm import Links, Placement
from lightning_pipe.planner.cluster.kernels import GPU_EFFICIENCY, Efficiency, Kernels
from lightning_pipe.planner.cluster.layers import LayerCost, LayerModel
from lightning_pipe.planner.cluster.layout import Layout, check_layout, plan_of
from lightning_pipe.planner.cluster.memory import MemoryModel
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, Stack
from lightning_pipe.schedules import compute_order
from lightning_pipe.schedules.simulate import CompiledOrder, compile_order, replay

KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Projection:
    """One layout's predicted step on the cluster."""

    layout: Layout
    counts: tuple[int, ...]
    """Layers per stage (embedding, blocks, final norm, head), in stage order."""
    iteration_s: float
    schedule_s: float
    bubble: float
    memory_bytes: float
    """The fullest GPU's bytes (weights, gradients, optimizer state, activations, buffers, reserve)."""
    memory_parts: dict[str, float]
    fits: bool
    model_tflops_per_gpu: float
    mfu: float
    extra_s: dict[str, float] = field(default_factory=dict)
    """Seconds after the schedule: exposed gradient reduction, tied embedding sum, optimizer step."""

    def as_json(self) -> dict[str, object]:
        return {"layout": self.layout.as_dict(), "iteration_s": round(self.iteration_s, 4),
                "model_tflops_per_gpu": round(self.model_tflops_per_gpu, 2), "mfu": round(self.mfu, 4),
                "memory_gib_per_gpu": round(self.memory_bytes / 2**30, 2), "fits": self.fits,
                "bubble_fraction": round(self.bubble, 4), "partition": list(self.counts),
                "schedule_s": round(self.schedule_s, 4),
                "after_schedule_s": {k: round(v, 4) for k, v in self.extra_s.items()},
                "memory_gib_parts": {k: round(v / 2**30, 2) for k, v in self.memory_parts.items()}}


@dataclass(frozen=True)
class Prepared:
    """A layout's costs before the replay."""

    layout: Layout
    counts: tuple[int, ...]
    stages: list[list[LayerCost]]
    stage_rank: tuple[int, ...]
    cost: dict[tuple[int, str], float]
    """Seconds of one action per (stage, kind), kind in F / B / I / W."""
    comm: list[float]
    """Seconds for stage s's output (or its gradient) to reach the neighbouring stage."""
    extra: dict[str, float]


@functools.lru_cache(maxsize=256)
def compiled_order(schedule: str, pp: int, v: int, m: int) -> CompiledOrder:
    """The schedule's compute order for (pp, v, m), compiled once per process (torch builds it in 0.01-1 s)."""
    layout = Layout(1, pp, 1, 1, v, schedule, "none", 0)
    plan = plan_of(layout, m)
    return compile_order(compute_order(plan, lowered=False), plan.num_stages)


def model_flops(model: ModelSpec, global_batch: int) -> float:
    """Model FLOPs of one step (no recompute): 6 per weight of the blocks' matrices and the head per token, and
    12 x layers x seq x hidden per token for the attention scores (Megatron's count for MHA with ffn = 4h)."""
    h = model.hidden
    up = (2 if model.activation == "swiglu" else 1) * model.ffn
    matrices = h * (h + 2 * model.kv_dim) + h * h + (up + model.ffn) * h
    tokens = global_batch * model.seq
    return tokens * (6.0 * (model.layers * matrices + model.vocab * h) + 12.0 * model.layers * model.seq * h)


@dataclass(frozen=True)
class Projector:
    """Predicts layouts of one (model, cluster, stack, global batch)."""

    model: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    stack: Stack = field(default_factory=Stack)
    eff: Efficiency = GPU_EFFICIENCY

    def layer_model(self, layout: Layout) -> LayerModel:
        kernels = Kernels(self.cluster, self.eff)
        return LayerModel(self.model, self.cluster, self.stack, kernels, Links(self.cluster, self.eff), layout.tp,
                          float(layout.mbs))

    def placement(self, layout: Layout) -> Placement:
        order = self.stack.zero_rank_order if layout.zero else self.stack.rank_order
        return Placement({"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}, tuple(order.split(",")),
                         self.cluster.gpus_per_node)

    def counts(self, layout: Layout, layers: Sequence[LayerCost], stages: int) -> tuple[int, ...]:
        """Layers per stage: ``uniform`` blocks (embedding first, norm and head last), or ``balanced`` by time."""
        if layout.split == "uniform":
            base = [self.model.layers // stages] * stages
            base[0] += 1
            base[-1] += 2
            return tuple(base)
        time = [c.run.f + c.run.i + c.run.w + c.again[layout.recompute] for c in layers]
        return balanced_blocks(self.model.layers, stages, time[1], time[0], time[-2] + time[-1])

    def prepare(self, layout: Layout) -> Prepared:
        """Everything but the replay: layer costs, the split, stage costs and transfers (cheap: no compute order)."""
        plan = plan_of(layout, self.global_batch)
        lm = self.layer_model(layout)
        layers = lm.layers()
        counts = self.counts(layout, layers, plan.num_stages)
        stages = _stages(layers, counts)
        stage_rank = tuple(plan.stage_to_rank(s) for s in range(plan.num_stages))
        placement = self.placement(layout)
        scatter = layout.tp if self.stack.pp_scatter_gather else 1
        comm = [lm.links.send(st[-1].output, placement.same_node("pp", stage_rank[s],
                                                                  stage_rank[min(s + 1, len(stages) - 1)]), scatter)
                for s, st in enumerate(stages)]
        cost = _stage_costs(stages, layout.recompute)
        if self.stack.blocking_p2p:
            _charge_sends(cost, comm, stage_rank)
        extra = self._after_schedule(layout, stage_rank, stages, cost, comm, placement, lm.links)
        return Prepared(layout, counts, stages, stage_rank, cost, comm, extra)

    def predict(self, layout: Layout, check: bool = True) -> Projection:
        """The layout's step: its schedule replayed with the analytic costs, and its memory per GPU."""
        if check:
            check_layout(layout, self.model, self.cluster, self.stack, self.global_batch)
        prep = self.prepare(layout)
        m = layout.microbatches(self.global_batch)
        compiled = compiled_order(layout.schedule, layout.pp, layout.v, m)
        run = replay(compiled, prep.cost, prep.comm)
        iteration = run.makespan + sum(prep.extra.values())
        memory = MemoryModel(self.model, self.cluster, self.stack, layout, m).per_rank(compiled, prep.stages)
        worst = max(memory, key=lambda parts: sum(parts.values()))
        total = sum(worst.values())
        flops = model_flops(self.model, self.global_batch) / (iteration * self.cluster.gpus)
        return Projection(layout, prep.counts, iteration, run.makespan, run.bubble, total, worst,
                          total <= self.cluster.memory_gib * 2**30, flops / 1e12,
                          flops / (self.cluster.peak_tflops * 1e12), prep.extra)

    def _after_schedule(self, layout: Layout, stage_rank: Sequence[int], stages: list[list[LayerCost]],
                        cost: dict[tuple[int, str], float], comm: list[float], placement: Placement,
                        links: Links) -> dict[str, float]:
        """[Note: gradient reduction under the backward]
        A rank's gradients are final during its last backward; with ``dp_overlap`` (the strategy without tensor
        parallelism, Megatron-Core always) their reduction starts then and runs while the backward finishes on this
        rank and travels down to stage 0: the window is this rank's last backward of its lowest stage plus the
        input-gradient chain of the stages below it. Only what outlasts the window adds to the step. ZeRO-1's
        all-gather of the updated weights runs before the next forward (under the first forward with
        ``dp_overlap``). Without overlap both are added.
        """
        ranks = layout.pp
        params = _rank_params(stages, stage_rank, ranks, self.model.tied_embeddings)
        span = placement.span("dp")
        overlap = self.stack.dp_overlap and (layout.tp == 1 or self.stack.dp_overlap_with_tp)
        exposed = 0.0
        for r in range(ranks):
            grads = params[r] * self.stack.reduce_bytes
            if layout.zero:
                reduce = links.reduce_scatter(grads, span)
                gather = links.all_gather(params[r] * self.stack.gather_bytes, span)
            else:
                reduce, gather = links.all_reduce(grads, span), 0.0
            lowest = min(s for s, owner in enumerate(stage_rank) if owner == r)
            window = cost[(lowest, "B")] + sum(cost[(s, "I" if s else "B")] + comm[s] for s in range(lowest))
            first_forward = cost[(lowest, "F")]
            exposed = max(exposed, max(0.0, reduce - window) + max(0.0, gather - first_forward) if overlap
                          else reduce + gather)
        tie = 0.0
        first, last = stage_rank[0], stage_rank[-1]
        if self.model.tied_embeddings and first != last:
            rows = self.model.vocab / (layout.tp if self.stack.vocab_parallel else 1)
            same = placement.same_node("pp", first, last)
            tie = links.all_reduce(rows * self.model.hidden * self.stack.reduce_bytes, (2, 1) if same else (1, 2))
        shard = layout.dp if layout.zero else 1
        kernels = Kernels(self.cluster, self.eff)
        optimizer = kernels.stream(max(params) / shard * self.stack.optimizer_pass_bytes, 4)
        return {"gradient_reduction": exposed, "tied_embedding": tie, "optimizer": optimizer}


def balanced_blocks(blocks: int, stages: int, block: float, first: float, last: float) -> tuple[int, ...]:
    """Layers per stage for ``blocks`` equal blocks of ``block`` seconds, the embedding (``first``) on the first
    stage and the norm and head (``last``) on the last, every stage non-empty, the slowest stage as fast as it can be
    (a bisection on its time; the exact contiguous optimum for equal blocks)."""
    if stages == 1:
        return (blocks + 3,)
    extra = [first] + [0.0] * (stages - 2) + [last]
    least = [0] + [1] * (stages - 2) + [0]  # the first and last stages hold the embedding / the head anyway

    def caps(limit: float) -> list[int]:
        return [max(lo, int((limit - e) / block + 1e-9)) if limit >= e else -1 for e, lo in zip(extra, least)]

    lo, hi = 0.0, max(extra) + blocks * block
    for _ in range(60):
        mid = (lo + hi) / 2
        c = caps(mid)
        lo, hi = (lo, mid) if min(c) >= 0 and sum(c) >= blocks and all(x >= y for x, y in zip(c, least)) else (mid, hi)
    counts = caps(hi)
    while sum(counts) > blocks:  # take the surplus from the most loaded stages
        s = max((i for i in range(stages) if counts[i] > least[i]), key=lambda i: counts[i] * block + extra[i])
        counts[s] -= 1
    counts[0] += 1
    counts[-1] += 2
    return tuple(counts)


def _stages(layers: Sequence[LayerCost], counts: Sequence[int]) -> list[list[LayerCost]]:
    out, start = [], 0
    for n in counts:
        out.append(list(layers[start:start + n]))
        start += n
    return out


def _stage_costs(stages: list[list[LayerCost]], recompute: str) -> dict[tuple[int, str], float]:
    """Per stage F / B / I / W; a recomputed forward runs in B (in I under split backward). Stage 0 runs no I: its
    W is the whole backward (the runtime's rule, as in the profiled model)."""
    cost: dict[tuple[int, str], float] = {}
    for s, layers in enumerate(stages):
        f = sum(c.run.f for c in layers)
        again = sum(c.again[recompute] for c in layers)
        i = sum(c.run.i for c in layers) + again
        w = sum(c.run.w for c in layers)
        cost[(s, "F")], cost[(s, "B")] = f, i + w
        cost[(s, "I")], cost[(s, "W")] = (0.0, i + w) if s == 0 else (i, w)
    return cost


def _charge_sends(cost: dict[tuple[int, str], float], comm: Sequence[float], stage_rank: Sequence[int]) -> None:
    """Blocking sends occupy the sender: a forward pays for sending its output to another rank, a backward (its
    input-gradient part) for sending the gradient back."""
    for s in range(len(stage_rank)):
        if s + 1 < len(stage_rank) and stage_rank[s + 1] != stage_rank[s]:
            cost[(s, "F")] += comm[s]
        if s > 0 and stage_rank[s - 1] != stage_rank[s]:
            cost[(s, "B")] += comm[s - 1]
            cost[(s, "I")] += comm[s - 1]


def _rank_params(stages: list[list[LayerCost]], stage_rank: Sequence[int], ranks: int, tied: bool) -> list[float]:
    """Parameters per pipeline rank; a tied head on the embedding's rank is the same tensor (counted once)."""
    out = [0.0] * ranks
    for s, layers in enumerate(stages):
        out[stage_rank[s]] += sum(c.params for c in layers)
    if tied and stage_rank[0] == stage_rank[-1]:
        out[stage_rank[0]] -= stages[-1][-1].params
    return out
