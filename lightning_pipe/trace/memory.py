"""Measure the activation memory a stage holds: what autograd saves for backward, live, at its peak.

Device-independent (works on CPU, where there is no allocator statistic worth reading): a saved-tensor hook counts
the bytes of every tensor autograd keeps for backward while it is alive, deduplicated by storage, excluding the
stage's own parameters (weights are saved by matmuls but are not activations). The peak over a schedule step is
the activation memory that step needed on this rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class ActivationMeter:
    """Attach to a :class:`~lightning_pipe.runtime.engine.PipelineEngine`; read ``peak_bytes`` after some steps."""

    def __init__(self, params: list[nn.Parameter] | None = None) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, int] = {}
        self._param_storages: set[int] = set()
        self.track_parameters(params or [])

    def track_parameters(self, params: list[nn.Parameter]) -> None:
        """The engine's parameters: a saved tensor sharing their storage is not an activation (set again when the
        engine is rebuilt with other layers, lightning_pipe/rebalance/move.py)."""
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}

    def reset(self) -> None:
        self.peak_bytes = self.live_bytes

    def _acquire(self, key: int, nbytes: int) -> None:
        count = self._refs.get(key, 0)
        self._refs[key] = count + 1
        if count == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int, nbytes: int) -> None:
        count = self._refs[key] - 1
        if count:
            self._refs[key] = count
        else:
            del self._refs[key]
            self.live_bytes -= nbytes

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        meter = self

        class _Saved:
            __slots__ = ("tensor", "key", "nbytes")

            def __init__(self, tensor: torch.Tensor) -> None:
                # detached (same storage): a saved *output* would otherwise hold its own grad_fn, a cycle through
                # autograd's C++ graph that Python's collector cannot see. A backward that does not free the graph
                # (the input half of a split backward, retain_graph=True) then leaked it for good.
                self.tensor = tensor.detach()
                storage = tensor.untyped_storage()
                self.key, self.nbytes = storage.data_ptr(), storage.nbytes()
                if self.key in meter._param_storages or self.nbytes == 0:
                    self.nbytes = -1  # not an activation: don't count
                else:
                    meter._acquire(self.key, self.nbytes)

            def __del__(self) -> None:  # autograd dropped the saved tensor (after its backward)
                if self.nbytes >= 0:
                    meter._release(self.key, self.nbytes)

        with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda saved: saved.tensor):
            yield

    @classmethod
    def attach(cls, engine: object) -> ActivationMeter:
        """Count every training step of ``engine`` from now on."""
        meter = cls(list(engine.parameters))  # type: ignore[attr-defined]
        engine.step_contexts.append(meter.measure)  # type: ignore[attr-defined]
        return meter
