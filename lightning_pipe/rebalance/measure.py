"""Measure, on one rank, what each of its layers costs per training batch: the input of the rebalance decision.

[Note: how layer times are measured]
Two cheap measurements, taken only while the timer is ``armed`` (the last few optimizer steps before a decision):

- per stage, the time of torch's compute calls for it (``forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk``; call hooks on this rank's ``PipelineStage`` objects, next to the trace recorder's
  and the data-parallel overlap's: [Note: stage call hooks] in runtime/stage.py). Waiting for a peer is not in
  them: torch posts and waits for its P2P operations outside those calls.
- per layer, its forward time (forward pre/post hooks on this rank's layers).

A layer's cost is its stage's compute time split over the stage's layers in proportion to their forward times
(backward assumed proportional to forward, layer by layer). Shape inference (``engine.inferring``) and evaluation
passes are not counted. The host clock times CPU runs; CUDA events time GPU runs (read once, when collected).
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_pipe.rebalance.decide import LayerTime


def layer_kind(layer: nn.Module) -> str:
    """Class and parameter shapes: layers of one kind cost the same on equally fast ranks ([Note: layer cost versus
    rank speed] in decide.py). Hashed, so it stays short for big layers."""
    text = type(layer).__qualname__ + repr([tuple(p.shape) for p in layer.parameters()])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class _Marks:
    """Start/end marks: host nanoseconds on CPU, CUDA events on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any, Any]] = []  # (key, start, end)

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self) -> list[tuple[Any, float]]:
        if self.cuda and self.spans:
            self.spans[-1][2].synchronize()
            return [(k, s.elapsed_time(e) / 1e3) for k, s, e in self.spans]
        return [(k, (e - s) / 1e9) for k, s, e in self.spans]


class LayerTimer:
    """Times one engine's layers and stages while ``armed`` ([Note: how layer times are measured])."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.armed = False
        self.batches = 0
        self._marks = _Marks(torch.device(engine.device))
        self._open: dict[int, Any] = {}
        self._active = False
        self._first = True  # the first batch of an engine runs torch's shape inference and warms up: not timed
        self._handles: list[Any] = []
        self._removers: list[Callable[[], None]] = []  # our stage call hooks ([Note: stage call hooks])
        self.kinds: dict[int, str] = {}

    def _counting(self) -> bool:
        return self._active and not self.engine.inferring

    def attach(self) -> LayerTimer:
        for sm in self.engine.stage_modules:
            for index, layer in zip(sm.layer_indices, sm.layers):
                self.kinds[index] = layer_kind(layer)
                self._handles.append(layer.register_forward_pre_hook(self._pre(index)))
                self._handles.append(layer.register_forward_hook(self._post(index)))
        for stage in self.engine.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                self._removers.append(stage.add_call_hook(name, self._timed(stage.stage_index)))
        self.engine.step_contexts.append(self.step)
        return self

    def detach(self) -> None:
        """Remove every hook and wrapper (a layer that moves is pickled: it must carry none of ours)."""
        for handle in self._handles:
            handle.remove()
        for remove in reversed(self._removers):  # ours only: other hooks (the data-parallel overlap's) stay
            remove()
        self._handles, self._removers = [], []
        with contextlib.suppress(ValueError):
            self.engine.step_contexts.remove(self.step)

    def _pre(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._counting():
                self._open[index] = self._marks.mark()
        return hook

    def _post(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open.pop(index, None)
            if start is not None and self._counting():
                self._marks.spans.append((("layer", self.batches, index), start, self._marks.mark()))
        return hook

    def _timed(self, stage_index: int) -> Callable[..., Any]:
        def hook(run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self._counting():
                return run()
            start = self._marks.mark()
            try:
                return run()
            finally:
                self._marks.spans.append((("stage", self.batches, stage_index), start, self._marks.mark()))
        return hook

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Entered by the engine around each training schedule step."""
        self._active, self._first = self.armed and not self._first, False
        try:
            yield
        finally:
            if self._active:
                self.batches += 1
            self._active = False

    def collect(self, pp_rank: int) -> list[LayerTime]:
        """Seconds per batch of each local layer: the median over the batches measured since the last reset (one
        batch slowed by a busy host does not decide)."""
        forward: dict[tuple[int, int], float] = {}  # (batch, layer) -> seconds
        stage_total: dict[tuple[int, int], float] = {}  # (batch, stage) -> seconds
        for (what, batch, key), seconds in self._marks.seconds():
            target = forward if what == "layer" else stage_total
            target[(batch, key)] = target.get((batch, key), 0.0) + seconds
        batches = sorted({b for b, _ in stage_total} | {b for b, _ in forward})
        per_layer: dict[int, list[float]] = {}
        for sm, stage in zip(self.engine.stage_modules, self.engine.stages):
            indices = list(sm.layer_indices)
            for b in batches:
                fwd = [forward.get((b, i), 0.0) for i in indices]
                total = stage_total.get((b, stage.stage_index), sum(fwd))
                for i, f in zip(indices, fwd):
                    share = f / sum(fwd) if sum(fwd) > 0 else 1.0 / len(indices)
                    per_layer.setdefault(i, []).append(total * share)
        return [LayerTime(i, pp_rank, self.kinds[i], statistics.median(v)) for i, v in per_layer.items()]

    def reset(self) -> None:
        self._marks.spans.clear()
        self._open.clear()
        self.batches = 0
