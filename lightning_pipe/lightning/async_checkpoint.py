"""Asynchronous checkpoints: each rank copies what it saves into host memory, then writes it on a thread.

[Note: asynchronous checkpoints]
With ``PipelineStrategy(async_checkpoint=True)`` a save holds training only while the ranks agree on the target,
exchange what ``meta.pt`` needs and copy their part of the state into host memory. The write (torch's distributed
checkpoint, over a gloo group of its own, so its collectives never meet training's), the checksums, ``meta.pt`` and
the rename into place run on a thread. One save is in flight at a time: the next save, a load, a removal and the
end of the run wait for it. Until the rename, the previous checkpoint under that name stays complete, ``last``
included: a process killed mid-write leaves the previous checkpoint in place and only a ``.partial`` directory
beside it ([Note: never half-written]). An error of the background write is raised on each rank at the next of
those points. What the copy costs: host memory for one checkpoint per rank while it is written.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

from lightning_pipe.checkpoint import CheckpointError, files
from lightning_pipe.config import config_error
from lightning_pipe.parallel.group_cache import shared_group

Work = Callable[[], None]


def staged(state: Mapping[str, Any]) -> dict[str, Any]:
    """A host-memory copy of ``state`` that later training steps cannot change (optimizer steps update parameters
    and their state in place)."""
    return {key: (value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else copy.deepcopy(value))
            for key, value in state.items()}


def write_group(world_size: int) -> Any:
    """The gloo group the background writes talk over (collective on first use: every rank saves together)."""
    return shared_group(range(world_size), "async_checkpoint", backend="gloo")


def resolve_async_checkpoint(value: Any) -> bool:
    """``PipelineStrategy(async_checkpoint=...)``: a bool."""
    if not isinstance(value, bool):
        raise config_error("Asynchronous checkpointing is on or off.", f"async_checkpoint={value!r}",
                           "async_checkpoint", "give true or false")
    return value


def check_links(callbacks: Sequence[Any]) -> None:
    """Refuse ``ModelCheckpoint(save_last="link")`` with asynchronous saves: Lightning links ``last`` to the new
    checkpoint as soon as the save returns, before it is written; a process killed then leaves ``last`` pointing at
    nothing, and ``ckpt_path="last"`` would start the run over."""
    linked = [c for c in callbacks if isinstance(c, ModelCheckpoint) and c.save_last == "link"]
    if linked:
        raise config_error(
            "Asynchronous checkpoints need `last` to be a checkpoint of its own, not a link: ModelCheckpoint("
            "save_last='link') would point `last` at a checkpoint still being written.",
            f"async_checkpoint=True with ModelCheckpoint(save_last='link', dirpath={linked[0].dirpath!r})",
            "async_checkpoint", fix="Use ModelCheckpoint(save_last=True)")


def write_in_background(state: dict[str, Any], tmp: Path, path: Path, token: str, meta: dict[str, Any] | None,
                        needed: int, group: Any, world_size: int) -> None:
    """The saver thread's part of a sharded save: every rank's shards over ``group``, then rank 0 (the one holding
    ``meta``) seals and renames into place; a failure of rank 0's part fails every rank's save alike."""
    shard_checksums = files.write_shards(state, tmp, process_group=group)
    every = _gathered(shard_checksums, group, world_size)
    failure = None
    if meta is not None:
        try:
            files.seal_and_commit(tmp, path, token, meta, {k: v for c in every for k, v in c.items()}, needed)
        except CheckpointError as err:
            failure = str(err)
    first = next((f for f in _gathered(failure, group, world_size) if f), None)
    if first is not None:
        raise CheckpointError(first)


def _gathered(obj: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` over ``group`` (just this one without a process group)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


class AsyncSaver:
    """The save in flight on this rank, if any ([Note: asynchronous checkpoints])."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.target: str | None = None
        """Where the save in flight writes."""

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def submit(self, target: str, work: Work) -> None:
        """Run ``work`` (the write, then the rename into place) on a thread, after the previous save finished."""
        self.wait()
        self.target = target

        def run() -> None:
            try:
                work()
            except BaseException as err:  # torch's CheckpointException is a BaseException
                self._error = err

        self._thread = threading.Thread(target=run, name="lightning_pipe-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the save in flight is complete; raises its error (once) if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def abandon(self) -> None:
        """After a failed run: forget the save in flight without waiting (its peers may be gone)."""
        self._thread = None
        self._error = None


__all__ = ["AsyncSaver", "check_links", "resolve_async_checkpoint", "staged", "write_group", "write_in_background"]
