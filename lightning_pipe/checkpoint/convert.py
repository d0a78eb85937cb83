"""Between a sharded checkpoint directory and one ordinary Lightning ``.ckpt`` file, in one process."""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.checkpoint.checksums import verify_checksums
from lightning_pipe.checkpoint.files import commit, partial_path, save_file_atomic, seal, write_shards
from lightning_pipe.checkpoint.format import (
    FORMAT,
    MODEL_PREFIX,
    NAMES_KEY,
    CheckpointError,
    hyper_parameters,
    named_groups,
    names_from_positions,
    optimizer_entries,
    optimizer_prefix,
)
from lightning_pipe.checkpoint.plain import to_plain
from lightning_pipe.checkpoint.reading import dcp_reader, describe, load_file, read_sharded_metadata, refusal_in


def _read_all(path: Path, weights_only: bool | None) -> tuple[dict[str, Any], dict[str, Any]]:
    from lightning_pipe._compat.torch import dcp_load_everything

    verify_checksums(path)  # every file, in this process
    _, meta = read_sharded_metadata(path, weights_only)
    try:
        return dcp_load_everything(dcp_reader(path, weights_only)), meta
    except BaseException as err:  # DCP's CheckpointException is one
        refusal = refusal_in(err)
        if refusal is None:
            raise
        raise refusal from None


def consolidated(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded checkpoint directory as one ordinary Lightning checkpoint dict (what a single device saves).

    Verifies the files' checksums first; reads only (a checkpoint left aside by an interrupted save is not put
    back: call :func:`~lightning_pipe.checkpoint.recover` for that). A single-file checkpoint is returned as loaded.
    Read as data unless ``weights_only=False`` says its source is trusted ([Note: a checkpoint is data]).
    """
    path = Path(path)
    if describe(path) == "file":
        return load_file(path, weights_only)
    flat, meta = _read_all(path, weights_only)
    ckpt = {k: v for k, v in meta.items() if k != "pipeline"}
    ckpt["state_dict"] = {k[len(MODEL_PREFIX):]: v for k, v in flat.items() if k.startswith(MODEL_PREFIX)}
    optimizers = meta["pipeline"].get("optimizers")
    if optimizers is not None:
        states, all_names = [], []
        for i, groups in enumerate(optimizers):
            entries = optimizer_entries(flat, i)
            ids: dict[str, int] = {}
            param_groups = [{**hyper_parameters(g), "params": [ids.setdefault(n, len(ids)) for n in g["params"]]}
                            for g in groups]
            state = {ids[n]: {k: flat[fk] for k, fk in entries[n].items()} for n in entries if n in ids}
            states.append({"state": state, "param_groups": param_groups})
            all_names.append([list(g["params"]) for g in groups])
        ckpt["optimizer_states"] = states
        ckpt[NAMES_KEY] = all_names
    return ckpt


def consolidate(src: str | os.PathLike, dst: str | os.PathLike, weights_only: bool | None = None) -> Path:
    """Write a sharded checkpoint directory as one ``.ckpt`` file loadable on one device; returns ``dst``. Its
    entries are plain data ([Note: plain checkpoint entries]): ``torch.load``'s default reads it."""
    dst = Path(dst)
    save_file_atomic(consolidated(src, weights_only), dst)
    return dst


def as_file(path: str | os.PathLike, weights_only: bool | None = None) -> io.BytesIO:
    """A sharded checkpoint as an in-memory file: ``MyModel.load_from_checkpoint(as_file("epoch=1.ckpt"))``. Read as
    data unless ``weights_only=False``; what it holds besides tensors is plain data, so Lightning's default reads it."""
    buf = io.BytesIO()
    torch.save(to_plain(consolidated(path, weights_only)), buf)
    buf.seek(0)
    return buf


def shard(src: str | os.PathLike, dst: str | os.PathLike, weights_only: bool | None = None) -> Path:
    """Turn a single-file checkpoint into a sharded directory that any pipeline layout loads; returns ``dst``.

    Needs the parameter names of the optimizer state: files written by :func:`consolidate` carry them. A plain
    single-device ``.ckpt`` does not; pass it straight to ``trainer.fit(ckpt_path=...)`` under PipelineStrategy
    (every rank takes its own parameters, matching positions to names with the model at hand) — or shard only its
    weights (files saved with ``save_weights_only=True``). Read as data unless ``weights_only=False``.
    """
    src, dst = Path(src), Path(dst)
    ckpt = load_file(src, weights_only)
    flat: dict[str, Any] = {MODEL_PREFIX + k: v for k, v in ckpt["state_dict"].items()}
    meta = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states", NAMES_KEY)}
    optimizers = None
    if ckpt.get("optimizer_states"):
        if NAMES_KEY not in ckpt:
            raise CheckpointError(
                f"{str(src)!r} has optimizer state keyed by position only, so it cannot be sharded without the "
                "model. Pass it directly to `trainer.fit(model, ckpt_path=...)` under PipelineStrategy (each rank "
                "takes its own parameters) and save from there.")
        optimizers = []
        for i, (saved, group_names) in enumerate(zip(ckpt["optimizer_states"], ckpt[NAMES_KEY])):
            for name, entries in names_from_positions(saved, group_names, i).items():
                for k, v in entries.items():
                    flat[f"{optimizer_prefix(i)}{name}.{k}"] = v
            optimizers.append(named_groups(saved, group_names))
    meta["pipeline"] = {"format": FORMAT, "optimizers": optimizers, "layout": {"written_by": "shard"}}
    token = uuid.uuid4().hex[:8]
    tmp = partial_path(dst, token)
    shards = write_shards({k: (v.contiguous() if isinstance(v, Tensor) else v) for k, v in flat.items()}, tmp,
                          no_dist=True)
    seal(tmp, meta, shards)
    commit(tmp, dst, token)
    return dst


def checkpoint_size(path: str | os.PathLike) -> int:
    """Bytes on disk of a checkpoint file or directory."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
