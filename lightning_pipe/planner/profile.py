"""Measure what the planner needs, layer by layer: compute times, activation and parameter bytes, and the link.

Per layer and per micro-batch size: forward F, full backward B, and the split backward the runtime runs for
zero-bubble schedules (I: input gradient, W: weight gradient, timed with torch's own ``stage_backward_input`` /
``stage_backward_weight``); the bytes autograd saves for backward (:class:`~lightning_pipe.trace.memory.ActivationMeter`);
the output bytes (what crosses a stage boundary); parameter bytes. One layer is resident at a time: a layer built
on the meta device is materialised (``module.reset_layer(index, layer)`` or ``reset_parameters``), profiled and
freed, so a model that does not fit on one device is profiled on one device. Few repetitions, the fastest: on a
shared machine contention only ever adds time, so the least-disturbed repetition is the closest to the cost.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe._compat import torch as _compat
from lightning_pipe.layers.batches import loss_parts
from lightning_pipe.layers.stages import layer_args, place_layer
from lightning_pipe.trace.memory import ActivationMeter


@dataclass(frozen=True)
class LayerCost:
    """One layer at one micro-batch size (seconds, bytes). The last layer's times include the loss."""

    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    saved_bytes: int
    output_bytes: int
    param_bytes: int
    optimizer_step: float = 0.0
    """One AdamW step over the layer's parameters (the optimizer runs once per batch, on every rank)."""


@dataclass
class ModelProfile:
    """Per micro-batch size (samples), one :class:`LayerCost` per layer; ``link`` from :func:`measure_link`."""

    layers: dict[int, list[LayerCost]]
    link_latency: float = 50e-6
    link_bandwidth: float = 1e9
    """Bytes per second of one point-to-point link."""
    optimizer_state_factor: float = 2.0
    """Optimizer state bytes per parameter byte (AdamW: 2)."""
    meta: dict[str, Any] = field(default_factory=dict)
    action_overhead: float = 0.0
    """Seconds every schedule action costs on top of its layers' compute: the runtime's Python work and P2P
    post/wait per stage call, measured on the running ranks (:func:`~lightning_pipe.planner.calibrate.measure_action_overhead`
    on torch's bare stages, or :func:`~lightning_pipe.planner.calibrate.fit_action_costs` from the strategy's own
    timeline at the model's sizes)."""
    step_overhead: float = 0.0
    """Seconds each training step costs outside the schedule and the optimizer (the trainer's loop, data loading,
    the loss broadcast, gradient hand-offs), measured with the strategy on a near-zero-compute model
    (:func:`~lightning_pipe.planner.calibrate.solve_step_costs`) or calibrated from a measured run; 0 unless one was."""
    microbatch_overhead: float = 0.0
    """Seconds each micro-batch costs the step beyond its actions' per-action cost (splitting the batch, the loss
    record, the strategy's stage work per chunk), measured with ``step_overhead``; 0 unless measured."""
    transfer_overhead: float = 0.0
    """Seconds of host work each cross-rank transfer costs the rank that posts it (a send or a receive: posting it,
    the transport's copy, the runtime's bookkeeping), on top of ``action_overhead``: fitted with it from the
    strategy's timeline (:func:`~lightning_pipe.planner.calibrate.fit_action_costs`); 0 unless fitted
    ([Note: host cost per transfer] in ``calibrate.py``)."""

    @property
    def num_layers(self) -> int:
        return len(next(iter(self.layers.values())))

    def at(self, micro_batch: float) -> list[LayerCost]:
        """Layer costs at any micro-batch size: measured, or linear between / beyond the two nearest measured."""
        sizes = sorted(self.layers)
        if micro_batch in self.layers:
            return self.layers[int(micro_batch)]
        if len(sizes) == 1:
            scale = micro_batch / sizes[0]
            return [_mix(c, c, scale, 0.0) for c in self.layers[sizes[0]]]
        lo, hi = (sizes[0], sizes[1]) if micro_batch < sizes[0] else (sizes[-2], sizes[-1])
        for a, b in zip(sizes, sizes[1:]):
            if a <= micro_batch <= b:
                lo, hi = a, b
        w = (micro_batch - lo) / (hi - lo)
        return [_mix(a, b, 1.0 - w, w, floor=True) for a, b in zip(self.layers[lo], self.layers[hi])]

    def to_json(self) -> dict[str, Any]:
        return {"layers": {str(k): [asdict(c) for c in v] for k, v in self.layers.items()},
                "link_latency": self.link_latency, "link_bandwidth": self.link_bandwidth,
                "optimizer_state_factor": self.optimizer_state_factor, "meta": self.meta,
                "action_overhead": self.action_overhead, "step_overhead": self.step_overhead,
                "microbatch_overhead": self.microbatch_overhead, "transfer_overhead": self.transfer_overhead}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelProfile:
        layers = {int(k): [LayerCost(**c) for c in v] for k, v in data["layers"].items()}
        return cls(layers, data["link_latency"], data["link_bandwidth"], data.get("optimizer_state_factor", 2.0),
                   data.get("meta", {}), data.get("action_overhead", 0.0), data.get("step_overhead", 0.0),
                   data.get("microbatch_overhead", 0.0), data.get("transfer_overhead", 0.0))


def _mix(a: LayerCost, b: LayerCost, wa: float, wb: float, floor: bool = False) -> LayerCost:
    def val(x: float, y: float) -> float:
        v = wa * x + wb * y
        return max(v, 0.0) if floor else v

    return LayerCost(val(a.forward, b.forward), val(a.backward, b.backward), val(a.input_grad, b.input_grad),
                     val(a.weight_grad, b.weight_grad), int(val(a.saved_bytes, b.saved_bytes)),
                     int(val(a.output_bytes, b.output_bytes)), a.param_bytes, a.optimizer_step)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        out = value.detach()
        return out.requires_grad_(True) if out.is_floating_point() else out
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


def _timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def profile_layer(layer: nn.Module, inputs: Any, loss: Callable[[Any], torch.Tensor] | None = None,
                  repeats: int = 3) -> tuple[LayerCost, Any]:
    """Time one layer on ``inputs`` (one warm-up, then the fastest of ``repeats``); also return its output.

    ``loss`` (last layer only) maps the output to a scalar; otherwise backward starts from a random output
    gradient, as it does on a pipeline stage."""
    params = [p for p in layer.parameters() if p.requires_grad]
    device = next((t.device for t in _tensors(inputs)), torch.device("cpu"))
    meter = ActivationMeter(params)
    runs: dict[str, list[float]] = {k: [] for k in ("F", "B", "I", "W")}
    saved = 0
    out: Any = None
    for rep in range(repeats + 1):
        x = _detached(inputs)
        x_grad = [t for t in _tensors(x) if t.requires_grad]
        for split in (False, True):
            meter.reset()
            with meter.measure():
                t_f, out = _timed(device, layer, *layer_args(x))  # [Note: the layer I/O contract]
                saved = max(saved, meter.live_bytes)
                roots = [loss(out)] if loss is not None else [t for t in _tensors(out) if t.requires_grad]
            grads = None if loss is not None else [torch.randn_like(t) for t in roots]
            if not (roots and roots[0].requires_grad):
                t_b = t_i = t_w = 0.0  # nothing to differentiate (e.g. a frozen layer)
            elif not split:
                t_b, _ = _timed(device, torch.autograd.backward, roots, grads)
            else:
                if x_grad:  # the runtime skips I on stage 0 (no input gradient): its W is the whole backward
                    # torch detaches the outputs in place afterwards, which a view cannot take (a layer may return
                    # one, e.g. a transformers block's reshaped hidden states) and which would cut what the layer
                    # saved of an output: hand it the aliases the runtime hands it ([Note: split backward detaches
                    # stage outputs] in runtime/stage.py)
                    t_i, (_, groups) = _timed(device, _compat.stage_backward_input,
                                              [_compat.detachable_alias(r) for r in roots],
                                              grads, x_grad, iter(params))
                    t_w, _ = _timed(device, _compat.stage_backward_weight, iter(params), groups)
                else:
                    t_i, (t_w, _) = 0.0, _timed(device, torch.autograd.backward, roots, grads)
            if rep:
                runs["F"].append(t_f)
                runs["B" if not split else "I"].append(t_b if not split else t_i)
                if split:
                    runs["W"].append(t_w)
            for p in params:
                p.grad = None
    best = {k: min(v) if v else 0.0 for k, v in runs.items()}
    cost = LayerCost(best["F"], best["B"], best["I"], best["W"], int(saved), _nbytes(out),
                     sum(p.nelement() * p.element_size() for p in layer.parameters()), _optimizer_time(params, repeats))
    return cost, _detach_all(out)


def _optimizer_time(params: list[nn.Parameter], repeats: int) -> float:
    """AdamW on copies of the parameters (the layer's values stay untouched); the first step allocates state."""
    if not params:
        return 0.0
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.randn_like(c)
    opt = torch.optim.AdamW(copies, lr=1e-3)
    times = []
    for rep in range(repeats + 1):
        t, _ = _timed(copies[0].device, opt.step)
        if rep:
            times.append(t)
    return min(times)


def _detach_all(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach_all(v) for v in value)
    return value


def _fastest(a: LayerCost, b: LayerCost) -> LayerCost:
    return dataclasses.replace(a, forward=min(a.forward, b.forward), backward=min(a.backward, b.backward),
                               input_grad=min(a.input_grad, b.input_grad),
                               weight_grad=min(a.weight_grad, b.weight_grad),
                               optimizer_step=min(a.optimizer_step, b.optimizer_step))


def profile_model(module: nn.Module, batch: Any, micro_batch_sizes: Sequence[int], layers_attr: str = "layers",
                  device: torch.device | str = "cpu", repeats: int = 3, passes: int = 2) -> ModelProfile:
    """Profile every layer of a layer-list module (the pipeline's module contract: ``split_batch``, ``loss_fn``)
    at each micro-batch size, taking the first rows of ``batch``. Each layer is profiled as a copy on ``device``
    (a layer on the meta device is allocated and initialised there first), so the module itself never changes.

    ``passes`` sweeps over the whole model, keeping each time the fastest: a burst of contention on a shared
    machine lasts longer than one layer's repetitions, but rarely hits the same layer in two sweeps."""
    device = torch.device(device)
    layers = list(getattr(module, layers_attr))
    inputs_all, target_all = module.split_batch(batch)  # type: ignore[operator]
    sizes = [int(n) for n in micro_batch_sizes]
    profile: dict[int, list[LayerCost]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(max(1, passes)):
            hidden = {n: _rows(inputs_all, n, device) for n in sizes}
            targets = {n: _rows(target_all, n, device) for n in sizes}
            sweep: dict[int, list[LayerCost]] = {n: [] for n in sizes}
            for index, original in enumerate(layers):
                # A copy, so the model is untouched: parameter objects (and the ties between layers that share one)
                # stay, buffers keep their values, meta layers stay on meta. One layer is resident at a time.
                layer = copy.deepcopy(original)
                place_layer(module, index, layer, device)  # built on meta: allocated and initialised as the strategy does
                last = index == len(layers) - 1
                for n in sizes:
                    # a mean, or a (sum, count) pair: the backward starts from the value either way
                    loss = (lambda out, t=targets[n]: loss_parts(module.loss_fn(out, t),  # type: ignore
                                                                 type(module).__name__).value) if last else None
                    cost, hidden[n] = profile_layer(layer, hidden[n], loss, repeats)
                    sweep[n].append(cost)
                del layer
            profile = {n: [_fastest(a, b) for a, b in zip(profile[n], sweep[n])] if profile else sweep[n]
                       for n in sizes}
    return ModelProfile(profile, meta={"micro_batch_sizes": list(micro_batch_sizes), "device": str(device)})


def _rows(value: Any, n: int, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        if value.size(0) < n:
            raise ValueError(f"profiling a micro-batch of {n} samples needs a batch of at least {n}; "
                             f"got {value.size(0)}")
        return value[:n].to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, n, device) for v in value)
    return value


def measure_link(src: int = 0, dst: int = 1, sizes: Sequence[int] = (1 << 10, 1 << 18, 1 << 21),
                 repeats: int = 5, group: Any = None, device: torch.device | str = "cpu") -> tuple[float, float]:
    """Latency (s) and bandwidth (bytes/s) between two ranks, from ping-pongs of a few sizes (least squares of
    the fastest half round trip against the size). Call on every rank of ``group``; all get the same answer."""
    rank = dist.get_rank(group)
    device = torch.device(device)
    points = []
    for size in sizes:
        buf = torch.empty(size // 4, dtype=torch.float32, device=device)
        times = []
        for rep in range(repeats + 1):
            start = time.perf_counter()
            if rank == src:
                dist.send(buf, dst, group=group)
                dist.recv(buf, dst, group=group)
            elif rank == dst:
                dist.recv(buf, src, group=group)
                dist.send(buf, src, group=group)
            if rep:
                times.append((time.perf_counter() - start) / 2)
        points.append((float(size), min(times) if times else 0.0))
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    if slope <= 0:  # contention made the small transfers slower than the large one: read the largest alone
        slope = max(points[-1][1] - min(y for _, y in points), 1e-9) / points[-1][0]
    latency = max(my - slope * mx, 1e-6)
    result = [latency, 1.0 / slope]
    holder = [result]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, src) if group is not None else src,
                               group=group)
    return float(holder[0][0]), float(holder[0][1])


def rank_speeds(profiles: Sequence[ModelProfile], micro_batch: int, tolerance: float = 0.1) -> list[float]:
    """Relative slowness of each rank (1.0 = the fastest) from per-rank profiles of the same model. Differences
    within ``tolerance`` read as equal: timing noise must not move layers between identical devices."""
    totals = [sum(c.forward + c.backward for c in p.at(micro_batch)) for p in profiles]
    fastest = min(totals)
    speeds = [t / fastest if fastest > 0 else 1.0 for t in totals]
    return [s if s > 1.0 + tolerance else 1.0 for s in speeds]
