"""The strategy's process-group plumbing: start the default group, and the world-wide collectives Lightning asks for
(barrier, object broadcast, tensor reduce). Pipeline and data-parallel groups live in
:mod:`lightning_pipe.parallel.topology`."""

from __future__ import annotations

import atexit
import gc
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from torch import Tensor

from lightning_pipe._compat import lightning as _compat
from lightning_pipe.lightning import same_call
from lightning_pipe.parallel import group_cache


def init_process_group(cluster_environment: ClusterEnvironment | None, device: torch.device, backend: str | None,
                       timeout: timedelta) -> str:
    """Start the default process group (once per process); returns the backend (NCCL on CUDA, gloo on CPU)."""
    global _started_here, _exit_registered
    backend = backend or _compat.default_backend_for_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": timeout}
        if device.type != "cpu":
            kwargs["device_id"] = device
        _compat.init_dist_connection(cluster_environment, backend, **kwargs)
        _started_here = True
    if not _exit_registered:
        # Lightning only does this for NCCL; gloo process groups alive at interpreter exit can abort the process
        # ("terminate called without an active exception") after a perfectly good run.
        atexit.register(_leave_process_group)
        _exit_registered = True
    return backend


_started_here = False
"""Whether the strategy started the default group (then it also destroys it at exit)."""
_exit_registered = False


def _leave_process_group() -> None:
    """At exit: destroy the groups the strategy kept, and the default group when the strategy started it (and the user
    has not destroyed it), so that no gloo worker thread outlives the interpreter ([Note: process groups are
    reused])."""
    global _started_here
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # a peer waiting for this rank in a save or a Trainer call learns it never comes ([Note: every rank saves])
        same_call.post_at_exit(dist.get_rank())
    group_cache.release()
    if _started_here and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _started_here = False
    gc.collect()  # a group held in a reference cycle ends now, not during finalization


def barrier(device: torch.device) -> None:
    if not _compat.distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast(obj: Any, src: int) -> Any:
    if not _compat.distributed_is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src, group=dist.group.WORLD)
    return holder[0]


def reduce(tensor: Tensor | Any, group: Any | None, reduce_op: Any | str | None) -> Tensor | Any:
    if isinstance(tensor, Tensor):
        return _compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor
