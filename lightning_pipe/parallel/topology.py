"""How the world is cut, three ways: rank arithmetic (:class:`Topology`), a named device mesh (:func:`build_mesh`),
and the process groups one rank talks over (:class:`ProcessGroups`). It knows no schedule: a plan enters only as
the function that says which pipeline ranks hold a stage.

The mesh exists when a dimension needs torch's composable APIs (FSDP2's ``fully_shard`` over ``dp_shard``, HSDP's
replicate dimension, DTensor ``parallelize_module`` over ``tensor``); the pipeline x replicas layout keeps its plain
process groups, so nothing changes for it. The ``tensor`` dimension is innermost and exists only with
``tensor_parallel_size > 1`` (parallel/tensor_parallel.py). A run builds one mesh and slices it: FSDP2 can only
combine a tensor-parallel DTensor with its data-parallel dimensions when both are slices of the same root mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_pipe.config import config_error
from lightning_pipe.layers.partition import stage_of
from lightning_pipe.layers.stages import TiedParameter
from lightning_pipe.parallel.group_cache import shared_group, shared_mesh


@dataclass(frozen=True)
class Topology:
    """How the world is cut: ``world = data_parallel_size x pipeline_size x fsdp_size x tensor_parallel_size``.

    [Note: rank order]
    Mesh dimensions, outermost first: ``(dp_replicate, pipeline, dp_shard, tensor)``, so
    ``global rank = ((replica * pipeline_size + pp_rank) * fsdp_size + shard) * tensor_parallel_size + t``.
    Consecutive ranks share a node, so the innermost dimension gets the best links: tensor parallelism
    all-reduces activations inside every layer's forward and backward (the most, and the most latency-bound,
    traffic), FSDP's all-gathers and reduce-scatters run every micro-batch / batch over whole stages, pipeline P2P
    carries activations between stages, and replicas all-reduce gradients once per batch (the least). With
    ``fsdp_size=1`` and ``tensor_parallel_size=1`` this is exactly the pipeline x replicas order
    (``rank = replica * pipeline_size + pp_rank``), so that layout, its tests, plans and checkpoints are unchanged;
    global rank 0 (loggers, progress bar) holds the first stage of replica 0 (shard 0, tensor rank 0).

    ``dp_rank`` / ``dp_degree`` count every rank that reads its own data for one stage (replicas x shards): they
    shard the data (DistributedSampler) and average gradients. The tensor ranks of one (replica, shard) read the
    same data and hold different parts of the same layers: they are not data-parallel. A pipeline (P2P) group is
    the ranks with equal (replica, shard, tensor rank): each tensor rank talks to the same tensor rank of the next
    stage, and every one of them sends and receives whole activations (the layers' outputs are full tensors).
    """

    world_size: int
    data_parallel_size: int
    global_rank: int
    fsdp_size: int = 1
    tensor_parallel_size: int = 1

    @property
    def pipeline_size(self) -> int:
        return self.world_size // (self.data_parallel_size * self.fsdp_size * self.tensor_parallel_size)

    @property
    def tp_rank(self) -> int:
        return self.global_rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return (self.global_rank // (self.fsdp_size * self.tensor_parallel_size)) % self.pipeline_size

    @property
    def replica_rank(self) -> int:
        return self.global_rank // (self.pipeline_size * self.fsdp_size * self.tensor_parallel_size)

    @property
    def shard_rank(self) -> int:
        return (self.global_rank // self.tensor_parallel_size) % self.fsdp_size

    @property
    def dp_rank(self) -> int:
        """Data-parallel index over replicas x shards (= the replica when ``fsdp_size=1``)."""
        return self.replica_rank * self.fsdp_size + self.shard_rank

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks per stage: replicas x shards."""
        return self.data_parallel_size * self.fsdp_size

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int = 0) -> int:
        """The global rank of data-parallel index ``dp_rank`` at pipeline rank ``pp_rank`` and tensor rank
        ``tp_rank`` ([Note: rank order])."""
        replica, shard = divmod(dp_rank, self.fsdp_size)
        return ((replica * self.pipeline_size + pp_rank) * self.fsdp_size + shard) * self.tensor_parallel_size + tp_rank

    def pp_group_ranks(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        return [self.rank_of(dp_rank, i, tp_rank) for i in range(self.pipeline_size)]

    def dp_group_ranks(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        return [self.rank_of(d, pp_rank, tp_rank) for d in range(self.dp_degree)]

    @classmethod
    def create(cls, world_size: int, data_parallel_size: int, global_rank: int, fsdp_size: int = 1,
               tensor_parallel_size: int = 1) -> Topology:
        if tensor_parallel_size > 1 and world_size % (data_parallel_size * fsdp_size * tensor_parallel_size) != 0:
            raise config_error(
                "The world size must be divisible by data_parallel_size x fsdp_size x tensor_parallel_size "
                "(pipeline size = world / their product).",
                f"world_size={world_size}, data_parallel_size={data_parallel_size}, fsdp_size={fsdp_size}, "
                f"tensor_parallel_size={tensor_parallel_size}",
                "tensor_parallel_size", also=("data_parallel_size", "devices"))
        if world_size % (data_parallel_size * fsdp_size) != 0:
            if fsdp_size == 1:
                raise config_error(
                    "The world size must be divisible by the data-parallel size (pipeline size = world / dp).",
                    f"world_size={world_size}, data_parallel_size={data_parallel_size}",
                    "data_parallel_size", also=("devices",))
            raise config_error(
                "The world size must be divisible by data_parallel_size x fsdp_size (pipeline size = world / "
                "(data_parallel_size x fsdp_size)).",
                f"world_size={world_size}, data_parallel_size={data_parallel_size}, fsdp_size={fsdp_size}",
                "fsdp_size", also=("data_parallel_size", "devices"))
        return cls(world_size, data_parallel_size, global_rank, fsdp_size, tensor_parallel_size)


REPLICATE, PIPELINE, SHARD, TENSOR = "dp_replicate", "pipeline", "dp_shard", "tensor"
MESH_DIMS = (REPLICATE, PIPELINE, SHARD)
"""Mesh dimension names, outermost first ([Note: rank order])."""


def build_mesh(topology: Topology, device_type: str) -> DeviceMesh:
    """The world as a ``(dp_replicate, pipeline, dp_shard[, tensor])`` mesh (``tensor`` with
    ``tensor_parallel_size > 1``). Collective: every rank calls it."""
    shape: tuple[int, ...] = (topology.data_parallel_size, topology.pipeline_size, topology.fsdp_size)
    names: tuple[str, ...] = MESH_DIMS
    expected = [topology.replica_rank, topology.pp_rank, topology.shard_rank]
    if topology.tensor_parallel_size > 1:
        shape, names = (*shape, topology.tensor_parallel_size), (*names, TENSOR)
        expected.append(topology.tp_rank)
    mesh = shared_mesh(device_type, shape, names)  # [Note: process groups are reused] in group_cache.py
    # The mesh must agree with the Topology's arithmetic, which the samplers, checkpoints and groups use.
    coords = list(mesh.get_coordinate() or ())
    if coords != expected:  # pragma: no cover - a torch change in mesh layout
        raise RuntimeError(f"DeviceMesh coordinates {coords} of rank {topology.global_rank} differ from the "
                           f"topology's {expected} ([Note: rank order]).")
    return mesh


def data_parallel_mesh(mesh: DeviceMesh, topology: Topology) -> DeviceMesh:
    """The mesh FSDP shards a stage over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP (replicas > 1)."""
    if topology.data_parallel_size > 1:
        return mesh[REPLICATE, SHARD]
    return mesh[SHARD]


@dataclass(frozen=True)
class TieGroup:
    """One tied parameter held by several pipeline ranks, as this rank sees it."""

    tie: TiedParameter
    group: dist.ProcessGroup
    owner: bool
    """The first holder counts the parameter in the global gradient norm; the others do not."""


class ProcessGroups:
    """The groups one rank talks over. Built collectively: every rank creates every group, in the same order."""

    def __init__(self, topology: Topology, tied: Sequence[TiedParameter], ranges: Sequence[range],
                 ranks_of_stage: Callable[[int], Sequence[int]], mesh: Any = None) -> None:
        """``ranks_of_stage``: the pipeline ranks holding a copy of a stage (``SchedulePlan.ranks_of_stage``)."""
        self.topology = topology
        # FSDP (lightning_pipe/parallel/fsdp.py): the mesh, and the group each stage is sharded over (norms count shards once)
        self.mesh = mesh
        self.shard: dist.ProcessGroup | None = (mesh.get_group("dp_shard")
                                               if mesh is not None and topology.fsdp_size > 1 else None)
        # Tensor parallelism (lightning_pipe/parallel/tensor_parallel.py): the group each layer is split over
        self.tensor: dist.ProcessGroup | None = (mesh.get_group("tensor")
                                                if mesh is not None and topology.tensor_parallel_size > 1 else None)
        # Expert parallelism (lightning_pipe/parallel/experts.py, an ExpertGroups): set by build_engine
        self.experts: Any = None
        p, d, tp = topology.pipeline_size, topology.dp_degree, topology.tensor_parallel_size
        self.pp: dist.ProcessGroup | None = None
        self.dp: dist.ProcessGroup | None = None
        # [Note: rank order]: one pipeline per (data-parallel index, tensor rank), one data-parallel group per
        # (pipeline rank, tensor rank). Every rank creates every group, in the same order.
        for dp_rank in range(d):
            for t in range(tp):
                group = shared_group(topology.pp_group_ranks(dp_rank, t), "pipeline")
                if dp_rank == topology.dp_rank and t == topology.tp_rank:
                    self.pp = group
        for pp_rank in range(p):
            for t in range(tp):
                group = shared_group(topology.dp_group_ranks(pp_rank, t), "replicas") if d > 1 else None
                if pp_rank == topology.pp_rank and t == topology.tp_rank:
                    self.dp = group
        # One group per replica (its pipeline, FSDP shards and tensor ranks: the ranks that step together in
        # predict, where replicas may run different numbers of batches); None with one replica: the world.
        self.replica: dist.ProcessGroup | None = None
        block = p * topology.fsdp_size * tp
        if topology.data_parallel_size > 1:
            for r in range(topology.data_parallel_size):
                group = shared_group(list(range(r * block, (r + 1) * block)), "replica")
                if r == topology.replica_rank:
                    self.replica = group
        # Tied parameters held by several pipeline ranks: one group per tie and replica, over the holding ranks.
        self.tied: list[TieGroup] = []
        self.ties_span_world = d == 1 and tp == 1 and mesh is None
        """Every tie group is the whole world (one pipeline, each tie held by every rank): the same ties, in the
        same order, on every rank ([Note: tie sums in the agreement] in parallel/grads.py)."""
        for i, tie in enumerate(tied):
            holders = sorted({r for i in tie.layer_indices for r in ranks_of_stage(stage_of(ranges, i))})
            if len(holders) < 2:
                continue
            self.ties_span_world = self.ties_span_world and len(holders) == p
            mine = None
            for dp_rank in range(d):
                for t in range(tp):
                    ranks = [topology.rank_of(dp_rank, h, t) for h in holders]
                    group = shared_group(ranks, f"tie{i}")
                    if topology.global_rank in ranks:
                        mine = group
            if mine is not None:
                self.tied.append(TieGroup(tie, mine, topology.pp_rank == holders[0]))
