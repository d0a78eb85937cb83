"""Move layers between pipeline ranks in memory, with their optimizer state, and rebuild the engine for the new split.

[Note: moving a layer]
At a step boundary (after the optimizer step) every rank runs the same list of moves, in layer order, and for each
replica the holder sends the layer to its new rank: one ``torch.save`` of the layer module (its structure,
parameters and buffers, whatever its class) plus, per parameter name, the optimizer slot (optimizer, param group)
and the optimizer's state for it (Adam's ``step``, ``exp_avg``, ``exp_avg_sq``, ...). Point-to-point sends in one
global order cannot deadlock: each rank's sends and receives are a subsequence of that order. The sender puts a
:class:`~lightning_pipe.layers.stages.RemoteLayer` in the layer's place; the receiver puts the layer where its placeholder
was (same name, so checkpoints and the optimizer keep naming it ``layers.<i>...``).

Tied parameters (one object used by several layers): a rank that already holds a copy keeps it, and an arriving use
is pointed at that copy (the copies are equal: their gradients are summed and every holder steps them alike);
otherwise the first arriving copy becomes this rank's. The user's optimizers are changed in place: parameters that
left are removed from their param group and from ``optimizer.state``; arrivals are appended to the param group they
were in, with their state. Learning-rate schedulers and Lightning's references keep pointing at the same objects.
Gradients do not travel: Lightning zeroes them before the next batch's backward (the first of an accumulation).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.config import PipelineConfig, config_error
from lightning_pipe.layers.partition import ranges_of
from lightning_pipe.layers.stages import RemoteLayer, TiedParameter, find_layers
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.rebalance.decide import Move
from lightning_pipe.runtime.build import PipelineLayout, build_engine
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.trace.memory import ActivationMeter

Slot = tuple[int, int]
"""(optimizer index, param group index)."""


def _slots(optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, Slot]:
    return {id(p): (o, g) for o, opt in enumerate(optimizers)
            for g, group in enumerate(opt.param_groups) for p in group["params"]}


def _pack(layer: nn.Module, optimizers: Sequence[torch.optim.Optimizer], slots: dict[int, Slot]) -> bytes:
    entries: dict[str, Any] = {}
    for name, param in layer.named_parameters(remove_duplicate=False):
        slot = slots.get(id(param))
        state: dict[str, tuple[Any, bool | None]] = {}
        if slot is not None:
            for key, value in optimizers[slot[0]].state.get(param, {}).items():
                if isinstance(value, torch.Tensor):  # (tensor, on the parameter's device?)
                    state[key] = (value.detach().cpu().clone(), value.device == param.device)
                else:
                    state[key] = (value, None)
        entries[name] = (slot, state)
    buffer = io.BytesIO()
    torch.save({"layer": layer, "entries": entries}, buffer)
    return buffer.getvalue()


class _DryPickler(pickle.Pickler):
    """Pickles what ``torch.save`` of a layer pickles (its class, attributes, hooks and tensor metadata), but not
    the tensors' bytes: storages are persistent ids, as in ``torch.save``, so the check costs no copy."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
            return ("storage", id(obj))
        return None


class _Sink:
    def write(self, data: Any) -> int:
        return len(data)


def check_movable(module: nn.Module, layers_attr: str, every: int) -> None:
    """Refuse, at setup, a layer that a move would fail to send ([Note: moving a layer]: ``torch.save`` of the layer
    module), instead of failing at the first move, possibly hours in. Run on every rank over the whole layer list
    before it is split, so all ranks refuse together."""
    for index, layer in enumerate(find_layers(module, layers_attr)):
        try:
            _DryPickler(_Sink(), protocol=2).dump(layer)  # torch.save's default protocol
        except Exception as err:  # pickle raises what the object raises (PicklingError, TypeError, ...)
            raise config_error(
                "Rebalancing moves a layer between ranks by pickling it (torch.save of the whole layer module: its "
                "class, attributes, parameters, buffers and hooks), so every layer must pickle.",
                f"layer {index} ({type(layer).__name__}): {type(err).__name__}: {err}, with "
                f"rebalance_every_n_steps={every}", "rebalance_every_n_steps", "set it to None",
                fix="Make the layer picklable (module-level classes and functions instead of lambdas or local ones, "
                    "in its attributes and its hooks)") from None


def _transport_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")  # NCCL sends GPU tensors, gloo CPU ones


def _send(data: bytes, dst: int, device: torch.device) -> None:
    dev = _transport_device(device)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=dev), dst)
    dist.send(payload.to(dev), dst)


def _recv(src: int, device: torch.device) -> dict[str, Any]:
    dev = _transport_device(device)
    size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.recv(size, src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.recv(payload, src)
    # A whole module from a rank of this job, not a file: inside the job's trust boundary, like torch.distributed's
    # object collectives ([Note: a checkpoint is data]; docs/checkpoints.md, "Checkpoints from others").
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=False)


def move_layers(module: nn.Module, layers_attr: str, moves: Sequence[Move], topology: Topology,
                tied: Sequence[TiedParameter], optimizers: Sequence[torch.optim.Optimizer],
                device: torch.device) -> list[int]:
    """Run ``moves`` on every replica ([Note: moving a layer]); return the layers this rank received. Collective."""
    layers = find_layers(module, layers_attr)
    keys = list(layers._modules.keys())
    p, me = topology.pipeline_size, topology.global_rank
    named = dict(module.named_parameters(remove_duplicate=False))
    tie_of = {name: t for t, tie in enumerate(tied) for name in tie.names}
    canonical: dict[int, nn.Parameter] = {}  # tie -> this rank's copy (held before the move, or first to arrive)
    for name, t in tie_of.items():
        if name in named and t not in canonical:
            canonical[t] = named[name]
    slots = _slots(optimizers)
    arrived: list[tuple[int, nn.Module, dict[str, Any]]] = []
    for move in moves:
        for dp_rank in range(topology.data_parallel_size):
            src, dst = dp_rank * p + move.src, dp_rank * p + move.dst
            if me == src:
                _send(_pack(layers._modules[keys[move.layer]], optimizers, slots), dst, device)
                layers._modules[keys[move.layer]] = RemoteLayer(move.layer, -1, move.dst)
            elif me == dst:
                bundle = _recv(src, device)
                layer = bundle["layer"].to(device)
                layers._modules[keys[move.layer]] = layer
                arrived.append((move.layer, layer, bundle["entries"]))
    for index, layer, _ in arrived:
        _retie(layer, f"{layers_attr}.{keys[index]}.", tie_of, canonical)
    _update_optimizers(module, optimizers, arrived)
    return [index for index, _, _ in arrived]


def _retie(layer: nn.Module, prefix: str, tie_of: dict[str, int], canonical: dict[int, nn.Parameter]) -> None:
    for name, param in list(layer.named_parameters(remove_duplicate=False)):
        t = tie_of.get(prefix + name)
        if t is None:
            continue
        if t not in canonical:
            canonical[t] = param
        elif canonical[t] is not param:
            owner_path, _, leaf = name.rpartition(".")
            layer.get_submodule(owner_path)._parameters[leaf] = canonical[t]


def _update_optimizers(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                       arrived: Sequence[tuple[int, nn.Module, dict[str, Any]]]) -> None:
    held = {id(p) for p in module.parameters()}
    present: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            kept = []
            for param in group["params"]:
                if id(param) in held:
                    kept.append(param)
                    present.add(id(param))
                else:
                    opt.state.pop(param, None)
            group["params"] = kept
    for _, layer, entries in arrived:
        for name, param in layer.named_parameters(remove_duplicate=False):
            slot, state = entries.get(name, (None, {}))
            if slot is None or id(param) in present:
                continue
            opt = optimizers[slot[0]]
            opt.param_groups[slot[1]]["params"].append(param)
            opt.state[param] = {k: (v.to(param.device) if on_device else v) if on_device is not None else v
                                for k, (v, on_device) in state.items()}
            present.add(id(param))


def rebuild_engine(old: PipelineEngine, module: nn.Module, config: PipelineConfig, layout: PipelineLayout,
                   counts: Sequence[int]) -> tuple[PipelineEngine, PipelineLayout]:
    """A new engine for ``counts`` layers per stage, through :func:`~lightning_pipe.runtime.build.build_engine` with the
    new layout (same plan and placement: nothing is re-split or broadcast; new stage modules, schedule and tie
    groups). What was attached to the old engine (loss scaler, step contexts such as the trace recorder and the
    memory meter) is carried over and pointed at the new one. Collective (new process groups)."""
    new_layout = PipelineLayout(tuple(ranges_of(counts)), layout.tied, layout.plan)
    engine, new_layout = build_engine(module, config, layout.plan, old.groups.topology, old.device, new_layout)
    engine.loss_scaler = old.loss_scaler
    for context in old.step_contexts:
        owner = getattr(context, "__self__", None)
        if owner is not None and getattr(owner, "engine", None) is old:
            owner.engine = engine  # e.g. lightning_pipe.trace.StepRecorder
            if hasattr(owner, "stage_ids"):
                owner.stage_ids = [st.stage_index for st in engine.stages]
        if isinstance(owner, ActivationMeter):
            owner.track_parameters(engine.parameters)
        engine.step_contexts.append(context)
    return engine, new_layout
