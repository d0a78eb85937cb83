"""What a sharded checkpoint holds: its names, constants, and optimizer state keyed by parameter name.

[Note: checkpoint format]
A pipeline checkpoint is a *directory* (Lightning's FSDP/ModelParallel convention):

* ``torch.distributed.checkpoint`` files (``.metadata`` + ``__<rank>_0.distcp``) holding flat keys
  ``state_dict.<name>`` — every entry of the plain module's ``state_dict()`` under its original name (both names of a
  tied parameter, as the plain module has them) — and ``optimizer_<i>.state.<param name>.<key>`` — optimizer state
  keyed by parameter *name*, not position. A tied parameter's optimizer state is stored once, under its canonical
  (first) name, by the rank that holds that layer. Schedules whose stages keep a per-parameter tensor across batches
  add ``stage_state.<param name>.<key>`` the same way ([Note: stage state in checkpoints]).
* ``meta.pt`` (rank 0): the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, precision, hparams) plus
  ``meta["pipeline"]``: the format tag, the writing layout (informative only), per optimizer its param groups'
  hyper-parameters with the *names* of their parameters in the plain model's order, and the name of the checksum file.
* ``checksums.json`` (rank 0, last): size and CRC-32 of every other file ([Note: checkpoint checksums]).

Nothing in it depends on the layout: any pipeline/data-parallel size and any schedule reads the keys it needs (each
rank reads only its own parameters), and :func:`~lightning_pipe.checkpoint.consolidate` turns it into an ordinary
Lightning ``.ckpt`` whose ``optimizer_states`` use the positional ids a single-device optimizer expects.
Only data-parallel replica 0 writes tensors, so replicas never write duplicates.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

FORMAT = "lightning_pipe.sharded/1"
META_FILENAME = "meta.pt"  # the same name Lightning's sharded strategies use (lightning.fabric.utilities.load)
DCP_METADATA = ".metadata"
CHECKSUMS_FILENAME = "checksums.json"
MODEL_PREFIX = "state_dict."
STAGE_STATE_PREFIX = "stage_state."
"""Flat-key prefix of what a schedule's stages keep per parameter across batches: [Note: stage state in checkpoints]
in ``lightning_pipe/runtime/stage_state.py``."""
NAMES_KEY = "optimizer_param_names"  # in consolidated files: per optimizer, per group, the parameter names


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------------------------------------- names
def tied_canonical(tied: Iterable[Any]) -> dict[str, str]:
    """Name -> canonical name for tied parameters (the first name, which the plain module's ``parameters()`` keeps)."""
    out: dict[str, str] = {}
    for tie in tied:
        for name in tie.names[1:]:
            out[name] = tie.names[0]
    return out


def optimizer_prefix(index: int) -> str:
    """The flat-key prefix of optimizer ``index``'s state: ``optimizer_<index>.state.``."""
    return f"optimizer_{index}.state."


def stage_state_key(name: str, key: str) -> str:
    """The flat key of what a stage keeps for parameter ``name`` under ``key``: ``stage_state.<name>.<key>``."""
    return f"{STAGE_STATE_PREFIX}{name}.{key}"


def saved_layout(pipeline: Mapping[str, Any]) -> dict[str, Any] | None:
    """The layout a checkpoint's ``meta["pipeline"]`` says it was written with (informative, as data from the file:
    ``None`` when it is not a dict; its ``stages`` left out unless they are lists of layer indices)."""
    layout = pipeline.get("layout")
    if not isinstance(layout, dict):
        return None
    stages = layout.get("stages")
    if stages is not None and not (isinstance(stages, list) and all(
            isinstance(r, list) and all(type(i) is int for i in r) for r in stages)):
        layout = {k: v for k, v in layout.items() if k != "stages"}
    return layout


def hyper_parameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters: everything but its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


POSITIONS_BY_KEY = "_lightning_pipe_keys_are_positions"
"""Set (True) on a module container whose children's keys are their positions in the whole model, for a rank that
holds only some of them: the experts of a sharded ``RoutedExperts`` (keys ``"0"`` .. ``"n-1"``)."""


def parameter_positions(module: nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Each parameter's place in the *whole* module's ``named_parameters()`` order, as a sortable key, read from the
    part a rank holds: a module's own parameters before its children's, each in registration order; children of a
    container marked :data:`POSITIONS_BY_KEY` sit at their key (an expert-parallel rank holds experts 2 and 3 of 4:
    their keys, not their local places 0 and 1, tell where they go among another rank's experts 0 and 1)."""
    out: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()

    def walk(m: nn.Module, path: str, key: tuple[int, ...]) -> None:
        for i, (name, p) in enumerate(m._parameters.items()):
            if p is not None and id(p) not in seen:  # a shared parameter sits where named_parameters() puts it
                seen.add(id(p))
                out[path + name] = (*key, 0, i)
        by_key = getattr(m, POSITIONS_BY_KEY, False)
        for i, (name, child) in enumerate(m._modules.items()):
            if child is not None:
                walk(child, f"{path}{name}.", (*key, 1, int(name) if by_key else i))

    walk(module, prefix, ())
    return out


Position = tuple[int, tuple[int, ...]]
"""Where a parameter sits in the plain model's ``parameters()`` order: (layer index, place inside the layer)."""


class ModuleNames:
    """This rank's parameters by canonical name, and each name's position in the plain model's parameter order."""

    def __init__(self, module: nn.Module, layers_attr: str = "layers", tied: Iterable[Any] = ()) -> None:
        canon = tied_canonical(tied)
        self.name_of: dict[int, str] = {}
        self.owned: set[int] = set()  # params whose optimizer state this rank saves (canonical holders)
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in self.name_of:
                continue
            self.name_of[id(p)] = canon.get(name, name)
            if name not in canon:
                self.owned.add(id(p))
        # The plain model's parameters() order: layer by layer, inside a layer as parameter_positions places it (the
        # same on every rank, whichever part of the layer it holds), so ranks' orders merge into the whole model's.
        self.order: dict[str, Position] = {}
        layers = getattr(module, layers_attr, None)
        if layers is not None:
            for i, (key, layer) in enumerate(layers._modules.items()):
                for full, place in parameter_positions(layer, f"{layers_attr}.{key}.").items():
                    if full not in canon:
                        self.order[full] = (i, place)
        for k, (n, _) in enumerate(module.named_parameters()):
            self.order.setdefault(n, (sys.maxsize, (k,)))


def name_mismatch_message(path: Any, missing: Sequence[str], unexpected: Sequence[str],
                          shapes: Sequence[str] = ()) -> str:
    """Every way the checkpoint and the model differ, in one message: names missing from the checkpoint, names the
    model lacks, and ``shapes`` (``"name: checkpoint [..] vs model [..]"``), which no loading option can skip."""
    def fmt(names: Sequence[str]) -> str:
        names = sorted(names)
        return ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")

    parts = [f"The checkpoint {str(path)!r} does not match the model (was it written by a different model?)."]
    if shapes:
        parts.append(f"Shapes differ for: {fmt(shapes)}.")
    if missing:
        parts.append(f"Missing from the checkpoint: {fmt(missing)}.")
    if unexpected:
        parts.append(f"Unexpected in the checkpoint (no such parameter/buffer in the model): {fmt(unexpected)}.")
    parts.append("Load a checkpoint of this model" + ("." if shapes else
                 ", or set `model.strict_loading = False` to load the names that match."))
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------------------- optimizer state by name
class ShardedOptimizerState(dict):
    """What ``PipelineStrategy.optimizer_state`` returns: flat name-keyed tensors + the groups (names, hyper-params)."""


def flatten_optimizer(optimizer: torch.optim.Optimizer, names: ModuleNames, index: int) -> ShardedOptimizerState:
    """This rank's optimizer state under flat name keys, and its groups with parameter names instead of ids."""
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    flat: dict[str, Any] = {}
    for idx, p in enumerate(params):
        if id(p) not in names.owned:
            continue
        for key, value in sd["state"].get(idx, {}).items():
            flat[f"{optimizer_prefix(index)}{names.name_of[id(p)]}.{key}"] = value
    groups = [{**hyper_parameters(g), "params": [names.name_of[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return ShardedOptimizerState(flat=flat, groups=groups)


def merge_groups(per_rank: Sequence[Sequence[Sequence[dict]]], order: Mapping[str, Position]) -> list[list[dict]]:
    """Every rank's optimizers' groups -> one list of groups per optimizer, names in the plain model's order."""
    merged: list[list[dict]] = []
    for i, groups in enumerate(per_rank[0]):
        out = []
        for j, group in enumerate(groups):
            names = {n for rank in per_rank for n in rank[i][j]["params"]}
            out.append({**hyper_parameters(group), "params": sorted(names, key=lambda n: order.get(n, (sys.maxsize, ())))})
        merged.append(out)
    return merged


def optimizer_entries(flat_keys: Iterable[str], index: int) -> dict[str, dict[str, str]]:
    """Flat DCP keys of optimizer ``index`` -> {param name: {state key: flat key}}."""
    prefix = optimizer_prefix(index)
    out: dict[str, dict[str, str]] = {}
    for key in flat_keys:
        if key.startswith(prefix):
            name, _, skey = key[len(prefix):].rpartition(".")
            out.setdefault(name, {})[skey] = key
    return out


def build_local_optimizer_state(optimizer: torch.optim.Optimizer, names: ModuleNames, saved_groups: Sequence[dict],
                                state_of: Callable[[str], dict[str, Any] | None]) -> dict[str, Any]:
    """A ``state_dict()`` for this rank's optimizer from name-keyed state and the saved groups' hyper-parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, p in enumerate(params):
        entries = state_of(names.name_of[id(p)])
        if entries:
            state[idx] = entries
    groups, offset = [], 0
    for g, saved in zip(optimizer.param_groups, saved_groups):
        ids = list(range(offset, offset + len(g["params"])))
        offset += len(g["params"])
        groups.append({**hyper_parameters(saved), "params": ids})
    return {"state": state, "param_groups": groups}


def check_groups(optimizer: torch.optim.Optimizer, names: ModuleNames, saved_groups: Sequence[dict],
                 index: int) -> str | None:
    """Why this rank's optimizer cannot take the saved groups (``None`` if it can)."""
    if len(saved_groups) != len(optimizer.param_groups):
        return (f"Optimizer {index} has {len(optimizer.param_groups)} param groups but the checkpoint's has "
                f"{len(saved_groups)}: configure_optimizers must build the same groups as the run that saved it.")
    for j, (g, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        allowed = set(saved["params"])
        stray = [names.name_of[id(p)] for p in g["params"] if names.name_of[id(p)] not in allowed]
        if stray:
            return (f"Optimizer {index}, param group {j}: parameters {stray[:6]} are not in that group in the "
                    "checkpoint: configure_optimizers must group parameters as the run that saved it did.")
    return None


def names_from_positions(saved: dict[str, Any], group_names: Sequence[Sequence[str]], index: int) -> dict[str, dict]:
    """Positional optimizer state of a single-file checkpoint -> {param name: state}."""
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    flat_names = [n for g in group_names for n in g]
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g) for g in group_names]:
        raise CheckpointError(
            f"Optimizer {index} in the checkpoint has groups of sizes {[len(g['params']) for g in saved['param_groups']]}"
            f" but the model's optimizer has {[len(g) for g in group_names]}: it was written for another model or "
            "another configure_optimizers.")
    return {name: saved["state"][i] for i, name in zip(ids, flat_names) if i in saved["state"]}


def named_groups(saved: dict[str, Any], group_names: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """A positional optimizer state's param groups with the parameters' names instead of their ids."""
    return [{**hyper_parameters(g), "params": list(n)} for g, n in zip(saved["param_groups"], group_names)]
