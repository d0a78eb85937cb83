"""The analytic source on the machine in front of you: describe it (matmul rate, memory bandwidth, cost of one
operation, the link between ranks) and turn the analytic layer costs into a :class:`~lightning_pipe.planner.profile.
ModelProfile`, which the profiled planner's own cost model and simulator take (``planner.model.predict``).

This checks the analytic model where it can be checked: ``python -m bench planner`` predicts the CPU runs it measures
from this profile as well as from the measured one. On such a machine each rank is a "device" with its own
threads; its measured rates stand for a GPU's datasheet numbers, so the efficiencies are 1 (the rates are already
what the kernels reach) except the GEMM's shape term, which keeps the calibrated half-size dimension.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_pipe.planner.cluster.comm import Links
from lightning_pipe.planner.cluster.kernels import GPU_EFFICIENCY, Efficiency, Kernels
from lightning_pipe.planner.cluster.layers import LayerModel
from lightning_pipe.planner.cluster.specs import ClusterSpec, ModelSpec, Stack
from lightning_pipe.planner.profile import LayerCost, ModelProfile

MEASURED = Efficiency(gemm=1.0, gemm_half=GPU_EFFICIENCY.gemm_half, memory=1.0, link=1.0)


def _fastest(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(ranks: int, link_latency: float, link_bandwidth: float, size: int = 512,
                    repeats: int = 20) -> ClusterSpec:
    """This process's machine, as a cluster of ``ranks`` CPU devices on one node: its matmul rate (fp32, ``size``^3,
    its current threads); the rate its bandwidth-bound kernels reach (a layer norm, a GELU and an add over 1 MiB
    tensors, the size of a small model's activations: bytes read and written over their time together; on a CPU
    these run well below the memory's bandwidth); the time of one tiny operation recorded by autograd; and the
    link between ranks measured by the caller (seconds, bytes/s)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    matmul = 2 * size**3 / _fastest(lambda: a @ b, repeats)
    n = 1 << 18
    x, y = torch.randn(n // 128, 128), torch.randn(n // 128, 128)
    kernels = (_fastest(lambda: torch.nn.functional.layer_norm(x, (128,)), repeats)
               + _fastest(lambda: torch.nn.functional.gelu(x), repeats) + _fastest(lambda: x + y, repeats))
    stream = (2 + 2 + 3) * n * 4 / kernels
    one, two = torch.ones(1, requires_grad=True), torch.ones(1)  # recorded by autograd, as in training
    op = _fastest(lambda: [one + two for _ in range(100)], repeats) / 100
    gbps = link_bandwidth / 1e9
    return ClusterSpec(gpus=ranks, gpus_per_node=ranks, peak_tflops=matmul / 1e12, memory_gib=1024.0,
                       nvlink_gbps=gbps, network_gbps=gbps, hbm_gbps=stream / 1e9,
                       nvlink_latency_us=link_latency * 1e6, network_latency_us=link_latency * 1e6,
                       kernel_us=op * 1e6, precision="fp32", accelerator="cpu", name="this machine")


def _cost(layer: Any, params_bytes: float, optimizer: float) -> LayerCost:
    run = layer.run
    return LayerCost(forward=run.f, backward=run.i + run.w, input_grad=run.i, weight_grad=run.w,
                     saved_bytes=int(layer.saved["none"]), output_bytes=int(layer.output),
                     param_bytes=int(params_bytes), optimizer_step=optimizer)


def analytic_profile(model: ModelSpec, machine: ClusterSpec, micro_batch_sizes: Sequence[int],
                     stack: Stack | None = None, eff: Efficiency = MEASURED) -> ModelProfile:
    """Per layer and micro-batch size, the analytic F / B / I / W, kept and output bytes, parameter bytes and
    optimizer step: what ``profile_model`` measures, computed instead."""
    stack = stack or Stack()
    kernels, links = Kernels(machine, eff), Links(machine, eff)
    layers: dict[int, list[LayerCost]] = {}
    for b in micro_batch_sizes:
        lm = LayerModel(model, machine, stack, kernels, links, 1, float(b))
        step = [kernels.stream(c.params * stack.optimizer_pass_bytes, 4) for c in lm.layers()]
        layers[int(b)] = [_cost(c, c.params * machine.act_bytes, t) for c, t in zip(lm.layers(), step)]
    return ModelProfile(layers, link_latency=machine.nvlink_latency_us * 1e-6,
                        link_bandwidth=machine.nvlink_gbps * 1e9 * eff.link,
                        meta={"source": "analytic", "machine": machine.name})
