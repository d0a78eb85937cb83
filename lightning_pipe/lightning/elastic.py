"""Elastic pipelines: under torchrun's elastic agent the strategy takes the world it is given.

[Note: elastic worlds]
``torchrun --nnodes=MIN:MAX --max-restarts=N`` restarts the surviving hosts' workers after a host is lost (and all
workers when one joins), each time with the world the rendezvous closed with. ``Trainer(num_nodes=...)`` is fixed
in the user's command, and Lightning refuses a world other than ``devices x num_nodes``. So, under a torchrun
launch whose node count differs from ``num_nodes`` (while ``devices`` is torchrun's ``--nproc-per-node``), the
strategy takes torchrun's node count, and re-cuts the configured layout for that world:

* ``num_nodes x devices`` is the *planned* world, and its pipeline depth (``planned / (data_parallel_size x
  fsdp_size x tensor_parallel_size)``) the planned depth; FSDP and tensor parallelism are kept as configured (they
  shard each stage inside a host);
* when the world holds whole pipelines of the planned depth, the depth stays and the replicas follow the world (a
  lost host costs replicas, not the split);
* otherwise the pipeline is as deep as the world allows, with one replica;
* the schedule, micro-batches and split rules are then checked for that layout as for any other, so a world no
  layout fits is refused with the rule that fails (``schedule="auto"`` plans for the world it gets).

The run resumes from the newest complete checkpoint with ``ckpt_path="last"``; sharded checkpoints load into any
layout (docs/checkpoints.md), so every parameter equals a resume of that checkpoint on the new layout by hand.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from lightning.fabric.plugins.environments import ClusterEnvironment, TorchElasticEnvironment

from lightning_pipe.config import PipelineConfig


@dataclass(frozen=True)
class ElasticWorld:
    """What changed: the nodes torchrun gave against ``num_nodes``, and the layout for them."""

    planned_nodes: int
    nodes: int
    processes_per_node: int
    config: PipelineConfig
    planned_depth: int
    depth: int

    def headline(self) -> str:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return (f"torchrun gave {self.nodes} node(s) x {self.processes_per_node} process(es) = "
                f"{self.nodes * self.processes_per_node} ranks, where Trainer(num_nodes={self.planned_nodes}) planned "
                f"{self.planned_nodes * self.processes_per_node} (restart {restart})")

    def describe(self, planned_replicas: int) -> str:
        return (f"lightning_pipe: elastic world: {self.headline()}: pipeline {self.planned_depth} -> {self.depth} "
                f"stage ranks, replicas {planned_replicas} -> {self.config.data_parallel_size}; the split follows "
                "below.")


def elastic_world(env: ClusterEnvironment | None, num_nodes: int, processes: int,
                  config: PipelineConfig) -> ElasticWorld | None:
    """The world torchrun gave, when it differs from ``num_nodes x processes`` only in its node count; else None
    (no torchrun launch, the planned world, or another mismatch, which Lightning's own check reports)."""
    if not isinstance(env, TorchElasticEnvironment) or processes < 1:
        return None
    given = env.world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    if given == num_nodes * processes or per_node != processes or given % processes:
        return None
    nodes = given // processes
    inner = config.fsdp_size * config.tensor_parallel_size
    planned = num_nodes * processes
    planned_depth = max(1, planned // (config.data_parallel_size * inner))
    if given % (planned_depth * inner) == 0:
        depth, replicas = planned_depth, given // (planned_depth * inner)
    else:
        depth, replicas = max(1, given // inner), 1
    return ElasticWorld(num_nodes, nodes, processes, dataclasses.replace(config, data_parallel_size=replicas),
                        planned_depth, depth)


__all__ = ["ElasticWorld", "elastic_world"]
