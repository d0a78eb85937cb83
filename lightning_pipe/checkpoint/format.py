"""Sharded checkpoints that outlive the pipeline layout that wrote them.

[Note: checkpoint format]
A pipeline checkpoint is a *directory* (Lightning's FSDP/ModelParallel convention):

* ``torch.distributed.checkpoint`` files (``.metadata`` + ``__<rank>_0.distcp``) holding flat keys
  ``state_dict.<name>`` — every entry of the plain module's ``state_dict()`` under its original name (both names of a
  tied parameter, as the plain module has them) — and ``optimizer_<i>.state.<param name>.<key>`` — optimizer state
  keyed by parameter *name*, not position. A tied parameter's optimizer state is stored once, under its canonical
  (first) name, by the rank that holds that layer.
* ``meta.pt`` (rank 0): the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, precision, hparams) plus
  ``meta["pipeline"]``: the format tag, the writing layout (informative only) and, per optimizer, its param groups'
  hyper-parameters with the *names* of their parameters in the plain model's order.

Nothing in it depends on the layout: any pipeline/data-parallel size and any schedule reads the keys it needs (each
rank reads only its own parameters), and :func:`consolidate` turns it into an ordinary Lightning ``.ckpt`` whose
``optimizer_states`` use the positional ids a single-device optimizer expects.
Only data-parallel replica 0 writes tensors, so replicas never write duplicates.

[Note: never half-written]
Every rank writes into ``.<name>.partial-<token>`` next to the target; after the collective DCP save (which returns
on the coordinator only once every rank's files are written and fsynced), rank 0 writes ``meta.pt`` and renames the
directory into place. An existing checkpoint at the same path is first renamed aside to ``.<name>.old-<token>`` and
removed after the swap; if a process dies between those two renames, loading the path finds the old copy and uses
it. A rank killed while writing leaves only a ``.partial`` directory: the previous checkpoint, and any link to it
(``ModelCheckpoint``'s ``last``), stay valid. Stale ``.partial`` directories are removed by the next good save.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

FORMAT = "lightning_pipe.sharded/1"
META_FILENAME = "meta.pt"  # the same name Lightning's sharded strategies use (lightning.fabric.utilities.load)
DCP_METADATA = ".metadata"
MODEL_PREFIX = "state_dict."
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


def _opt_prefix(i: int) -> str:
    return f"optimizer_{i}.state."


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
        # The plain model's parameters() order: layer by layer, registration order within a layer.
        self.order: dict[str, tuple[int, int]] = {}
        layers = getattr(module, layers_attr, None)
        if layers is not None:
            for i, (key, layer) in enumerate(layers._modules.items()):
                for j, (n, _) in enumerate(layer.named_parameters()):
                    full = f"{layers_attr}.{key}.{n}"
                    if full not in canon:
                        self.order[full] = (i, j)
        for k, (n, _) in enumerate(module.named_parameters()):
            self.order.setdefault(n, (sys.maxsize, k))


# ---------------------------------------------------------------------------------------------------------- flatten
class ShardedOptimizerState(dict):
    """What ``PipelineStrategy.optimizer_state`` returns: flat name-keyed tensors + the groups (names, hyper-params)."""


def flatten_optimizer(optimizer: torch.optim.Optimizer, names: ModuleNames, index: int) -> ShardedOptimizerState:
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    flat: dict[str, Any] = {}
    for idx, p in enumerate(params):
        if id(p) not in names.owned:
            continue
        for key, value in sd["state"].get(idx, {}).items():
            flat[f"{_opt_prefix(index)}{names.name_of[id(p)]}.{key}"] = value
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        hyper["params"] = [names.name_of[id(p)] for p in g["params"]]
        groups.append(hyper)
    return ShardedOptimizerState(flat=flat, groups=groups)


def merge_groups(per_rank: Sequence[Sequence[Sequence[dict]]], order: Mapping[str, tuple[int, int]]) -> list[list[dict]]:
    """Every rank's optimizers' groups -> one list of groups per optimizer, names in the plain model's order."""
    merged: list[list[dict]] = []
    for i, groups in enumerate(per_rank[0]):
        out = []
        for j, group in enumerate(groups):
            names = {n for rank in per_rank for n in rank[i][j]["params"]}
            out.append({**{k: v for k, v in group.items() if k != "params"},
                        "params": sorted(names, key=lambda n: order.get(n, (sys.maxsize, 0)))})
        merged.append(out)
    return merged


# ---------------------------------------------------------------------------------------------------------- inspection
def _dcp_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))


def describe(path: str | os.PathLike) -> str:
    """``"sharded"`` or ``"file"``; a :class:`CheckpointError` that says what is wrong otherwise."""
    path = _recover(Path(path))
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {str(path)!r}: the path does not exist.")
    if path.is_file():
        return "file"
    has_md, has_meta = (path / DCP_METADATA).is_file(), (path / META_FILENAME).is_file()
    if not has_md and not has_meta:
        raise CheckpointError(
            f"{str(path)!r} is a directory but not a lightning_pipe checkpoint (it has neither the "
            f"torch.distributed.checkpoint `{DCP_METADATA}` file nor `{META_FILENAME}`). Pass the checkpoint "
            "directory written by PipelineStrategy/ModelCheckpoint, or a single-file .ckpt.")
    if not (has_md and has_meta):
        raise CheckpointError(
            f"Checkpoint directory {str(path)!r} is incomplete: `{DCP_METADATA if not has_md else META_FILENAME}` is "
            "missing. It was not written by a finished save (PipelineStrategy renames a save into place only when "
            "complete), or files were removed afterwards; use an earlier checkpoint.")
    return "sharded"


def read_sharded_metadata(path: Path) -> tuple[Any, dict[str, Any]]:
    """(DCP metadata, meta.pt) after checking that every data file the metadata refers to is there, whole."""
    try:
        md = _dcp_reader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling garbage raises anything
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: `{DCP_METADATA}` is unreadable "
                              f"({type(err).__name__}: {err}); the checkpoint is corrupted.") from err
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"Checkpoint directory {str(path)!r} is incomplete: data file {rel!r} is missing.")
        if f.stat().st_size < size:
            raise CheckpointError(f"Checkpoint directory {str(path)!r} is corrupted: data file {rel!r} has "
                                  f"{f.stat().st_size} bytes, the metadata needs {size} (truncated?).")
    try:
        meta = torch.load(path / META_FILENAME, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: `{META_FILENAME}` is unreadable "
                              f"({type(err).__name__}: {err}); the checkpoint is corrupted.") from err
    if not isinstance(meta, dict) or meta.get("pipeline", {}).get("format") != FORMAT:
        raise CheckpointError(f"Checkpoint directory {str(path)!r} was not written by lightning_pipe "
                              f"(`{META_FILENAME}` lacks the {FORMAT!r} tag).")
    return md, meta


def load_file(path: Path) -> dict[str, Any]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - not a zip file: no mmap
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"{str(path)!r} is not a checkpoint: torch.load failed "
                                  f"({type(err).__name__}: {err}).") from err
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), Mapping):
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint: it has no 'state_dict' dictionary.")
    return ckpt


def name_mismatch_message(path: Any, missing: Sequence[str], unexpected: Sequence[str]) -> str:
    def fmt(names: Sequence[str]) -> str:
        names = sorted(names)
        return ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")

    parts = [f"The checkpoint {str(path)!r} does not match the model (was it written by a different model?)."]
    if missing:
        parts.append(f"Missing from the checkpoint: {fmt(missing)}.")
    if unexpected:
        parts.append(f"Unexpected in the checkpoint (no such parameter/buffer in the model): {fmt(unexpected)}.")
    parts.append("Load a checkpoint of this model, or set `model.strict_loading = False` to load the names that match.")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------------------- atomic save
def _recover(path: Path) -> Path:
    """A crash between the two renames of a swap leaves only ``.<name>.old-*``: put it back."""
    if path.exists() or path.is_symlink():
        return path
    olds = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
    for old in olds:
        if old.is_file() or (old / META_FILENAME).is_file():
            try:
                os.replace(old, path)
            except OSError:
                return old
            return path
    return path


def partial_path(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}.partial-{token}"


def commit(tmp: Path, path: Path, token: str) -> None:
    """Rename a finished save into place (rank 0 only), keeping the old checkpoint until the new one is there."""
    old = None
    if path.exists() or path.is_symlink():
        old = path.parent / f".{path.name}.old-{token}"
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        _remove(old)
    for stale in path.parent.glob(f".{path.name}.partial-*"):
        _remove(stale)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def write_shards(state: dict[str, Any], tmp: Path, no_dist: bool = False) -> None:
    """The collective DCP write (every rank calls it; data-parallel replicas > 0 pass an empty dict)."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    save(state, storage_writer=FileSystemWriter(str(tmp)), no_dist=no_dist)


def save_file_atomic(obj: Any, path: Path) -> None:
    tmp = partial_path(path, uuid.uuid4().hex[:8])
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    commit(tmp, path, uuid.uuid4().hex[:8])


# ---------------------------------------------------------------------------------------------------------- loading
def load_flat(path: Path, keys: Mapping[str, Any], md: Any) -> dict[str, Any]:
    """Read the given flat keys (this rank's own) from a sharded checkpoint, without collectives."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target: dict[str, Any] = {}
    for key, dest in keys.items():
        info = md.state_dict_metadata[key]
        if isinstance(dest, Tensor):
            target[key] = dest
        elif isinstance(info, TensorStorageMetadata):
            target[key] = torch.empty(info.size, dtype=info.properties.dtype)
        else:
            target[key] = None  # a pickled object: DCP puts the value in place
    if target:
        load(target, storage_reader=_dcp_reader(path), no_dist=True)
    return target


def optimizer_entries(flat_keys: Iterable[str], index: int) -> dict[str, dict[str, str]]:
    """Flat DCP keys of optimizer ``index`` -> {param name: {state key: flat key}}."""
    prefix = _opt_prefix(index)
    out: dict[str, dict[str, str]] = {}
    for key in flat_keys:
        if key.startswith(prefix):
            name, _, skey = key[len(prefix):].rpartition(".")
            out.setdefault(name, {})[skey] = key
    return out


def build_local_optimizer_state(optimizer: torch.optim.Optimizer, names: ModuleNames, saved_groups: Sequence[dict],
                                state_of: Callable[[str], Optional[dict[str, Any]]]) -> dict[str, Any]:
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
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def check_groups(optimizer: torch.optim.Optimizer, names: ModuleNames, saved_groups: Sequence[dict],
                 index: int) -> Optional[str]:
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


# ---------------------------------------------------------------------------------------------------------- convert
def _read_all(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from lightning_pipe._compat.torch import dcp_load_everything

    _, meta = read_sharded_metadata(path)
    return dcp_load_everything(_dcp_reader(path)), meta


def consolidated(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint directory as one ordinary Lightning checkpoint dict (what a single device saves)."""
    path = _recover(Path(path))
    if describe(path) == "file":
        return load_file(path)
    flat, meta = _read_all(path)
    ckpt = {k: v for k, v in meta.items() if k != "pipeline"}
    ckpt["state_dict"] = {k[len(MODEL_PREFIX):]: v for k, v in flat.items() if k.startswith(MODEL_PREFIX)}
    optimizers = meta["pipeline"].get("optimizers")
    if optimizers is not None:
        states, all_names = [], []
        for i, groups in enumerate(optimizers):
            entries = optimizer_entries(flat, i)
            ids = {}
            param_groups = []
            for g in groups:
                param_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                     "params": [ids.setdefault(n, len(ids)) for n in g["params"]]})
            state = {ids[n]: {k: flat[fk] for k, fk in entries[n].items()} for n in entries if n in ids}
            states.append({"state": state, "param_groups": param_groups})
            all_names.append([list(g["params"]) for g in groups])
        ckpt["optimizer_states"] = states
        ckpt[NAMES_KEY] = all_names
    return ckpt


def consolidate(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write a sharded checkpoint directory as one ``.ckpt`` file loadable on one device; returns ``dst``."""
    dst = Path(dst)
    save_file_atomic(consolidated(src), dst)
    return dst


def as_file(path: str | os.PathLike) -> io.BytesIO:
    """A sharded checkpoint as an in-memory file: ``MyModel.load_from_checkpoint(as_file("epoch=1.ckpt"))``."""
    buf = io.BytesIO()
    torch.save(consolidated(path), buf)
    buf.seek(0)
    return buf


def split(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Turn a single-file checkpoint into a sharded directory that any pipeline layout loads.

    Needs the parameter names of the optimizer state: files written by :func:`consolidate` carry them. A plain
    single-device ``.ckpt`` does not; pass it straight to ``trainer.fit(ckpt_path=...)`` under PipelineStrategy
    (every rank takes its own parameters, matching positions to names with the model at hand) — or split only its
    weights with ``weights_only=True``-saved files.
    """
    src, dst = Path(src), Path(dst)
    ckpt = load_file(src)
    flat: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in ckpt["state_dict"].items()}
    meta = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states", NAMES_KEY)}
    optimizers = None
    if ckpt.get("optimizer_states"):
        if NAMES_KEY not in ckpt:
            raise CheckpointError(
                f"{str(src)!r} has optimizer state keyed by position only, so it cannot be split without the model. "
                "Pass it directly to `trainer.fit(model, ckpt_path=...)` under PipelineStrategy (each rank takes "
                "its own parameters) and save from there.")
        optimizers = []
        for i, (saved, group_names) in enumerate(zip(ckpt["optimizer_states"], ckpt[NAMES_KEY])):
            for name, entries in names_from_positions(saved, group_names, i).items():
                for k, v in entries.items():
                    flat[f"{_opt_prefix(i)}{name}.{k}"] = v
            optimizers.append([{**{k: v for k, v in g.items() if k != "params"}, "params": list(n)}
                               for g, n in zip(saved["param_groups"], group_names)])
    meta["pipeline"] = {"format": FORMAT, "optimizers": optimizers, "layout": {"written_by": "split"}}
    token = uuid.uuid4().hex[:8]
    tmp = partial_path(dst, token)
    write_shards({k: (v.contiguous() if isinstance(v, Tensor) else v) for k, v in flat.items()}, tmp, no_dist=True)
    torch.save(meta, tmp / META_FILENAME)
    commit(tmp, dst, token)
    return dst


def checkpoint_size(path: str | os.PathLike) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.checkpoint",
        description="Convert between lightning_pipe's sharded checkpoint directories and single-file .ckpt files.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="sharded directory -> one .ckpt loadable on one device")
    c.add_argument("src")
    c.add_argument("dst")
    s = sub.add_parser("split", help="single .ckpt (from `consolidate`, or weights only) -> sharded directory")
    s.add_argument("src")
    s.add_argument("dst")
    i = sub.add_parser("info", help="print what a checkpoint holds")
    i.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            out = consolidate(args.src, args.dst)
            print(f"wrote {out} ({checkpoint_size(out) / 2**20:.2f} MiB)")
        elif args.command == "split":
            out = split(args.src, args.dst)
            print(f"wrote {out}/ ({checkpoint_size(out) / 2**20:.2f} MiB)")
        else:
            kind = describe(args.path)
            ckpt = consolidated(args.path)
            n = sum(v.numel() for v in ckpt["state_dict"].values() if isinstance(v, Tensor))
            print(f"{args.path}: {kind} checkpoint, {len(ckpt['state_dict'])} tensors ({n:,} elements), "
                  f"{len(ckpt.get('optimizer_states') or [])} optimizer(s), epoch {ckpt.get('epoch')}, "
                  f"global_step {ckpt.get('global_step')}, {checkpoint_size(args.path) / 2**20:.2f} MiB on disk")
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
