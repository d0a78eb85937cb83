"""Reading a checkpoint: what a path holds, a sharded directory's metadata and tensors, a single file.

Everything here only reads, and reads a checkpoint as data unless ``weights_only=False`` ([Note: a checkpoint is
data] in ``trust.py``); the checks say what is wrong with a checkpoint before any tensor is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException

from lightning_pipe.checkpoint.checksums import read_checksums
from lightning_pipe.checkpoint.files import errors_in, old_copies
from lightning_pipe.checkpoint.format import CHECKSUMS_FILENAME, DCP_METADATA, FORMAT, META_FILENAME, CheckpointError
from lightning_pipe.checkpoint.plain import from_plain
from lightning_pipe.checkpoint.reader import CheckpointReader
from lightning_pipe.checkpoint.trust import META_HINT, load_data, trusted


def dcp_reader(path: Path, weights_only: bool | None = None) -> CheckpointReader:
    """DCP's reader for the directory ``path``, as data unless ``weights_only=False`` ([Note: a checkpoint is
    data])."""
    return CheckpointReader(path, weights_only)


def describe(path: str | os.PathLike) -> str:
    """``"sharded"`` or ``"file"``; a :class:`CheckpointError` that says what is wrong otherwise. Reads only."""
    path = Path(path)
    if not path.exists():
        hint = ""
        olds = old_copies(path)
        if olds:
            hint = (f" A save was interrupted between its two renames and left the previous checkpoint at "
                    f"{str(olds[0])!r}: loading with PipelineStrategy or `python -m lightning_pipe.checkpoint "
                    "consolidate` puts it back (lightning_pipe.checkpoint.recover), or rename it yourself.")
        raise CheckpointError(f"No checkpoint at {str(path)!r}: the path does not exist.{hint}")
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


def _check_data_files(path: Path, md: Any) -> set[str]:
    """Every data file the metadata refers to is there, whole; returns their names."""
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
    return set(needed)


def _read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    try:
        meta = load_data(path / META_FILENAME, weights_only, path / META_FILENAME, f"`{META_FILENAME}`",
                         hint=META_HINT)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: `{META_FILENAME}` is unreadable "
                              f"({type(err).__name__}: {err}); the checkpoint is corrupted.") from err
    if not isinstance(meta, dict) or not isinstance(meta.get("pipeline"), dict) or (
            meta["pipeline"].get("format") != FORMAT):
        raise CheckpointError(f"Checkpoint directory {str(path)!r} was not written by lightning_pipe "
                              f"(`{META_FILENAME}` lacks the {FORMAT!r} tag).")
    return from_plain(meta, trusted(weights_only))


def read_sharded_metadata(path: Path, weights_only: bool | None = None) -> tuple[Any, dict[str, Any]]:
    """(DCP metadata, meta.pt) after checking that every data file the metadata refers to is there, whole; both read
    as data unless ``weights_only=False``."""
    try:
        md = dcp_reader(path, weights_only).read_metadata()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: `{DCP_METADATA}` is unreadable "
                              f"({type(err).__name__}: {err}); the checkpoint is corrupted.") from err
    needed = _check_data_files(path, md)
    meta = _read_meta(path, weights_only)
    # Without this, deleting checksums.json would silently turn verification off.
    if meta["pipeline"].get("checksums") and not (path / CHECKSUMS_FILENAME).is_file():
        raise CheckpointError(f"Checkpoint directory {str(path)!r} is incomplete: `{CHECKSUMS_FILENAME}` is missing "
                              "(it was written with checksums, so its files cannot be verified). Use another "
                              "checkpoint, or copy this one again.")
    recorded = read_checksums(path)
    unlisted = sorted(needed - set(recorded)) if recorded is not None else []
    if unlisted:  # every file a load reads must have been verified
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: data files {unlisted[:6]} have no checksum in "
                              f"`{CHECKSUMS_FILENAME}`, so they cannot be verified; the checkpoint is corrupted.")
    return md, meta


def load_file(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """An ordinary single-file Lightning checkpoint (memory-mapped where torch can), as data unless
    ``weights_only=False``."""
    error: Exception | None = None
    for mmap in (True, False):  # torch maps only its zip format
        try:
            ckpt = load_data(path, weights_only, path, "it", mmap=mmap)
            break
        except CheckpointError:
            raise
        except Exception as err:
            error = err
    else:
        raise CheckpointError(f"{str(path)!r} is not a checkpoint: torch.load failed "
                              f"({type(error).__name__}: {error}).") from error
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), Mapping):
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint: it has no 'state_dict' dictionary.")
    return from_plain(ckpt, trusted(weights_only))


def refusal_in(error: BaseException) -> CheckpointError | None:
    """The refusal a DCP load failed with (DCP wraps what its reader raised in a ``CheckpointException``), as a new
    error with the same message and no pickle traceback; None if it failed otherwise."""
    found = next((e for e in errors_in(error) if isinstance(e, CheckpointError)), None)
    return CheckpointError(str(found)) if found is not None else None


def load_flat(path: Path, keys: Mapping[str, Any], md: Any, weights_only: bool | None = None) -> dict[str, Any]:
    """Read the given flat keys (this rank's own) from a sharded checkpoint, without collectives."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    target: dict[str, Any] = {}
    try:
        for key, dest in keys.items():
            info = md.state_dict_metadata[key]
            if isinstance(dest, Tensor):
                target[key] = dest
            elif isinstance(info, TensorStorageMetadata):
                target[key] = torch.empty(info.size, dtype=info.properties.dtype)
            else:
                target[key] = None  # an object: DCP puts the value in place
        if target:
            load(target, storage_reader=dcp_reader(path, weights_only), no_dist=True)
    except (Exception, CheckpointException) as err:
        refusal = refusal_in(err)
        if refusal is not None:
            raise refusal from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: reading its tensors failed ({type(err).__name__}"
                              f": {first[:300]}); the checkpoint is corrupted. Use another checkpoint.") from err
    return target
