"""A checkpoint on disk: atomic commit, the reads and writes of torch.distributed.checkpoint, and the checks on read.

[Note: never half-written]
Every rank writes into ``.<name>.partial-<token>`` next to the target; after the collective DCP save (which returns
on the coordinator only once every rank's files are written and fsynced), rank 0 writes ``meta.pt`` and
``checksums.json`` (:func:`seal`) and renames the directory into place (:func:`commit`). An existing checkpoint at the
same path is first renamed aside to ``.<name>.old-<token>`` and removed after the swap; if a process dies between
those two renames, :func:`recover` puts the old copy back (PipelineStrategy calls it on rank 0 before loading; the
CLI's ``consolidate`` calls it too; :func:`describe` only points at it). A rank killed while writing leaves only a
``.partial`` directory: the previous checkpoint, and any link to it (``ModelCheckpoint``'s ``last``), stay valid.
Stale ``.partial`` directories are removed by the next good save; a save that fails (a full disk, a rank's error)
removes its own at once (:func:`no_space_error` then says what was missing, before torch's ``CheckpointException``).
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

from lightning_pipe.checkpoint.checksums import FileChecksum, checksums_of, read_checksums, write_checksums
from lightning_pipe.checkpoint.format import (
    CHECKSUMS_FILENAME,
    DCP_METADATA,
    FORMAT,
    META_FILENAME,
    CheckpointError,
)


# ---------------------------------------------------------------------------------------------------------- atomic save
def partial_path(path: Path, token: str) -> Path:
    """Where a save into ``path`` writes until it is complete."""
    return path.parent / f".{path.name}.partial-{token}"


def _old_copies(path: Path) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return [old for old in sorted(path.parent.glob(f".{path.name}.old-*"))
            if old.is_file() or (old / META_FILENAME).is_file()]


def recover(path: Path) -> Path:
    """A crash between the two renames of a swap leaves only ``.<name>.old-*``: rename it back into place.

    Changes the file system (unlike everything that only reads a checkpoint); returns where the checkpoint is.
    """
    if path.exists() or path.is_symlink():
        return path
    for old in _old_copies(path):
        try:
            os.replace(old, path)
        except OSError:
            return old
        return path
    return path


def commit(tmp: Path, path: Path, token: str) -> None:
    """Rename a finished save into place (rank 0 only), keeping the old checkpoint until the new one is there."""
    old = None
    if path.exists() or path.is_symlink():
        old = path.parent / f".{path.name}.old-{token}"
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        remove(old)
    for stale in path.parent.glob(f".{path.name}.partial-*"):
        remove(stale)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where the OS allows opening a directory)."""
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


def _save_synced(obj: Any, path: Path, needed: int | None = None) -> None:
    """``torch.save`` and fsync. Without ``needed`` (a small object) it is serialized in memory first, so a full
    disk raises its own ``OSError``; with it, a failed write is checked against the space left (:func:`lacked_space`)."""
    try:
        if needed is None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            with open(path, "wb") as f:
                f.write(buf.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            return
        torch.save(obj, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as err:
        full = lacked_space(err, path.parent, needed or 0)
        if full is not None and full is not err:
            raise full from err
        raise


def remove(path: Path) -> None:
    """Delete a checkpoint file, directory or link; missing is fine."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering which data files this process wrote (to checksum exactly those), and saying
    when a write failed for lack of space (:func:`lacked_space`: torch's zip writer hides it)."""

    def __init__(self, path: Path, needed: int) -> None:
        super().__init__(str(path))
        self.root, self.needed = path, needed
        self.written: list[str] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[Any]]:
        try:
            fut = super().write_data(plan, planner)
            self.written = [r.storage_data.relative_path for r in fut.wait()]
        except (OSError, RuntimeError) as err:
            # Checked here, before DCP gathers the failure to the other ranks: nothing of this save is removed yet.
            full = lacked_space(err, self.root, self.needed)
            if full is not None and full is not err:
                raise full from err
            raise
        return fut


def write_shards(state: dict[str, Any], tmp: Path, no_dist: bool = False) -> dict[str, FileChecksum]:
    """The collective DCP write (every rank calls it; data-parallel replicas > 0 pass an empty dict).

    Returns the checksums of the data files this process wrote.
    """
    from torch.distributed.checkpoint import save

    writer = _RecordingWriter(tmp, state_bytes(state))
    save(state, storage_writer=writer, no_dist=no_dist)
    return checksums_of(tmp, writer.written)


def seal(tmp: Path, meta: dict[str, Any], shard_checksums: Mapping[str, FileChecksum]) -> None:
    """Rank 0, after every rank's shards are written: ``meta.pt``, then the checksums of every file, last."""
    meta["pipeline"]["checksums"] = CHECKSUMS_FILENAME
    _save_synced(meta, tmp / META_FILENAME)
    write_checksums(tmp, {**shard_checksums, **checksums_of(tmp, [DCP_METADATA, META_FILENAME])})


def seal_and_commit(tmp: Path, path: Path, token: str, meta: dict[str, Any],
                    shard_checksums: Mapping[str, FileChecksum], needed: int) -> None:
    """Rank 0's end of a sharded save (:func:`seal`, then :func:`commit`); a failure is a :class:`CheckpointError`
    (:func:`no_space_error` for a full disk), which the strategy hands to every rank."""
    try:
        seal(tmp, meta, shard_checksums)
        commit(tmp, path, token)
    except Exception as err:
        remove(tmp)  # first: the space left is then what the message reports
        raise no_space_error(err, path, needed) or CheckpointError(
            f"Saving {str(path)!r} failed on rank 0 while writing `{META_FILENAME}` / `{CHECKSUMS_FILENAME}` or "
            f"renaming the save into place ({type(err).__name__}: {err}). The partial save was removed and earlier "
            "checkpoints are intact.") from err


def save_file_atomic(ckpt: dict[str, Any], path: Path) -> None:
    """``torch.save`` of a checkpoint dict that leaves either the old file or the whole new one at ``path``."""
    tmp = partial_path(path, uuid.uuid4().hex[:8])
    try:
        _save_synced(ckpt, tmp, needed=nested_bytes(ckpt))
    except BaseException:
        remove(tmp)
        raise
    commit(tmp, path, uuid.uuid4().hex[:8])


def state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors in a flat state dict (what its shard files hold, near enough)."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))


def nested_bytes(obj: Any) -> int:
    """Bytes of the tensors anywhere in nested dicts, lists and tuples."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nested_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nested_bytes(v) for v in obj)
    return 0


def _errors_in(error: BaseException) -> list[BaseException]:
    """``error``, what it was raised from, and the per-rank failures a DCP ``CheckpointException`` carries."""
    found: list[BaseException] = []
    todo = [error]
    while todo and len(found) < 64:
        current = todo.pop()
        if any(current is e for e in found):
            continue
        found.append(current)
        if isinstance(current, CheckpointException):
            todo.extend(exc for exc, _ in current.failures.values() if isinstance(exc, BaseException))
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return found


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.0f} KB"


def lacked_space(error: BaseException, where: Path, needed: int) -> OSError | None:
    """The ``ENOSPC`` behind a failed write into ``where``: an ``OSError`` saying so in the error's chain, or a new
    one when the failure is an ``OSError`` / ``RuntimeError`` and less than ``needed`` bytes are free there now.
    torch's zip writer reports a write the disk refused as ``RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos ...`` (the errno lost; only the writing process can see the space it lacked)."""
    errors = _errors_in(error)
    for e in errors:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e if e is error else OSError(e.errno, e.strerror, e.filename)
    if not any(isinstance(e, (OSError, RuntimeError)) for e in errors):
        return None
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return None
    if free >= needed:
        return None
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return OSError(errno.ENOSPC, f"No space left on device: {free} bytes free, about {needed} needed "
                                 f"({type(error).__name__}: {first})", str(where))


def no_space_error(error: BaseException, path: Path, needed: int) -> CheckpointError | None:
    """A clear error when a save of ``needed`` bytes into ``path`` failed for lack of space (an ``ENOSPC`` in the
    error's chain, or in a failure DCP gathered from another rank); None otherwise."""
    if isinstance(error, CheckpointError) or not any(
            isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _errors_in(error)):
        return None
    try:
        free = f"{_size(shutil.disk_usage(path.parent).free)} free there now"
    except OSError:
        free = "free space unknown"
    return CheckpointError(
        f"No space left on {str(path.parent)!r}: saving {path.name!r} needed about {_size(needed)} "
        f"({free}). The partial save was removed and earlier checkpoints are intact; free space, or point "
        "ModelCheckpoint(dirpath=...) at another disk (save_top_k limits how many checkpoints are kept).")


# ---------------------------------------------------------------------------------------------------------- reading
def dcp_reader(path: Path) -> FileSystemReader:
    return FileSystemReader(str(path))


def describe(path: str | os.PathLike) -> str:
    """``"sharded"`` or ``"file"``; a :class:`CheckpointError` that says what is wrong otherwise. Reads only."""
    path = Path(path)
    if not path.exists():
        hint = ""
        olds = _old_copies(path)
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


def read_sharded_metadata(path: Path) -> tuple[Any, dict[str, Any]]:
    """(DCP metadata, meta.pt) after checking that every data file the metadata refers to is there, whole."""
    try:
        md = dcp_reader(path).read_metadata()
    except Exception as err:
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
    except Exception as err:
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: `{META_FILENAME}` is unreadable "
                              f"({type(err).__name__}: {err}); the checkpoint is corrupted.") from err
    if not isinstance(meta, dict) or meta.get("pipeline", {}).get("format") != FORMAT:
        raise CheckpointError(f"Checkpoint directory {str(path)!r} was not written by lightning_pipe "
                              f"(`{META_FILENAME}` lacks the {FORMAT!r} tag).")
    # Without this, deleting checksums.json would silently turn verification off.
    if meta["pipeline"].get("checksums") and not (path / CHECKSUMS_FILENAME).is_file():
        raise CheckpointError(f"Checkpoint directory {str(path)!r} is incomplete: `{CHECKSUMS_FILENAME}` is missing "
                              "(it was written with checksums, so its files cannot be verified). Use another "
                              "checkpoint, or copy this one again.")
    recorded = read_checksums(path)
    unlisted = sorted(set(needed) - set(recorded)) if recorded is not None else []
    if unlisted:  # every file a load reads must have been verified
        raise CheckpointError(f"Checkpoint directory {str(path)!r}: data files {unlisted[:6]} have no checksum in "
                              f"`{CHECKSUMS_FILENAME}`, so they cannot be verified; the checkpoint is corrupted.")
    return md, meta


def load_file(path: Path) -> dict[str, Any]:
    """An ordinary single-file Lightning checkpoint (memory-mapped where torch can)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            raise CheckpointError(f"{str(path)!r} is not a checkpoint: torch.load failed "
                                  f"({type(err).__name__}: {err}).") from err
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), Mapping):
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint: it has no 'state_dict' dictionary.")
    return ckpt


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
        try:
            load(target, storage_reader=dcp_reader(path), no_dist=True)
        except (Exception, CheckpointException) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise CheckpointError(f"Checkpoint directory {str(path)!r}: reading its tensors failed ({type(err).__name__}"
                                  f": {first[:300]}); the checkpoint is corrupted. Use another checkpoint.") from err
    return target
