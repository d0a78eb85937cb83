"""Bytes per GPU of a layout: weights, gradients and optimizer state; the activations its schedule keeps at once;
a recomputed layer's rebuilt activations; receive buffers; a fixed reserve.

The activations come from the schedule's own order: each stage's kept bytes per micro-batch ([Note: activations a
layer keeps] in ``layers.py``, plus the stage's output, which torch's stage holds until its backward) are held from
its forward to its backward (to its weight-gradient step when split), and
:func:`~lightning_pipe.schedules.simulate.peak_activations` gives each rank's most at once: 1F1B's p - r
micro-batches on rank r, GPipe's m, the interleaved and V schedules' own counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.planner.cluster.layers import LayerCost
from lightning_pipe.planner.cluster.layout import Layout
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, Stack
from lightning_pipe.schedules.simulate import CompiledOrder, peak_activations

RESERVE_GIB = 2.0
"""CUDA context, NCCL and cuBLAS workspaces and allocator slack per GPU (about 1-3 GiB measured on A100 / H100)."""


@dataclass(frozen=True)
class MemoryModel:
    model: ModelSpec
    cluster: ClusterSpec
    stack: Stack
    layout: Layout
    microbatches: int

    def held(self, stages: Sequence[Sequence[LayerCost]], outputs: bool = True) -> list[float]:
        """Bytes a stage keeps per micro-batch in flight: what its layers keep for backward and (``outputs``) its
        output, which torch's stage holds until its backward."""
        mode = self.layout.recompute
        return [sum(c.saved[mode] for c in layers) + (layers[-1].output if outputs else 0.0) for layers in stages]

    def params(self, compiled: CompiledOrder, stages: Sequence[Sequence[LayerCost]]) -> list[float]:
        """Parameters per pipeline rank (a tied head on the embedding's rank is the same tensor: counted once)."""
        out = []
        for r in range(len(compiled.ranks)):
            mine = [s for s, owner in enumerate(compiled.stage_rank) if owner == r]
            count = sum(c.params for s in mine for c in stages[s])
            if self.model.tied_embeddings and 0 in mine and len(stages) - 1 in mine:
                count -= stages[-1][-1].params
            out.append(count)
        return out

    def per_rank(self, compiled: CompiledOrder, stages: Sequence[Sequence[LayerCost]]) -> list[dict[str, float]]:
        """Per pipeline rank, its bytes by part."""
        acts = peak_activations(compiled, self.held(stages))
        state = self.stack.param_state_bytes(self.layout.zero, self.layout.dp)
        out = []
        for r, params in enumerate(self.params(compiled, stages)):
            mine = [s for s, owner in enumerate(compiled.stage_rank) if owner == r]
            rebuilt = max((c.whole for s in mine for c in stages[s]), default=0.0) \
                if self.layout.recompute != "none" else 0.0
            out.append({"weights_gradients_optimizer": params * state, "activations": acts[r],
                        "recompute": rebuilt, "receive_buffers": self._buffers(mine, stages),
                        "reserve": RESERVE_GIB * 2**30})
        return out

    def _buffers(self, mine: Sequence[int], stages: Sequence[Sequence[LayerCost]]) -> float:
        """Forward inputs received by every stage but the first, gradients received by every stage but the last:
        one buffer per micro-batch (torch 2.11-2.14 allocate them at setup) or one per transfer in flight."""
        count = self.microbatches if self.stack.recv_buffers == "per_microbatch" else 1
        total = 0.0
        for s in mine:
            if s > 0:
                total += count * stages[s - 1][-1].output
            if s < len(stages) - 1:
                total += count * stages[s][-1].output
        return total
