"""The device mesh of one run: named dimensions over the world, in the rank order of :class:`Topology`.

[Note: rank order] (config.py) says why the dimensions are ``(dp_replicate, pipeline, dp_shard)``, outermost first.
The mesh exists when a dimension needs torch's composable APIs (FSDP2's ``fully_shard`` over ``dp_shard``, HSDP's
replicate dimension, DTensor ``parallelize_module`` over ``tensor``); the pipeline x replicas layout keeps its plain
process groups (lightning_pipe/parallel/grads.py), so nothing changes for it. The ``tensor`` dimension is innermost and
exists only with ``tensor_parallel_size > 1`` (lightning_pipe/parallel/tensor_parallel.py). A run builds one mesh and slices
it: FSDP2 can only combine a tensor-parallel DTensor with its data-parallel dimensions when both are slices of the
same root mesh.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_pipe.config import Topology

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
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
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
