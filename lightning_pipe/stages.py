"""Build this rank's stage module(s) from the user's LightningModule, keeping original parameter names.

The layer list stays where the user put it (``module.layers``); layers of other ranks are swapped for
:class:`RemoteLayer` placeholders that hold no parameters. So ``module.named_parameters()`` on a rank yields exactly
its own parameters under their original names (``layers.7.attn.weight``): the optimizer, the checkpoint and the
user's ``configure_optimizers`` all see the usual names, only fewer of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pipe.config import config_error


def run_layers(layers: nn.Module, inputs: Any) -> Any:
    """Run a layer list as a chain (the semantics every stage keeps)."""
    hidden = inputs
    for layer in layers:
        hidden = layer(hidden)
    return hidden


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline rank."""

    def __init__(self, index: int, stage: int, rank: int) -> None:
        super().__init__()
        self.index, self.stage, self.rank = index, stage, rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.index} lives on pipeline stage {self.stage} (pipeline rank {self.rank}), not on this rank. "
            "Under PipelineStrategy the layers run inside the pipeline schedule: get the loss from "
            "`self.compute_loss(batch)` and outputs from `self.compute_output(batch)` instead of calling `self(x)`."
        )

    def extra_repr(self) -> str:
        return f"index={self.index}, stage={self.stage}, rank={self.rank}"


class StageModule(nn.Module):
    """A contiguous run of layers; the module torch's ``PipelineStage`` executes.

    Torch passes a stage the previous stage's outputs as positional arguments; a single argument is the tensor,
    several are the tuple the previous layer returned, so the chain semantics of the full model are kept.
    """

    def __init__(self, layers: Sequence[nn.Module], layer_indices: range, recompute_every: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layer_indices = layer_indices
        self.recompute_every = recompute_every

    def forward(self, *args: Any) -> Any:
        hidden = args[0] if len(args) == 1 else args
        k = self.recompute_every
        if k is None or not torch.is_grad_enabled():
            return run_layers(self.layers, hidden)
        for j, layer in enumerate(self.layers):
            if j % k == 0:
                # Non-reentrant checkpointing: keeps only the layer's input; replays its RNG on recomputation.
                hidden = checkpoint(layer, hidden, use_reentrant=False)
            else:
                hidden = layer(hidden)
        return hidden


def find_layers(module: nn.Module, attr: str) -> nn.Module:
    """The module's ordered layer list, or an error that says how to provide one."""
    key = "layers_attr"
    layers = getattr(module, attr, None)
    if layers is None:
        raise config_error(
            f"PipelineStrategy splits the model's layer list into stages, but {type(module).__name__} has no "
            f"attribute `{attr}`. Put the model's layers, in order, in an nn.Sequential or nn.ModuleList "
            f"(e.g. `self.{attr} = nn.Sequential(embedding, *blocks, head)`), or point the strategy at it.",
            f"layers_attr={attr!r}", key)
    if isinstance(layers, (nn.ModuleDict, nn.ParameterList, nn.ParameterDict)) or not isinstance(
            layers, (nn.Sequential, nn.ModuleList)):
        raise config_error(
            "The layer list must be an ordered chain: an nn.Sequential or nn.ModuleList whose layer i feeds "
            "layer i+1 (a dict or a plain module has no order to split).",
            f"{type(module).__name__}.{attr} of type {type(layers).__name__}", key)
    return layers


@dataclass(frozen=True)
class TiedParameter:
    """A parameter object shared by several layers (e.g. GPT-2's embedding and output head)."""

    names: tuple[str, ...]
    """Its full names, one per layer that uses it, in layer order."""
    layer_indices: tuple[int, ...]


def find_tied_parameters(module: nn.Module, attr: str) -> list[TiedParameter]:
    """Parameters appearing in more than one layer of the list (same object, different layers)."""
    layers = find_layers(module, attr)
    seen: dict[int, list[tuple[str, int]]] = {}
    for idx, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            seen.setdefault(id(param), []).append((f"{attr}.{idx}.{name}", idx))
    tied = []
    for uses in seen.values():
        if len({idx for _, idx in uses}) > 1:
            tied.append(TiedParameter(tuple(n for n, _ in uses), tuple(i for _, i in uses)))
    return tied


def check_no_stray_parameters(module: nn.Module, attr: str) -> None:
    """Parameters outside the layer list would never be trained by the pipeline: refuse them early."""
    stray = [name for name, _ in module.named_parameters() if not name.startswith(f"{attr}.")]
    if stray:
        # The cure is in the model; layers_attr is only the secondary hint (the list may live elsewhere).
        raise config_error(
            "Under the pipeline every trainable parameter must belong to a layer of the layer list (other "
            "parameters are never run by any stage).",
            f"parameters outside `{attr}`: {stray[:8]}{' ...' if len(stray) > 8 else ''}", "layers_attr",
            "if the layer list lives under another attribute",
            fix="Move each of them into a layer of the list (e.g. wrap the embedding as the first layer and the head "
                "as the last)")


def localize_layers(module: nn.Module, attr: str, ranges: Sequence[range], local_stages: Sequence[int],
                    stage_to_rank: Any, recompute_every: int | None = None) -> list[StageModule]:
    """Swap other ranks' layers for placeholders; return this rank's stage modules in stage order."""
    layers = find_layers(module, attr)
    owner = {}
    for stage, rng in enumerate(ranges):
        for i in rng:
            owner[i] = stage
    local = set(local_stages)
    keys = list(layers._modules.keys())
    for i, key in enumerate(keys):
        if owner[i] not in local:
            # Writing _modules directly keeps the original indices ("7") as names; del/insert would renumber.
            layers._modules[key] = RemoteLayer(i, owner[i], stage_to_rank(owner[i]))
    return [StageModule([layers._modules[keys[i]] for i in ranges[s]], ranges[s], recompute_every)
            for s in local_stages]


def materialize(module: nn.Module, attr: str, stage_modules: Sequence[StageModule], tied: Sequence[TiedParameter],
                device: torch.device) -> bool:
    """Allocate and initialise this rank's layers if they were built on the meta device; False if they were not.

    Each local layer is initialised by ``module.reset_layer(index, layer)`` when the module defines it (make it
    deterministic per layer, e.g. seeded by ``index``, and call it in ``configure_model`` too: then one device and
    every pipeline layout start from the same values), else by each submodule's ``reset_parameters()``.
    """
    tensors = [t for sm in stage_modules for t in list(sm.parameters()) + list(sm.buffers())]
    if not any(t.is_meta for t in tensors):
        return False
    for sm in stage_modules:
        sm.to_empty(device=device)
    _retie(module, tied)  # to_empty gives every module its own new Parameter: tie the local copies again
    reset_layer = getattr(module, "reset_layer", None)
    for sm in stage_modules:
        for index, layer in zip(sm.layer_indices, sm.layers):
            if callable(reset_layer):
                reset_layer(index, layer)
            else:
                for sub in layer.modules():
                    if callable(getattr(sub, "reset_parameters", None)):
                        sub.reset_parameters()
    return True


def _local_submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module.get_submodule(path)``, or None where the path runs through another rank's layer (a RemoteLayer)."""
    for part in path.split(".") if path else ():
        child = module._modules.get(part)
        if child is None or isinstance(child, RemoteLayer):
            return None
        module = child
    return module


def _retie(module: nn.Module, tied: Sequence[TiedParameter]) -> None:
    for tie in tied:
        owners = []
        for name in tie.names:
            prefix, _, leaf = name.rpartition(".")
            owner = _local_submodule(module, prefix)  # a use nested in another rank's layer is not here
            if owner is not None and leaf in owner._parameters:
                owners.append((owner, leaf))
        for owner, leaf in owners[1:]:
            owner._parameters[leaf] = owners[0][0]._parameters[owners[0][1]]
