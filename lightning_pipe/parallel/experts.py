"""Routed experts and expert parallelism: each MoE layer's experts sharded over ranks of a stage's data-parallel
group, tokens exchanged with ``all_to_all``.

[Note: expert parallelism]
With ``expert_parallel_size=E`` the ``D`` data-parallel ranks of a stage (replicas; [Note: rank order]) form
``D / E`` *expert groups* of ``E`` consecutive data-parallel indices: data-parallel index ``d`` has expert rank
``d % E`` in expert group ``d // E``. Expert rank ``i`` of every group holds experts
``[i * n / E, (i + 1) * n / E)`` of every :class:`RoutedExperts` (``n`` experts); the router, attention and
everything else stay replicated. A forward routes each rank's own tokens (top-k per token), sends each
(token, choice) to the rank holding its expert (``all_to_all_single`` with uneven splits: one exchange of counts,
then the rows), runs the local experts and sends the outputs back; backward is the same two exchanges reversed
(:class:`_AllToAll`). All ranks of an expert group sit at the same pipeline rank and run the same schedule, so
their exchanges pair up in order (the split backward's I step holds them; W computes weight gradients locally).

Gradients: a local expert's gradient already sums the contributions of the ``E`` ranks whose tokens it served;
the one-device gradient of the replicas' mean loss is then the sum over the ``D / E`` ranks holding the same
experts (the *expert replicas*: same expert rank, other expert groups) divided by ``D`` (:func:`ExpertGroups.reduce`),
instead of the mean over all ``D`` that dense parameters get. Expert parameters are marked (:func:`is_expert`) so
the gradient sync, the initial broadcast and the global norm treat them so (parallel/grads.py).

Checkpoints stay layout-free: the experts live in an ``nn.ModuleDict`` keyed by their *global* index, so a rank's
state dict names ``...experts.5.w1.weight`` whichever ranks hold expert 5, and a checkpoint loads into another
expert-parallel size or one device unchanged.

Every expert runs on every forward, on zero rows if no token chose it: its gradient is then zeros, not ``None``, so
every rank holds the same gradient list (a replica's collectives pair by position).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.checkpoint.format import POSITIONS_BY_KEY
from lightning_pipe.config import config_error
from lightning_pipe.parallel.dp_handoff import mean_count
from lightning_pipe.parallel.group_cache import shared_group
from lightning_pipe.parallel.topology import Topology
from lightning_pipe.trace.spans import span

EXPERT_MARK = "_lightning_pipe_expert"
"""Attribute set on expert parameters sharded by :meth:`RoutedExperts.shard` (value: the :class:`ExpertGroups`)."""


def is_expert(param: Tensor) -> bool:
    """Whether ``param`` belongs to a sharded expert ([Note: expert parallelism])."""
    return getattr(param, EXPERT_MARK, None) is not None


@dataclass(frozen=True)
class ExpertLayout:
    """Rank arithmetic of expert parallelism over one stage's ``dp_degree`` data-parallel ranks."""

    dp_degree: int
    size: int
    dp_rank: int

    @property
    def expert_rank(self) -> int:
        return self.dp_rank % self.size

    @property
    def group_index(self) -> int:
        return self.dp_rank // self.size

    def owned(self, num_experts: int) -> range:
        """The global expert indices this rank holds."""
        per = num_experts // self.size
        return range(self.expert_rank * per, (self.expert_rank + 1) * per)

    def group_dp_ranks(self, group_index: int) -> list[int]:
        """Data-parallel indices of one expert group (they exchange tokens)."""
        return [group_index * self.size + i for i in range(self.size)]

    def replica_dp_ranks(self, expert_rank: int) -> list[int]:
        """Data-parallel indices holding the same experts (their expert gradients are summed)."""
        return [g * self.size + expert_rank for g in range(self.dp_degree // self.size)]


def check_expert_parallel(size: Any, topology: Topology) -> None:
    """``expert_parallel_size`` against the world, before any collective (every rank sees the same values)."""
    if size == 1:
        return
    if topology.fsdp_size > 1 or topology.tensor_parallel_size > 1:
        raise config_error(
            "Expert parallelism shards experts over a stage's data-parallel replicas; with FSDP or tensor "
            "parallelism it is not supported yet.",
            f"expert_parallel_size={size}, fsdp_size={topology.fsdp_size}, "
            f"tensor_parallel_size={topology.tensor_parallel_size}", "expert_parallel_size",
            also=("fsdp_size", "tensor_parallel_size"))
    if topology.dp_degree % size:
        raise config_error(
            "The expert-parallel size must divide the data-parallel size (each stage's replicas are cut into "
            "groups of expert_parallel_size ranks that exchange tokens).",
            f"expert_parallel_size={size}, data_parallel_size={topology.dp_degree}", "expert_parallel_size",
            also=("data_parallel_size",))


def check_expert_count(num_experts: int, size: int, where: str) -> None:
    if num_experts % size:
        raise config_error(
            "The expert-parallel size must divide each MoE layer's expert count (every expert rank holds an equal "
            "share).", f"expert_parallel_size={size}, {num_experts} experts in {where}", "expert_parallel_size",
            fix="Or change the model's expert count (Hydra: model.moe_experts)")


class ExpertGroups:
    """The process groups of expert parallelism for this rank. Built collectively: every rank creates every group,
    in the same order (per pipeline rank: the expert groups, then the expert-replica groups)."""

    def __init__(self, topology: Topology, size: int, dp: Any) -> None:
        """``dp``: the stage's data-parallel group (``ProcessGroups.dp``)."""
        check_expert_parallel(size, topology)
        self.dp = dp
        self.size = size
        self.layout = ExpertLayout(topology.dp_degree, size, topology.dp_rank)
        self.dp_degree = topology.dp_degree
        self.exchange: Any = None
        self.replicas: Any = None  # None: each expert is held once per stage (E = D)
        layout = self.layout
        for pp_rank in range(topology.pipeline_size):
            for g in range(topology.dp_degree // size):
                ranks = [topology.rank_of(d, pp_rank) for d in layout.group_dp_ranks(g)]
                group = shared_group(ranks, "expert_exchange")
                if pp_rank == topology.pp_rank and g == layout.group_index:
                    self.exchange = group
            if topology.dp_degree // size > 1:
                for i in range(size):
                    ranks = [topology.rank_of(d, pp_rank) for d in layout.replica_dp_ranks(i)]
                    group = shared_group(ranks, "expert_replicas")
                    if pp_rank == topology.pp_rank and i == layout.expert_rank:
                        self.replicas = group

    def mean_count(self, elements: float | Tensor, device: torch.device) -> Tensor:
        """The replicas' mean target count: ``N`` of a token-weighted loss must be the same on every rank when an
        expert's gradient sums several replicas' losses ([Note: token-weighted loss] in layers/batches.py)."""
        return mean_count(elements, self.dp, self.dp_degree, device)

    def reduce(self, grads: Sequence[Tensor]) -> None:
        """Expert gradients to the one-device gradient of the replicas' mean loss ([Note: expert parallelism])."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.replicas is not None:
            dist.all_reduce(flat, group=self.replicas)
        flat.div_(self.dp_degree)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        with span("dispatch", "all_to_all"):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        with span("dispatch", "all_to_all (backward)"):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _run_grouped(experts: Sequence[nn.Module], rows: Tensor, counts: list[int]) -> Tensor:
    """``rows`` grouped by expert (``counts[j]`` rows for ``experts[j]``) -> their outputs, in the same order."""
    outputs = [expert(chunk) for expert, chunk in zip(experts, rows.split(counts))]
    return torch.cat(outputs) if outputs else rows


class RoutedExperts(nn.Module):
    """``n`` experts applied to routed tokens: ``forward(x [N, C], index [N, k], weight [N, k]) -> [N, C]``,
    ``out[t] = sum_j weight[t, j] * experts[index[t, j]](x[t])``. Locally by default; over an expert group once
    :meth:`shard` ran ([Note: expert parallelism])."""

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.num_experts = len(experts)
        self.experts = nn.ModuleDict({str(i): e for i, e in enumerate(experts)})
        # a rank holds some experts under their global keys: checkpoints order them by key, not by local place
        setattr(self.experts, POSITIONS_BY_KEY, True)
        self.groups: ExpertGroups | None = None

    def shard(self, groups: ExpertGroups, where: str = "") -> None:
        """Keep only this rank's experts (global keys kept) and mark their parameters. Idempotent."""
        if self.groups is not None:
            return
        check_expert_count(self.num_experts, groups.size, where or type(self).__name__)
        owned = {str(i) for i in groups.layout.owned(self.num_experts)}
        for key in [k for k in self.experts if k not in owned]:
            del self.experts[key]
        self.groups = groups
        self.mark()

    def mark(self) -> None:
        """Mark the parameters held now as sharded experts (again after meta-built ones are allocated: that makes
        new Parameter objects)."""
        for p in self.experts.parameters():
            setattr(p, EXPERT_MARK, self.groups)

    def forward(self, x: Tensor, index: Tensor, weight: Tensor) -> Tensor:
        n, k = index.shape
        if x.device.type == "meta":
            # planning a batch shape's transfers on meta tensors ([Note: shapes without re-inference]): routing
            # reads values (counts, splits) and the exchange is a collective, but the output's shape and dtype are
            # one expert's on every row, combined as below
            one = next(iter(self.experts.values()))(x)
            return (one.unsqueeze(1).expand(n, k, *one.shape[1:]) * weight.unsqueeze(-1).to(one.dtype)).sum(1)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        rows = x.repeat_interleave(k, dim=0)[order]
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.groups is None:
            out_sorted = _run_grouped(list(self.experts.values()), rows, counts.tolist())
        else:
            out_sorted = self._exchange(rows, counts)
        out = out_sorted[torch.argsort(order)]  # back to (token, choice) order
        return (out.view(n, k, -1) * weight.unsqueeze(-1).to(out.dtype)).sum(1)

    def _exchange(self, rows: Tensor, counts: Tensor) -> Tensor:
        assert self.groups is not None
        size, group = self.groups.size, self.groups.exchange
        local = self.num_experts // size
        # counts[e] for e held by rank r go to r; receive [source rank, local expert] counts
        sent = counts.view(size, local).contiguous()
        received = torch.empty_like(sent)
        with span("dispatch", "counts"):
            dist.all_to_all_single(received, sent, group=group)
        sent_list, received_list = sent.tolist(), received.tolist()  # the host needs the split sizes
        in_splits = [sum(r) for r in sent_list]
        out_splits = [sum(r) for r in received_list]
        arrived = _AllToAll.apply(rows, out_splits, in_splits, group)  # by source rank, then local expert
        # group by local expert (stable: source order kept within one), run, and restore the arrival order
        expert_of = torch.arange(local, device=rows.device).repeat(size).repeat_interleave(
            received.reshape(-1).to(rows.device))
        by_expert = torch.argsort(expert_of, stable=True)
        per_expert = received.sum(0).tolist()
        done = _run_grouped(list(self.experts.values()), arrived[by_expert], per_expert)
        back = done[torch.argsort(by_expert)]
        return _AllToAll.apply(back, in_splits, out_splits, group)


def routed_experts(stage_modules: Sequence[nn.Module]) -> list[tuple[str, RoutedExperts]]:
    return [(name, m) for sm in stage_modules for name, m in sm.named_modules() if isinstance(m, RoutedExperts)]


def check_has_experts(layers: Iterable[nn.Module], size: int, where: str) -> None:
    """``expert_parallel_size > 1`` on a model with no :class:`RoutedExperts` is refused. Every rank still holds
    every layer here (on meta when built in ``configure_model``): one verdict everywhere."""
    if size > 1 and not any(isinstance(m, RoutedExperts) for layer in layers for m in layer.modules()):
        raise config_error(
            "expert_parallel_size shards the experts of the model's RoutedExperts layers (lightning_pipe's MoE "
            "layer, docs/moe.md) over the replicas; this model has none, so every rank would keep every expert "
            "(transformers' own MoE layers are not sharded).",
            f"expert_parallel_size={size} and no RoutedExperts in {where}", "expert_parallel_size", "to 1")


def apply_experts(stage_modules: Sequence[nn.Module], topology: Topology, size: int, dp_group: Any) -> ExpertGroups:
    """Expert parallelism over the data-parallel ranks of each stage: the groups, and each :class:`RoutedExperts`
    cut to this rank's experts, before allocation (a rank allocates only its own: [Note: expert parallelism]).
    After allocation, :func:`mark_experts`. Collective (every rank creates every group)."""
    groups = ExpertGroups(topology, size, dp_group)
    shard_experts(stage_modules, groups)
    return groups


def shard_experts(stage_modules: Sequence[nn.Module], groups: ExpertGroups) -> None:
    """Shard every :class:`RoutedExperts` of this rank's stages (before their layers are allocated)."""
    for name, module in routed_experts(stage_modules):
        module.shard(groups, name)


def mark_experts(stage_modules: Sequence[nn.Module]) -> None:
    """After allocation: mark the sharded experts' (new) parameters."""
    for _, module in routed_experts(stage_modules):
        if module.groups is not None:
            module.mark()
