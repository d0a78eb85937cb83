"""A checkpoint on disk: atomic commit, the writes of torch.distributed.checkpoint, and a full disk said plainly.

[Note: never half-written]
Every rank writes into ``.partial-<key>-<token>.tmp`` next to the target (``<key>``: a hash of the target's name;
:func:`aside_path`); after the collective DCP save (which returns
on the coordinator only once every rank's files are written and fsynced), rank 0 writes ``meta.pt`` and
``checksums.json`` (:func:`seal`) and renames the directory into place (:func:`commit`). An existing checkpoint at the
same path is first renamed aside to ``.old-<key>-<token>.tmp`` and removed after the swap; if a process dies between
those two renames, :func:`recover` puts the old copy back (PipelineStrategy calls it on rank 0 before loading; the
CLI's ``consolidate`` calls it too; ``reading.describe`` only points at it). A rank killed while writing leaves only a
``.partial`` directory: the previous checkpoint, and any link to it (``ModelCheckpoint``'s ``last``), stay valid.
Stale ``.partial`` directories are removed by the next good save; a save that fails (a full disk, a rank's error)
removes its own at once (:func:`no_space_error` then says what was missing, before torch's ``CheckpointException``).
Reading lives in ``reading.py``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

from lightning_pipe.checkpoint.checksums import FileChecksum, checksums_of, write_checksums
from lightning_pipe.checkpoint.format import CHECKSUMS_FILENAME, DCP_METADATA, META_FILENAME, CheckpointError
from lightning_pipe.checkpoint.plain import to_plain


# ---------------------------------------------------------------------------------------------------------- atomic save
def aside_path(path: Path, kind: str, token: str) -> Path:
    """Where a save of ``path`` stages (``kind="partial"``) or sets the checkpoint it replaces aside (``"old"``).

    A hidden name keyed by a hash of the target's: it never holds ``ckpt_``, from which Lightning reads a version
    number in every file name of a directory (its SLURM ``hpc_ckpt_<n>.ckpt`` resume would take a staging directory
    for the newest checkpoint)."""
    key = hashlib.sha1(path.name.encode()).hexdigest()[:12]
    return path.parent / f".{kind}-{key}-{token}.tmp"  # torch's zip writer names its archive after the stem


def partial_path(path: Path, token: str) -> Path:
    """Where a save into ``path`` writes until it is complete."""
    return aside_path(path, "partial", token)


def old_copies(path: Path) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return [old for old in sorted(path.parent.glob(aside_path(path, "old", "*").name))
            if old.is_file() or (old / META_FILENAME).is_file()]


def recover(path: Path) -> Path:
    """A crash between the two renames of a swap leaves only the old copy set aside: rename it back into place.

    Changes the file system (unlike everything that only reads a checkpoint); returns where the checkpoint is.
    """
    if path.exists() or path.is_symlink():
        return path
    for old in old_copies(path):
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
        old = aside_path(path, "old", token)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        remove(old)
    for stale in path.parent.glob(partial_path(path, "*").name):
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


def write_shards(state: dict[str, Any], tmp: Path, no_dist: bool = False,
                 process_group: Any = None) -> dict[str, FileChecksum]:
    """The collective DCP write (every rank of ``process_group``, default the world, calls it; data-parallel
    replicas > 0 pass an empty dict).

    Returns the checksums of the data files this process wrote.
    """
    from torch.distributed.checkpoint import save

    writer = _RecordingWriter(tmp, state_bytes(state))
    save(state, storage_writer=writer, no_dist=no_dist, process_group=process_group)
    return checksums_of(tmp, writer.written)


def seal(tmp: Path, meta: dict[str, Any], shard_checksums: Mapping[str, FileChecksum]) -> None:
    """Rank 0, after every rank's shards are written: ``meta.pt``, then the checksums of every file, last."""
    meta["pipeline"]["checksums"] = CHECKSUMS_FILENAME
    _save_synced(to_plain(meta), tmp / META_FILENAME)
    warn_unless_data(tmp / META_FILENAME, tmp.parent)
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
    """``torch.save`` of a checkpoint dict (its entries as plain data) that leaves either the old file or the whole
    new one at ``path``."""
    tmp = partial_path(path, uuid.uuid4().hex[:8])
    plain = to_plain(ckpt)
    try:
        _save_synced(plain, tmp, needed=nested_bytes(plain))
    except BaseException:
        remove(tmp)
        raise
    warn_unless_data(tmp, path.parent)
    commit(tmp, path, uuid.uuid4().hex[:8])


def warn_unless_data(written: Path, where: Path) -> None:
    """Warn when a file just written holds objects a load as data refuses (the user's own, in a callback's state
    or the hyper-parameters): loading it will need trust ([Note: a checkpoint is data])."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(written))
    except Exception:  # (only an early warning: the load says it again)
        return
    if names:
        warnings.warn(f"lightning_pipe: a checkpoint saved in {str(where)!r} holds {', '.join(names[:8])}, which a "
                      "load as data refuses: loading it will need `weights_only=False` (a trusted source), or these "
                      "types registered with `torch.serialization.add_safe_globals` in the loading process.",
                      stacklevel=2)


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


def errors_in(error: BaseException) -> list[BaseException]:
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
    errors = errors_in(error)
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
            isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in errors_in(error)):
        return None
    try:
        free = f"{_size(shutil.disk_usage(path.parent).free)} free there now"
    except OSError:
        free = "free space unknown"
    return CheckpointError(
        f"No space left on {str(path.parent)!r}: saving {path.name!r} needed about {_size(needed)} "
        f"({free}). The partial save was removed and earlier checkpoints are intact; free space, or point "
        "ModelCheckpoint(dirpath=...) at another disk (save_top_k limits how many checkpoints are kept).")
