"""Process groups and device meshes that outlive one strategy: every later setup with the same layout reuses them.

[Note: process groups are reused]
Each setup of a ``PipelineStrategy`` (every ``Trainer``) talks over its own groups: the pipeline, the replicas,
each tied parameter's holders, FSDP's and tensor parallelism's mesh, Chimera's and the experts' groups. torch frees
a group only when it is destroyed, and the strategy cannot destroy its groups at teardown: Lightning tears down at
the end of ``fit``, and a user's ``trainer.save_checkpoint`` or ``trainer.test`` after it still runs collectives.
Created afresh per setup, they pile up in any process that runs several fits (a sweep, a notebook, a test that
launches several cases): each gloo group holds three threads and its own sockets and costs CPU even idle, each
NCCL group a communicator with device buffers (100 idle gloo groups: 1.1 s of CPU per 10 s per rank,
docs/measurements.md).
So a group is kept per (purpose, ranks) for the default group's lifetime and handed to every later request: the
number of groups is bounded by the layouts a process runs, not by its fits. The purpose keeps groups apart that
must be distinct over the same ranks (Chimera's up pipeline beside the down one).

Requests are collective (``dist.new_group`` is: every rank of the world takes part), and every rank builds the
same groups in the same order, so every rank finds or misses a group alike. Reuse is safe after a step that
returned: a schedule waits for its sends before its step ends, so no message of an earlier run is left in flight
to be taken by a later receive. A run that ended in an exception may have left one; :func:`forget_groups` (the
strategy calls it from ``on_exception``) marks the kept groups stale on that rank, and the next setup agrees over
the world whether any rank did (:func:`agree_on_kept_groups`, one all-reduce): if so, every rank starts afresh.
A group destroyed since (``dist.destroy_process_group``) or of an earlier default group is never handed out.

Keeping a group also keeps its threads: ``destroy_process_group`` shuts a gloo group down but its worker threads
live as long as the Python object (measured: three kept groups, 9 threads before and after the destroy, none once
dropped). Threads still alive while the interpreter finalizes can abort a process after a good run ("terminate
called without an active exception", SIGABRT; pytorch/pytorch#179291), so at exit the strategy's handler
(``lightning_pipe.lightning.world``, registered at the first setup whoever started the default group) destroys the
kept groups and drops them (:func:`release`), and destroys the default group when the strategy started it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_groups: dict[tuple[str, tuple[int, ...]], Any] = {}
_meshes: dict[tuple[str, tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}
_stale = False
_world: Any = None  # the default group the kept ones belong to (held: its identity is the test)


def _same_world() -> None:
    """Forget everything kept under an earlier default group: a mesh resolves its groups by name, and a new world
    reuses the names."""
    global _world
    if _world is not dist.group.WORLD:
        _groups.clear()
        _meshes.clear()
        _world = dist.group.WORLD


def _alive(group: Any, ranks: Sequence[int] | None = None) -> bool:
    """Whether ``group`` is still registered with torch (not destroyed, not of an earlier default group), over
    ``ranks`` when given."""
    try:
        members = dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return ranks is None or members == list(ranks)


def shared_group(ranks: Sequence[int], purpose: str, backend: str | None = None) -> Any:
    """The process group over ``ranks`` (global ranks, in order) kept for ``purpose``; created on the first
    request (with ``backend``, default the world's). Collective: every rank of the world calls it with the same
    arguments, in the same order."""
    _same_world()
    key = (purpose, tuple(ranks))
    group = _groups.get(key)
    if group is None or not _alive(group, key[1]):
        group = _groups[key] = dist.new_group(list(ranks), backend=backend)
    return group


def shared_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The device mesh of this shape and these dimension names over the world, kept like :func:`shared_group`.
    Collective like ``init_device_mesh``."""
    _same_world()
    key = (device_type, shape, names)
    mesh = _meshes.get(key)
    if mesh is None or not all(_alive(mesh.get_group(name)) for name in names):
        mesh = _meshes[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return mesh


def forget_groups() -> None:
    """This rank's run ended in an exception: the kept groups may carry a message in flight; the next setup
    starts afresh on every rank ([Note: process groups are reused])."""
    global _stale
    _stale = True


def agree_on_kept_groups(device: torch.device) -> None:
    """At setup, before any group is requested: drop the kept groups on every rank if any rank marked them stale.
    Collective over the world when this rank keeps groups (every rank does alike); nothing to agree otherwise."""
    global _stale
    if dist.is_initialized():
        _same_world()
    if not (_groups or _meshes) or not dist.is_initialized():
        _stale = False
        return
    flag = torch.tensor([1.0 if _stale else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:  # at setup, not on the step path
        _groups.clear()
        _meshes.clear()
    _stale = False


def release() -> None:
    """Destroy the kept groups that are still registered and drop every kept group and mesh, so that their threads
    end while the interpreter is still whole (at exit: [Note: process groups are reused]). Every rank runs it at
    its exit and holds the same groups in the same order (they were created collectively), so a backend whose
    shutdown waits on its peers finds them doing the same. The default group is left to whoever started it."""
    global _world, _stale
    kept = list(_groups.values())
    for mesh in _meshes.values():
        for name in mesh.mesh_dim_names or ():
            try:
                kept.append(mesh.get_group(name))
            except (KeyError, RuntimeError, ValueError):
                continue
    if dist.is_available() and dist.is_initialized():
        for group in {id(g): g for g in kept if g is not dist.group.WORLD}.values():
            if _alive(group):
                try:
                    dist.destroy_process_group(group)
                except (KeyError, RuntimeError, ValueError):  # at exit: nothing more to do for this one
                    continue
    _groups.clear()
    _meshes.clear()
    _world = None
    _stale = False
