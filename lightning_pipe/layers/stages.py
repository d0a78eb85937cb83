"""Build this rank's stage module(s) from the user's LightningModule, keeping original parameter names.

The layer list stays where the user put it (``module.layers``); layers of other ranks are swapped for
:class:`RemoteLayer` placeholders that hold no parameters. So ``module.named_parameters()`` on a rank yields exactly
its own parameters under their original names (``layers.7.attn.weight``): the optimizer, the checkpoint and the
user's ``configure_optimizers`` all see the usual names, only fewer of them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import LayerChoice, config_error
from lightning_pipe.layers.aux import attach_layer_penalty, records_once
from lightning_pipe.layers.compile import CompiledLayers
from lightning_pipe.layers.offload import HostOffload, OffloadStats
from lightning_pipe.layers.vocab import TokenIdError, explain_index_error

# [Note: the layer I/O contract]
# A layer's output is the next layer's input: a tensor is its one argument, a tuple (or list) is unpacked into its
# positional arguments. That holds on one device (``PipelineModule.forward``), between two layers of one stage, and
# across a stage boundary, where torch sends each element of the tuple and calls the next stage with them as
# positional arguments; ``split_batch``'s inputs reach the first layer the same way. Only tensors can cross a stage
# boundary, and where the boundaries fall depends on the partition, so one rule holds for every layer (and for the
# inputs), on one device too: a tensor or a non-empty tuple of tensors. It is checked at every layer call (a few
# isinstance checks, nothing next to the layer) and a break names the layer. Dicts are refused rather than carried:
# flattening them at boundaries would need their keys on the receiving rank before its first message, and a tuple
# says the same thing.


class LayerContractError(TypeError):
    """A layer (or ``split_batch``) produced something other than a tensor or a tuple of tensors."""


def layer_args(value: Any) -> tuple[Any, ...]:
    """A layer output (or the inputs) as the next layer's positional arguments ([Note: the layer I/O contract])."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def check_layer_io(value: Any, what: str) -> None:
    """Refuse anything but a tensor or a non-empty tuple/list of tensors, naming ``what`` produced it."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, DTensor) for v in values):
        raise LayerContractError(
            f"{what} a DTensor. Rule: layers exchange plain, whole tensors (they cross stage boundaries as such), so "
            "under tensor parallelism `parallelize_layer` must leave each layer's outputs local and whole: the "
            "parallel styles' use_local_output=True (their default), and a split output gathered back (e.g. "
            "ColwiseParallel(output_layouts=Replicate()) on a lone projection).")
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return
    raise LayerContractError(
        f"{what} {_describe(value)}. Rule: every layer returns a tensor or a tuple of tensors, and a tuple is the next "
        "layer's positional arguments (on one device, inside a stage and across stages; the first layer receives "
        "split_batch's inputs the same way). Only tensors can cross a pipeline stage boundary, so dicts, None and "
        "other objects are refused. Return a tuple of tensors instead, e.g. `return hidden, mask`, and take "
        "`forward(self, hidden, mask)` in the next layer.")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {list(value)[:8]}"
    if isinstance(value, (tuple, list)):
        if not value:
            return f"an empty {type(value).__name__}"
        bad = next(i for i, v in enumerate(value) if not isinstance(v, torch.Tensor))
        return f"a {type(value).__name__} whose element {bad} is {type(value[bad]).__name__}"
    return f"a {type(value).__name__}"


def run_layers(layers: nn.Module | list[nn.Module], inputs: Any, indices: Sequence[int] | None = None,
               recompute_every: int | None = None, offload: LayerChoice | None = None,
               offload_stats: OffloadStats | None = None, calls: Sequence[Callable[..., Any]] | None = None) -> Any:
    """Run layers as a chain ([Note: the layer I/O contract]); ``indices`` are their places in the full list.

    With ``recompute_every=k`` (and grad enabled) every k-th layer is checkpointed: non-reentrant, so only its
    inputs are kept and its RNG is replayed on recomputation. The layers ``offload`` picks keep what autograd saves
    (for a recomputed one: its inputs) in host memory ([Note: activation offload]), counted in ``offload_stats``.
    ``calls`` runs in place of each layer (its compiled wrapper: [Note: compiled layers]).
    """
    chain: list[nn.Module] = layers if isinstance(layers, list) else list(layers)  # type: ignore[call-overload]
    run: Sequence[Callable[..., Any]] = chain if calls is None else calls
    indices = range(len(chain)) if indices is None else indices
    special = (recompute_every is not None or (offload is not None and bool(offload))) and torch.is_grad_enabled()
    hidden = inputs
    # Per layer per micro-batch: what runs here is the loop's whole cost next to a bare `for layer: h = layer(h)`.
    # A plain tensor (exactly torch.Tensor: no DTensor, no other subclass) always passes the check, so the common
    # case costs one type() per layer and a direct call; each value is checked once, as the next layer's input (the
    # last as the chain's output), and a message is only formatted for a value that needs the full check.
    for j, call in enumerate(run):
        plain = type(hidden) is torch.Tensor
        if not plain:
            check_layer_io(hidden, _producer(j, chain, indices))
        try:
            if plain and not special:
                hidden = call(hidden)
            else:
                args = (hidden,) if plain else layer_args(hidden)
                hidden = call(*args) if not special else _run_special(call, chain[j], j, indices[j], args,
                                                                      recompute_every, offload, offload_stats)
        except IndexError as err:  # an embedding given a token id out of range: [Note: token ids out of range]
            args = (hidden,) if plain else layer_args(hidden)  # (hidden is still this layer's input)
            explained = explain_index_error(chain[j], indices[j], args) if not isinstance(err, TokenIdError) else None
            if explained is None:
                raise
            raise explained from None
    if type(hidden) is not torch.Tensor:
        check_layer_io(hidden, _producer(len(run), chain, indices))
    return hidden


def _producer(j: int, chain: Sequence[nn.Module], indices: Sequence[int]) -> str:
    """What produced the input of layer ``j`` of the chain (``j == len(chain)``: the chain's output)."""
    if j == 0:
        return (f"The inputs of layer {indices[0] if indices else 0} (split_batch's inputs, or the previous stage's "
                "outputs) are")
    return f"Layer {indices[j - 1]} ({type(chain[j - 1]).__name__}) returned"


def _run_special(call: Callable[..., Any], layer: nn.Module, position: int, index: int, args: tuple[Any, ...],
                 recompute_every: int | None, offload: LayerChoice | None, offload_stats: OffloadStats | None) -> Any:
    """``call`` (layer ``index``, at ``position`` in its stage) under recomputation and / or activation offload."""
    checkpointed = recompute_every is not None and position % recompute_every == 0
    if offload and offload.picks(position, index):
        # outside the checkpoint: its inputs are saved under these hooks, its recomputation under its own
        with HostOffload(layer, offload_stats):
            return checkpoint(records_once(call), *args, use_reentrant=False) if checkpointed else call(*args)
    if checkpointed:
        return checkpoint(records_once(call), *args, use_reentrant=False)
    return call(*args)


class RemoteLayerError(AttributeError):
    """An attribute of a layer read on a rank that does not hold the layer (an ``AttributeError``, so ``getattr``
    with a default and ``hasattr`` keep working)."""


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline rank."""

    def __init__(self, index: int, stage: int, rank: int) -> None:
        super().__init__()
        self.index, self.stage, self.rank = index, stage, rank

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            where = self.__dict__
            if name.startswith("__") or "index" not in where:  # protocol probes, or before __init__ ran
                raise
        raise RemoteLayerError(
            f"Layer {where['index']} has no attribute {name!r} here: it lives on {self._where()}, and this rank keeps "
            "only a parameter-less stand-in for it (under PipelineStrategy each rank holds its own stages' layers). "
            "To read a quantity of this layer on every rank (to log it, say), compute it where it lives, e.g. "
            f"`self.layer_value({where['index']}, lambda layer: layer.{name}.norm())` (a collective: call it on "
            "every rank); code inside the layers runs where they live.")

    def _where(self) -> str:
        # (a layer moved by the rebalancer knows its rank, not its stage number)
        return (f"pipeline stage {self.stage} (pipeline rank {self.rank})" if self.stage >= 0
                else f"pipeline rank {self.rank}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.index} lives on {self._where()}, not on this rank. "
            "Under PipelineStrategy the layers run inside the pipeline schedule: get the loss from "
            "`self.compute_loss(batch)` and outputs from `self.compute_output(batch)` instead of calling `self(x)`."
        )

    def extra_repr(self) -> str:
        return f"index={self.index}, stage={self.stage}, rank={self.rank}"


class StageModule(nn.Module):
    """A contiguous run of layers; the module torch's ``PipelineStage`` executes.

    Torch passes a stage the previous stage's outputs as positional arguments, exactly what the next layer takes
    ([Note: the layer I/O contract]), so the chain semantics of the full model are kept.
    """

    def __init__(self, layers: Sequence[nn.Module], layer_indices: range, recompute_every: int | None = None,
                 offload: LayerChoice | None = None, compile_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layer_indices = layer_indices
        self.recompute_every = recompute_every
        self.offload = offload or LayerChoice()
        self._offloading = bool(self.offload)
        self.offload_stats = OffloadStats()
        """Host bytes this stage's offloaded layers hold (bench/memory.py reads them)."""
        self.compiled = CompiledLayers(compile_options)
        """What runs for each layer under ``compile=`` ([Note: compiled layers]); kept outside the module tree."""
        self.penalty: Callable[[int, nn.Module], torch.Tensor | None] | None = None
        """The module's ``layer_penalty`` ([Note: a penalty over every stage's parameters])."""

    def meta_forward_context(self) -> contextlib.AbstractContextManager[None]:
        """Around the meta forwards that plan shapes: the layers run uncompiled ([Note: compiled layers])."""
        return self.compiled.eager()

    def forward(self, *args: Any) -> Any:
        # per micro-batch: self.layers would go through nn.Module.__getattr__, bool(self.offload) through a method
        layers = list(self._modules["layers"])  # type: ignore[call-overload]  # the ModuleList of __init__
        out = run_layers(layers, args[0] if len(args) == 1 else args, self.layer_indices, self.recompute_every,
                         self.offload if self._offloading else None, self.offload_stats, self.compiled.calls(layers))
        return attach_layer_penalty(out, layers, self.layer_indices, self.penalty)


LayerList = nn.Sequential | nn.ModuleList
"""The ordered layer list the pipeline splits."""


def find_layers(module: nn.Module, attr: str) -> LayerList:
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
                    stage_to_rank: Any, recompute_every: int | None = None,
                    offload: LayerChoice | None = None,
                    compile_options: dict[str, Any] | None = None) -> list[StageModule]:
    """Swap other ranks' layers for placeholders; return this rank's stage modules in stage order."""
    layers = find_layers(module, attr)
    owner = {}
    for stage, rng in enumerate(ranges):
        for i in rng:
            owner[i] = stage
    local = set(local_stages)
    keys = list(layers._modules.keys())
    if offload is not None and offload.indices and max(offload.indices) >= len(keys):
        raise config_error("offload's layer indices must be layers of the list (0 to the number of layers - 1).",
                           f"offload={sorted(offload.indices)!r} with {len(keys)} layers", "offload")
    for i, key in enumerate(keys):
        if owner[i] not in local:
            # Writing _modules directly keeps the original indices ("7") as names; del/insert would renumber.
            layers._modules[key] = RemoteLayer(i, owner[i], stage_to_rank(owner[i]))
    stage_modules = [StageModule([layers[i] for i in ranges[s]], ranges[s], recompute_every, offload,
                                 compile_options) for s in local_stages]
    for stage_module in stage_modules:  # [Note: a penalty over every stage's parameters]
        stage_module.penalty = getattr(module, "layer_penalty", None)
    return stage_modules


def materialize(module: nn.Module, stage_modules: Sequence[StageModule], device: torch.device) -> bool:
    """Allocate and initialise this rank's layers if they were built on the meta device; False if they were not.

    Each local layer is initialised by ``module.reset_layer(index, layer)`` when the module defines it (make it
    deterministic per layer, e.g. seeded by ``index``, and call it in ``configure_model`` too: then one device and
    every pipeline layout start from the same values), else by each submodule's ``reset_parameters()``.
    """
    return materialize_layers(module, [(index, layer) for sm in stage_modules
                                       for index, layer in zip(sm.layer_indices, sm.layers)], device)


def on_meta(module: nn.Module) -> bool:
    """Whether any of the module's parameters or buffers is on the meta device (built without storage)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize_layers(module: nn.Module, layers: Sequence[tuple[int, nn.Module]], device: torch.device) -> bool:
    """The one meta-materialise path: if any of ``layers`` (``(index, layer)`` pairs of ``module``'s layer list)
    is on the meta device, allocate them all on ``device`` (:func:`allocate_layers`) and initialise each with
    :func:`init_layer`; True. False, and nothing changes, when none is on meta."""
    if not any(on_meta(layer) for _, layer in layers):
        return False
    allocate_layers([layer for _, layer in layers], device)
    for index, layer in layers:
        init_layer(module, index, layer)
    return True


def place_layer(module: nn.Module, index: int, layer: nn.Module, device: torch.device) -> bool:
    """One layer on ``device``: allocated and initialised if built on meta (True, :func:`materialize_layers`), else
    moved (False)."""
    if materialize_layers(module, [(index, layer)], device):
        return True
    layer.to(device)
    return False


def allocate_layers(layers: Sequence[nn.Module], device: torch.device | str) -> None:
    """Allocate ``layers`` on ``device`` (``to_empty``: values are garbage until initialised or loaded), keeping the
    parameters they share: ``to_empty`` gives every module its own new Parameter, so each parameter used in several
    places among them (a tied embedding and head on one rank, a weight shared inside a layer) is one again after."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for layer in layers:
        for sub in layer.modules():
            for name, p in sub._parameters.items():
                if p is not None:
                    uses.setdefault(id(p), []).append((sub, name))
    for layer in layers:
        layer.to_empty(device=device)
    for owners in uses.values():
        first, first_name = owners[0]
        for sub, name in owners[1:]:
            sub._parameters[name] = first._parameters[first_name]


def init_layer(module: nn.Module, index: int, layer: nn.Module) -> None:
    """Initialise a freshly allocated layer: ``module.reset_layer(index, layer)`` when the module defines it, else
    each submodule's ``reset_parameters()`` (what one device did when it built the layer)."""
    reset_layer: Callable[[int, nn.Module], Any] | None = getattr(module, "reset_layer", None)
    if callable(reset_layer):
        reset_layer(index, layer)
        return
    for sub in layer.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


def warn_batch_norm(layers: LayerList, attr: str, microbatches: int) -> None:
    """Once per module, on rank 0 (every layer is still there): BatchNorm sees micro-batches, not the batch."""
    found = [f"{attr}.{i}{'.' + name if name else ''} ({type(sub).__name__})"
             for i, layer in enumerate(layers) for name, sub in layer.named_modules()
             if isinstance(sub, _compat.BatchNormBase)]
    if found and microbatches > 1:
        warnings.warn(
            f"PipelineStrategy with microbatches={microbatches}: BatchNorm normalises each micro-batch with its own "
            "statistics and updates its running statistics once per micro-batch, so training is correct but not "
            "bit-comparable with one device on the whole batch (like dropout; data-parallel replicas normalise "
            f"separately too, as under DDP without SyncBatchNorm). BatchNorm layers: {', '.join(found[:8])}"
            f"{' ...' if len(found) > 8 else ''}. For exact parity use microbatches=1 (gpipe), or a per-sample "
            "normalisation (LayerNorm, GroupNorm).", UserWarning, stacklevel=4)
