"""Where each rank sits (which GPUs share a node) and what a collective or a send costs on those links.

[Note: collectives on a cluster]
A group of n GPUs with c of them in each of k nodes all-reduces S bytes hierarchically, as NCCL's rings and trees
do in bandwidth terms: inside each node over NVLink (``2 (c-1)/c x S``), then across nodes, each GPU carrying its
``S / c`` share over its own NIC (``2 (k-1)/k x S / c``); a reduce-scatter or an all-gather is half of that. Both
links run at ``link`` x their rate; every step of the ring pays the link's latency. Groups that run at the same time
use different GPUs and NICs (one NIC per GPU), so they do not share bandwidth. A send between two stages crosses
NVLink when both GPUs are in one node, else the network; with ``pp_scatter_gather`` (Megatron) each of the tp ranks
sends 1/tp of the tensor across and the receivers all-gather it over NVLink.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_pipe.planner.cluster.kernels import Efficiency
from lightning_pipe.planner.cluster.specs import ClusterSpec


@dataclass(frozen=True)
class Placement:
    """Mesh sizes and their order, innermost (consecutive global ranks) first."""

    sizes: Mapping[str, int]
    order: tuple[str, ...]
    gpus_per_node: int

    def stride(self, dim: str) -> int:
        out = 1
        for d in self.order:
            if d == dim:
                return out
            out *= self.sizes[d]
        raise KeyError(dim)

    def span(self, dim: str) -> tuple[int, int]:
        """(GPUs of the group per node, nodes the group spans) for a group along ``dim``."""
        size, stride = self.sizes[dim], self.stride(dim)
        if size <= 1:
            return 1, 1
        per_node = max(1, min(size, self.gpus_per_node // stride)) if stride < self.gpus_per_node else 1
        return per_node, -(-size // per_node)

    def same_node(self, dim: str, a: int, b: int) -> bool:
        """Whether members ``a`` and ``b`` of a group along ``dim`` (the others' indices 0) share a node."""
        stride = self.stride(dim)
        return (a * stride) // self.gpus_per_node == (b * stride) // self.gpus_per_node


@dataclass(frozen=True)
class Links:
    """Prices collectives and sends on ``cluster``'s links."""

    cluster: ClusterSpec
    eff: Efficiency

    @property
    def nvlink(self) -> float:
        return self.cluster.nvlink_gbps * 1e9 * self.eff.link

    @property
    def network(self) -> float:
        return self.cluster.network_gbps * 1e9 * self.eff.link

    def _ring(self, nbytes: float, per_node: int, nodes: int, passes: float) -> float:
        """``passes`` = 2 for an all-reduce, 1 for a reduce-scatter or an all-gather."""
        if per_node * nodes <= 1 or nbytes <= 0:
            return 0.0
        c = self.cluster
        inside = passes * (per_node - 1) / per_node * nbytes / self.nvlink
        across = passes * (nodes - 1) / nodes * nbytes / (per_node * self.network) if nodes > 1 else 0.0
        latency = passes * ((per_node - 1) * c.nvlink_latency_us + (nodes - 1) * c.network_latency_us) * 1e-6
        return inside + across + latency

    def all_reduce(self, nbytes: float, span: tuple[int, int]) -> float:
        return self._ring(nbytes, span[0], span[1], 2.0)

    def reduce_scatter(self, nbytes: float, span: tuple[int, int]) -> float:
        return self._ring(nbytes, span[0], span[1], 1.0)

    all_gather = reduce_scatter

    def send(self, nbytes: float, same_node: bool, scatter_over: int = 1) -> float:
        """One tensor to the next stage's GPU (one direction)."""
        c = self.cluster
        if same_node:
            return nbytes / self.nvlink + c.nvlink_latency_us * 1e-6
        if scatter_over > 1:
            gather = (scatter_over - 1) / scatter_over * nbytes / self.nvlink
            return nbytes / scatter_over / self.network + gather + c.network_latency_us * 1e-6
        return nbytes / self.network + c.network_latency_us * 1e-6
