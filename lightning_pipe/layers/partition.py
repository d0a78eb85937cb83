"""Pure functions: a layer list (and optional per-layer costs) -> contiguous layer ranges per stage.

No torch.distributed here: everything is plain data so it can be unit-tested and runs identically on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from lightning_pipe.config import PartitionSpec, check_partition, config_error


def uniform_counts(n_layers: int, n_stages: int) -> list[int]:
    """Equal layer counts; the first ``n_layers % n_stages`` stages take one extra layer."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def balanced_counts(costs: Sequence[float], n_stages: int,
                    stage_speed: Sequence[float] | None = None) -> list[int]:
    """Contiguous partition minimising the most expensive stage (every stage gets at least one layer).

    ``stage_speed[s]``: stage ``s`` runs that many times slower (its cost is its layers' sum times it); default 1.
    Exact dynamic programme over prefix sums, O(n_layers^2 * n_stages): layer lists are at most a few hundred
    long. Ties go to the partition whose earlier stages are larger, which keeps the (usually heavier) last stage,
    with head and loss, light.
    """
    speeds = [1.0] * n_stages if stage_speed is None else [float(x) for x in stage_speed]
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: minimal max-cost cutting the first i layers into s stages; cut[s][i]: start of the last stage.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        speed = speeds[s - 1]
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(i - 1, s - 2, -1):  # last stage = layers [j, i); scan so later j win ties
                cand = max(best[s - 1][j], speed * (prefix[i] - prefix[j]))
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    counts, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def partition_layers(n_layers: int, n_stages: int, partition: PartitionSpec,
                     param_counts: Sequence[int] | None = None) -> list[range]:
    """Layer index ranges, one per stage, in stage order."""
    if n_stages > n_layers:
        raise config_error(
            "Every pipeline stage needs at least one layer, so the number of stages "
            "(pipeline size x stages per rank) cannot exceed the number of layers.",
            f"{n_stages} stages for {n_layers} layers", "stages_per_rank",
            "or give the model more layers", also=("data_parallel_size", "devices"))
    partition = check_partition(partition)  # callers of this plain function get the config's checks too
    if isinstance(partition, str):
        if partition == "uniform":
            counts = uniform_counts(n_layers, n_stages)
        elif partition == "parameters":
            if param_counts is None or len(param_counts) != n_layers:
                raise ValueError("partition='parameters' needs one parameter count per layer")
            counts = balanced_counts(param_counts, n_stages)
        else:  # "time" / "memory" are measured on the running ranks (lightning_pipe.planner.balance)
            raise config_error(f"partition={partition!r} is measured at setup by PipelineStrategy (it profiles the "
                               "layers on the ranks), then becomes per-stage layer counts.",
                               f"partition={partition!r} in a plain call to partition_layers", "partition",
                               "pass the counts (lightning_pipe.planner.balance_split computes them)")
    else:
        counts = list(partition)
        if len(counts) != n_stages:
            raise config_error("An explicit partition gives one layer count per stage.",
                               f"{len(counts)} counts {counts} for {n_stages} stages", "partition")
        if sum(counts) != n_layers:
            raise config_error("An explicit partition's layer counts must sum to the number of layers.",
                               f"counts {counts} (sum {sum(counts)}) for {n_layers} layers", "partition")
    return ranges_of(counts)


def ranges_of(counts: Sequence[int]) -> list[range]:
    """Per-stage layer counts -> contiguous layer ranges, in stage order."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def counts_of(ranges: Sequence[range]) -> tuple[int, ...]:
    """Layer ranges -> per-stage layer counts (what a partition, a plan file and a decision are written as)."""
    return tuple(len(r) for r in ranges)


TRAINABLE_WEIGHT = 4
"""What a trainable parameter element counts for ``partition="parameters"`` against a frozen one's 1: the weight,
its gradient and AdamW's two moments, against the weight alone (no gradient, no optimizer state)."""


def layer_param_counts(layers: Iterable[nn.Module]) -> list[int]:
    """Weighted parameters per layer for ``partition="parameters"``: the rule balances the memory parameters cost,
    so a frozen element counts 1 and a trainable one ``TRAINABLE_WEIGHT``; a tied parameter counts once (in its
    first layer). Only the ratio matters: a model with nothing frozen splits as by plain counts."""
    seen: set[int] = set()
    counts = []
    for layer in layers:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        counts.append(sum(p.numel() * (TRAINABLE_WEIGHT if p.requires_grad else 1) for p in fresh))
    return counts


def stage_of(ranges: Sequence[range], layer: int) -> int:
    """The stage whose layer range holds ``layer``."""
    return next(s for s, r in enumerate(ranges) if layer in r)
