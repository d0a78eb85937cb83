"""The cost model: a candidate layout (pipeline x replicas, schedule, v, m, layer counts) + a profile -> a prediction.

Compute: per stage, the sum of its layers' measured F / B / I / W at the micro-batch size, times the slowness of
the rank holding it, plus the runtime's measured cost per action (``ModelProfile.action_overhead``) and per
cross-rank transfer the action posts (``transfer_overhead``); stage 0 runs no I (the runtime's W there is the whole
backward). Communication: latency + output bytes / bandwidth for every stage boundary that crosses ranks. Both are
replayed over the schedule's own action order (:func:`lightning_pipe.schedules.simulate.replay`). Replicas add a
ring all-reduce of each rank's gradients after the step, then every rank runs its optimizer step. Host costs the
layers do not show ([Note: fixed and per-micro-batch step costs] in ``calibrate.py``): ``step_overhead`` once per
step, ``microbatch_overhead`` per micro-batch, on top of the schedule's replay. Memory per rank: parameters +
gradients + optimizer state of its layers, plus the activations its schedule holds at once
(:func:`~lightning_pipe.schedules.simulate.peak_activations`), after ``recompute`` and ``offload``
(:class:`ActivationPolicy`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_pipe.config import LayerChoice, PipelineConfig
from lightning_pipe.layers.partition import ranges_of
from lightning_pipe.planner.profile import LayerCost, ModelProfile
from lightning_pipe.schedules.simulate import CompiledOrder, peak_activations, replay

KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    pipeline_size: int
    data_parallel_size: int
    schedule: str
    stages_per_rank: int
    microbatches: int
    counts: tuple[int, ...]
    """Layers per stage, in stage order."""


@dataclass(frozen=True)
class Prediction:
    step_time: float
    """Seconds per optimizer step (one batch), including the replicas' gradient all-reduce."""
    bubble: float
    """Idle fraction of the pipeline ranks during the schedule (compute only)."""
    peak_memory: tuple[int, ...]
    """Bytes per pipeline rank: parameters + gradients + optimizer state + peak activations."""
    busy: tuple[float, ...]
    schedule_time: float = 0.0
    """Seconds of the schedule's ``step()`` alone (what ``PipelineTimeline`` measures as ``pipeline/step_ms``)."""
    costs: Mapping[tuple[int, str], float] = field(default_factory=dict)
    """Predicted seconds of one action per (stage, kind), kind in F / B / I / W (per-action overhead included)."""
    comm: tuple[float, ...] = ()
    """Predicted seconds for stage s's output to reach stage s + 1 (0 when both sit on one rank)."""


@dataclass(frozen=True)
class ActivationPolicy:
    """Which layers are recomputed and which offloaded: what a stage keeps on its device per micro-batch.

    [Note: recompute and offload in the cost model]
    Per layer of a stage, on the device between its forward and its backward: a kept layer holds what autograd
    saves (the profile's ``saved_bytes``); a recomputed one only its input (the previous layer's output; for a
    stage's first layer nothing more, the stage holds its input anyway); an offloaded one nothing (recomputed and
    offloaded: its input is on the host too). Recomputation re-runs the layer's forward in its backward (in I
    under split backward, where its saved tensors are first needed). Not modelled: the transient of a recomputed
    layer's activations during its own backward, and offload's host copies (on the compute stream: on a GPU about
    2 x saved bytes / host link bandwidth per layer per micro-batch; nothing on a CPU device).
    """

    recompute: LayerChoice = field(default_factory=LayerChoice)
    offload: LayerChoice = field(default_factory=LayerChoice)

    @classmethod
    def of(cls, config: PipelineConfig) -> ActivationPolicy:
        return cls(config.recompute_layers, config.offload_layers)

    def __bool__(self) -> bool:
        return bool(self.recompute) or bool(self.offload)


class CostModel:
    """Stage costs for one (profile, micro-batch size, per-pipeline-rank slowness); cheap to query per split."""

    def __init__(self, profile: ModelProfile, micro_batch: float, slowness: Sequence[float],
                 action_overhead: float | None = None, activations: ActivationPolicy | None = None) -> None:
        self.activations = activations or ActivationPolicy()
        self.layers: list[LayerCost] = profile.at(micro_batch)
        self.profile = profile
        self.slowness = list(slowness)
        # per action, on top of the layers: measured with the profile unless given
        self.overhead = profile.action_overhead if action_overhead is None else action_overhead
        self.prefix = {k: _prefix([_kind(c, k) for c in self.layers]) for k in KINDS}
        self.prefix["saved"] = _prefix([c.saved_bytes for c in self.layers])
        self.prefix["params"] = _prefix([c.param_bytes for c in self.layers])
        self.prefix["optimizer"] = _prefix([c.optimizer_step for c in self.layers])

    def _sum(self, key: str, lo: int, hi: int) -> float:
        p = self.prefix[key]
        return p[hi] - p[lo]

    def stage_costs(self, bounds: Sequence[tuple[int, int]], stage_rank: Sequence[int]) -> dict[tuple[int, str], float]:
        cost = {}
        per_transfer = self.profile.transfer_overhead
        for s, (lo, hi) in enumerate(bounds):
            slow = self.slowness[stage_rank[s]]
            again = self._recomputed_forward(lo, hi)
            full = self._sum("B", lo, hi) + again
            split = (0.0, full) if s == 0 else (self._sum("I", lo, hi) + again, self._sum("W", lo, hi))
            values = (self._sum("F", lo, hi), full, *split)
            posted = transfers(s, stage_rank) * per_transfer  # F, B and I post theirs; W none
            for kind, value in zip(KINDS, values):
                cost[(s, kind)] = slow * value + self.overhead + (posted if kind != "W" else 0.0)
        return cost

    def comm(self, bounds: Sequence[tuple[int, int]]) -> list[float]:
        p = self.profile
        return [p.link_latency + self.layers[hi - 1].output_bytes / p.link_bandwidth for _, hi in bounds]

    def _recomputed_forward(self, lo: int, hi: int) -> float:
        choice = self.activations.recompute
        if not choice:
            return 0.0
        return sum(self.layers[i].forward for j, i in enumerate(range(lo, hi)) if choice.picks(j, i))

    def held(self, bounds: Sequence[tuple[int, int]]) -> list[float]:
        """Activation bytes a stage holds on its device per micro-batch in flight: what autograd saves (after
        recompute and offload, [Note: recompute and offload in the cost model]), plus its output."""
        if not self.activations:
            return [self._sum("saved", lo, hi) + self.layers[hi - 1].output_bytes for lo, hi in bounds]
        recompute, offload = self.activations.recompute, self.activations.offload
        out = []
        for lo, hi in bounds:
            total = float(self.layers[hi - 1].output_bytes)
            for j, i in enumerate(range(lo, hi)):
                if offload.picks(j, i):
                    continue
                if recompute.picks(j, i):
                    total += self.layers[i - 1].output_bytes if j > 0 else 0
                else:
                    total += self.layers[i].saved_bytes
            out.append(total)
        return out

    def static_memory(self, bounds: Sequence[tuple[int, int]], stage_rank: Sequence[int], ranks: int) -> list[float]:
        factor = 2.0 + self.profile.optimizer_state_factor  # parameters, gradients, optimizer state
        out = [0.0] * ranks
        for s, (lo, hi) in enumerate(bounds):
            out[stage_rank[s]] += factor * self._sum("params", lo, hi)
        return out

    def optimizer(self, bounds: Sequence[tuple[int, int]], stage_rank: Sequence[int], ranks: int) -> float:
        """The optimizer step after the schedule: the slowest rank's."""
        out = [0.0] * ranks
        for s, (lo, hi) in enumerate(bounds):
            out[stage_rank[s]] += self.slowness[stage_rank[s]] * self._sum("optimizer", lo, hi)
        return max(out)

    def allreduce(self, bounds: Sequence[tuple[int, int]], stage_rank: Sequence[int], ranks: int, dp: int) -> float:
        """Ring all-reduce of the gradients of the slowest-to-sync pipeline rank across ``dp`` replicas."""
        if dp <= 1:
            return 0.0
        grads = [0.0] * ranks
        for s, (lo, hi) in enumerate(bounds):
            grads[stage_rank[s]] += self._sum("params", lo, hi)
        p = self.profile
        return max(2 * (dp - 1) / dp * g / p.link_bandwidth + 2 * (dp - 1) * p.link_latency for g in grads)


def _kind(c: LayerCost, kind: str) -> float:
    return {"F": c.forward, "B": c.backward, "I": c.input_grad, "W": c.weight_grad}[kind]


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + float(v))
    return out


def bounds_of(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Per-stage layer counts -> (first, end) layer bounds (:func:`~lightning_pipe.layers.partition.ranges_of`)."""
    return [(r.start, r.stop) for r in ranges_of(counts)]


def transfers(stage: int, stage_rank: Sequence[int]) -> int:
    """Cross-rank transfers one forward, backward or input-gradient action of ``stage`` posts on its rank: a receive
    and a send for each neighbouring stage held by another rank (a weight-gradient action posts none)."""
    here = stage_rank[stage]
    return ((stage > 0 and stage_rank[stage - 1] != here)
            + (stage + 1 < len(stage_rank) and stage_rank[stage + 1] != here))


def action_counts(compiled: CompiledOrder) -> list[dict[tuple[int, str], int]]:
    """Per rank, how many parts of each (stage, kind) it runs: the busy time of a rank is their weighted sum."""
    out = []
    for queue in compiled.ranks:
        n: dict[tuple[int, str], int] = {}
        for parts in queue:
            for stage, kind, _ in parts:
                n[(stage, kind)] = n.get((stage, kind), 0) + 1
        out.append(n)
    return out


def predict(model: CostModel, compiled: CompiledOrder, counts: Sequence[int], dp: int) -> Prediction:
    """Replay one candidate's split over the compiled schedule order."""
    bounds = bounds_of(counts)
    ranks = len(compiled.ranks)
    cost = model.stage_costs(bounds, compiled.stage_rank)
    run = replay(compiled, cost, model.comm(bounds))
    static = model.static_memory(bounds, compiled.stage_rank, ranks)
    acts = peak_activations(compiled, model.held(bounds))
    per_mb = model.profile.microbatch_overhead  # [Note: fixed and per-micro-batch step costs] in calibrate.py
    schedule = run.makespan + (compiled.microbatches * per_mb if per_mb else 0.0)
    step = (schedule + model.allreduce(bounds, compiled.stage_rank, ranks, dp)
            + model.optimizer(bounds, compiled.stage_rank, ranks) + model.profile.step_overhead)
    comm = model.comm(bounds)
    crossing = tuple(c if s + 1 < len(bounds) and compiled.stage_rank[s] != compiled.stage_rank[s + 1] else 0.0
                     for s, c in enumerate(comm))
    return Prediction(step, run.bubble, tuple(int(a + b) for a, b in zip(static, acts)), run.busy, schedule,
                      cost, crossing)
