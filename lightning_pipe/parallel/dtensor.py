"""DTensor helpers every part of the core needs, FSDP or not: this rank's part of a (sharded or split) tensor, and
the gathers / cuts a checkpoint does between full tensors and DTensors (FSDP shards and tensor-parallel splits
alike)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


def local(tensor: Tensor) -> Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise): what per-rank collectives and norms see."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_values(state: Mapping[str, Any]) -> dict[str, Any]:
    """DTensor values gathered to full CPU tensors, one at a time; everything else as is. Collective: every rank
    holding a DTensor of a stage calls it with the same keys in the same order (a checkpoint save)."""
    return {k: v.full_tensor().detach().cpu() if isinstance(v, DTensor) else v for k, v in state.items()}


def shard_like(value: Any, like: Any) -> Any:
    """A full tensor cut like the DTensor ``like`` (this rank's chunk, no communication); anything else as is."""
    if isinstance(like, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
        return distribute_tensor(value.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return value


def shard_state_like(values: Mapping[str, Any], local_sd: Mapping[str, Any]) -> dict[str, Any]:
    """Full tensors read from a checkpoint -> what ``load_state_dict`` of a module with sharded parameters takes."""
    return {k: shard_like(v, local_sd.get(k)) for k, v in values.items()}


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` with full per-parameter tensors (e.g. Adam's moments) cut like their DTensor
    parameters; scalars (``step``) stay as they are."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx, entries in state_dict["state"].items():
        param = params[idx]
        if isinstance(param, DTensor):
            for key, value in entries.items():
                if isinstance(value, Tensor) and tuple(value.shape) == tuple(param.shape):
                    entries[key] = shard_like(value, param)
    return state_dict
