"""A quantity of one layer on every rank: ``PipelineModule.layer_value(index, fn)``.

[Note: a value one stage holds]
Each rank keeps only its own layers; on the others a layer is a ``RemoteLayer`` stand-in whose attributes name where
the layer lives (layers/stages.py). Logging a quantity of a layer (a weight's norm, a gate's temperature) from a hook
on rank 0, where the loggers are, would read a stand-in. ``layer_value`` computes ``fn(layer)`` (under ``no_grad``)
on the rank that holds the layer and gives the result to every rank of its pipeline in one object gather over the
pipeline group (replicas and tensor ranks each gather within their own pipeline: they hold the same values). A
DTensor result (a layer split by tensor parallelism or FSDP) is gathered whole first, on every rank of that stage.
It is a collective: every rank calls it at the same point (a hook every rank runs, or the script after ``fit`` on
every rank). On a module that was never split it is ``fn(layers[index])`` under ``no_grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe.layers.stages import RemoteLayer, find_layers
from lightning_pipe.parallel.group_cache import shared_group


def _whole(value: Any) -> Any:
    """A DTensor as its full tensor (collective over its mesh), detached; anything else as it is."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach() if isinstance(value, Tensor) else value


def _pipeline(module: nn.Module) -> tuple[str, Any, int, torch.device] | None:
    """(layers attribute, pipeline group, pipeline size, device) of a module a PipelineStrategy split (during a
    Trainer call or after it); ``None`` for a module that was never split."""
    layout = getattr(module, "_pipeline_layout", None)
    if layout is None:
        return None
    strategy: Any = getattr(module, "trainer").strategy  # noqa: B009  (a LightningModule's; nn.Module types it loosely)
    topology = strategy.topology
    engine = getattr(module, "_pipeline_engine", None)
    group = engine.groups.pp if engine is not None else shared_group(
        topology.pp_group_ranks(topology.dp_rank, topology.tp_rank), "pipeline")  # the engine's, kept for the process
    return strategy.pipeline_config.layers_attr, group, topology.pipeline_size, strategy.root_device


def layer_value(module: nn.Module, index: int, fn: Callable[[nn.Module], Any]) -> Any:
    """``fn(layer index)`` on every rank ([Note: a value one stage holds])."""
    split = _pipeline(module)
    layers = find_layers(module, split[0] if split is not None else "layers")
    if not 0 <= index < len(layers):
        raise IndexError(f"layer_value({index}): the layer list has {len(layers)} layers.")
    layer = layers[index]
    holds = not isinstance(layer, RemoteLayer)
    value = None
    if holds:
        with torch.no_grad():
            value = _whole(fn(layer))
    if split is None or split[2] == 1:
        return value
    _, group, size, device = split
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, (holds, value.cpu() if isinstance(value, Tensor) else value), group=group)
    value = next(v for held, v in gathered if held)
    return value.to(device) if isinstance(value, Tensor) else value


__all__ = ["layer_value"]
