"""The device mesh of one run: named dimensions over the world, in the rank order of :class:`Topology`.

[Note: rank order] (config.py) says why the dimensions are ``(dp_replicate, pipeline, dp_shard)``, outermost first.
The mesh exists when a dimension needs torch's composable APIs (FSDP2's ``fully_shard`` over ``dp_shard``, HSDP's
replicate dimension); the pipeline x replicas layout keeps its plain process groups (lightning_pipe/grads.py), so
nothing changes for it. A tensor-parallel dimension joins innermost (after ``dp_shard``) when it is built.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_pipe.config import Topology

REPLICATE, PIPELINE, SHARD = "dp_replicate", "pipeline", "dp_shard"
MESH_DIMS = (REPLICATE, PIPELINE, SHARD)
"""Mesh dimension names, outermost first ([Note: rank order])."""


def build_mesh(topology: Topology, device_type: str) -> DeviceMesh:
    """The world as a ``(dp_replicate, pipeline, dp_shard)`` mesh. Collective: every rank calls it."""
    shape = (topology.data_parallel_size, topology.pipeline_size, topology.fsdp_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    # The mesh must agree with the Topology's arithmetic, which the samplers, checkpoints and groups use.
    coords = list(mesh.get_coordinate() or ())
    expected = [topology.replica_rank, topology.pp_rank, topology.shard_rank]
    if coords != expected:  # pragma: no cover - a torch change in mesh layout
        raise RuntimeError(f"DeviceMesh coordinates {coords} of rank {topology.global_rank} differ from the "
                           f"topology's {expected} ([Note: rank order]).")
    return mesh


def data_parallel_mesh(mesh: DeviceMesh, topology: Topology) -> DeviceMesh:
    """The mesh FSDP shards a stage over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP (replicas > 1)."""
    if topology.data_parallel_size > 1:
        return mesh[REPLICATE, SHARD]
    return mesh[SHARD]
