"""Gradient collectives of one rank: data-parallel averaging, tied-copy sums, the global-norm clip.

Everything here runs between the schedule's backward and the optimizer step (see the strategy's ``optimizer_step``),
and the initial broadcast that makes replicas and tied copies start identical.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe.parallel.dtensor import local as local_part
from lightning_pipe.parallel.experts import is_expert
from lightning_pipe.parallel.topology import SHARD, TENSOR, ProcessGroups, TieGroup


def split_dims(tensor: Tensor) -> set[str]:
    """The named mesh dimensions a DTensor is split along (``Shard``, or FSDP's strided shard of a tensor-parallel
    split: anything but ``Replicate``); none for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return set()
    names = tensor.device_mesh.mesh_dim_names or ()
    return {name for name, placement in zip(names, tensor.placements) if not placement.is_replicate()}


def counts_here(grad: Tensor, coords: Mapping[str, int]) -> bool:
    """Whether this rank counts its local part of ``grad`` in the global norm.

    [Note: counting sharded gradients]
    The global norm sums each rank's counted local parts over the pipeline group and over every mesh dimension a
    stage is spread over (``coords``: ``dp_shard`` and ``tensor``, this rank's coordinate on each); replicas are not
    summed (they hold the same gradients). A gradient's elements must then be counted once: along a dimension the
    gradient is split over (FSDP's shards, a tensor-parallel split, both for a 2-D DTensor), every rank holds
    different elements and counts its own; along a dimension it is replicated over (a LayerNorm weight under tensor
    parallelism, sharded by FSDP or not), every rank holds the same elements and only coordinate 0 counts them.
    A plain tensor is replicated along every dimension. (Partial placements never reach a reduced gradient.)
    """
    split = split_dims(grad)
    return all(coord == 0 or dim in split for dim, coord in coords.items())


FOLD_MAX_ELEMENTS = 1 << 18
"""Tied gradients up to this many elements in all ride the step's agreement ([Note: tie sums in the agreement]):
2 MiB as float64, where a collective's fixed cost still outweighs the transfer (gloo on CPU, NCCL alike)."""


class GradientSync:
    """This rank's parameters and the collectives over them."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], groups: ProcessGroups,
                 device: torch.device) -> None:
        self.params = list(params)
        self.groups = groups
        self.device = device
        # Sharded experts are averaged over their own replicas, not the data-parallel group ([Note: expert
        # parallelism] in experts.py); with expert_parallel_size=1 there are none.
        self.experts = [p for p in self.params if is_expert(p)]
        expert_ids = {id(p) for p in self.experts}
        self.dense = [p for p in self.params if id(p) not in expert_ids]
        # (this rank's copy, its tie group), looked up once: used at every optimizer step.
        named = dict(module.named_parameters(remove_duplicate=False))
        self.ties: list[tuple[nn.Parameter, TieGroup]] = []
        for tie_group in groups.tied:
            param = next((named[n] for n in tie_group.tie.names if n in named), None)
            if param is not None:
                self.ties.append((param, tie_group))
        # [Note: tied copies summed at the schedule's end]
        self.early_ties = bool(self.ties) and groups.shard is None and groups.tensor is None
        """Whether :meth:`sum_ties_early` may run (plain tensors: FSDP and tensor-parallel copies sum at the sync)."""
        self.tie_of = {id(param): tie_group.group for param, tie_group in self.ties}
        """``id(param)`` -> the group its tied copies sum over (parameters tied across ranks only)."""
        self._foldable = (groups.ties_span_world and groups.experts is None
                          and sum(p.numel() for p, _ in self.ties) <= FOLD_MAX_ELEMENTS)
        self._launched: dict[int, Any] = {}  # id(param) -> the all-reduce of its fresh gradient
        self._folded: list[tuple[int, Tensor]] = []  # (id(param), fresh gradient) in the agreement's payload
        self._summed: dict[int, Tensor] = {}  # id(param) -> the .grad tensor known to hold the tie sum

    def sync(self, replicas: bool = True) -> None:
        """Average over data-parallel replicas (unless ``replicas=False``: the engine averaged them during the
        schedule), then sum the copies of tied parameters held by several stages."""
        # With FSDP the data-parallel average was FSDP's reduce ([Note: FSDP under the pipeline schedule]).
        if replicas and self.groups.dp is not None and self.groups.shard is None:
            # (tensor parallel: each rank's local part, averaged with the same tensor rank of the other replicas)
            grads = [local_part(p.grad) for p in self.dense if p.grad is not None]
            if grads:
                all_reduce_coalesced(grads, self.groups.dp, average=True)
        if replicas and self.experts:
            self.groups.experts.reduce([p.grad for p in self.experts if p.grad is not None])
        for param, tie_group in self.ties:
            grad = param.grad
            if grad is not None and self._summed.get(id(param)) is not grad:
                dist.all_reduce(local_part(grad), group=tie_group.group)  # sharded copies: the same shard of each
                self._summed[id(param)] = grad

    # [Note: tied copies summed at the schedule's end]
    # The copies of a tied parameter (a GPT's embedding and head) are summed over their tie group before the optimizer
    # step. Summed in :meth:`sync`, that all-reduce is a second meeting point of the ranks after the step's
    # agreement (runtime/agreement.py), and each meeting costs the wake-up of a rank blocked in it (about as much as
    # the transfer on a busy CPU host). So on a batch the optimizer step follows, the engine launches the sum of the
    # fresh gradients asynchronously right after the schedule, before the agreement: both collectives then meet at
    # once, and the hand-over waits on a finished transfer. Sums are linear, so summing the fresh part and what
    # ``.grad`` held apart is exact, as long as no part is summed twice or never. Hence ``_summed`` remembers the
    # ``.grad`` tensors that hold a tie sum (what :meth:`sync` skips), and :meth:`add_tied` mixes parts by that rule:
    # a summed fresh part onto a ``.grad`` not known to be summed sums the old part first, and a local fresh part onto
    # a summed ``.grad`` is summed at once (both only when ``zero_grad`` did not clear ``.grad``: accumulation with
    # ``set_to_none=False``, or a user override). Not with data-parallel overlap (the averaged gradients are views of
    # its buckets, handed over later), FSDP or tensor-parallel copies: those sum in :meth:`sync`.
    def sum_ties_early(self, fresh: Mapping[int, Tensor | None]) -> None:
        """Launch the tie sums of this batch's fresh gradients (``fresh``: by ``id(param)``), asynchronously."""
        for param, tie_group in self.ties:
            grad = fresh.get(id(param))
            if grad is not None:
                self._launched[id(param)] = dist.all_reduce(grad, group=tie_group.group, async_op=True)

    @property
    def fold_ties(self) -> bool:
        """Whether the early tie sums may ride the step's agreement ([Note: tie sums in the agreement])."""
        return self.early_ties and self._foldable

    # [Note: tie sums in the agreement]
    # Launched early, the tie sum still is a collective of its own: for a small tie its fixed cost (a round trip and
    # the wake-up of the ranks blocked in it) outweighs the transfer, and the agreement queued behind it waits for it
    # (docs/performance.md, "What the strategy adds per step"), a second meeting point per step. Where every tie group is the
    # whole world (one pipeline, each tied weight held by every rank: the pipeline-2 GPT) the sums can ride the
    # agreement's SUM all-reduce instead, as float64: a sum of two float32 (or bfloat16) values computed in float64
    # and rounded back is the correctly rounded sum — double rounding is innocuous for addition when the wide format
    # has at least 2p + 2 bits (53 >= 2 * 24 + 2) — so two copies sum bit for bit as gloo or NCCL sum them; more
    # copies sum more accurately than a float32 chain. The payload doubles in float64, so only small ties ride along
    # (FOLD_MAX_ELEMENTS): a large embedding's all-reduce is bandwidth-bound, and on its own it overlaps the
    # agreement. Every rank decides alike: the ties, their order and their sizes are the same on every rank.
    def fold_payload(self, fresh: Mapping[int, Tensor]) -> Tensor:
        """The agreement's extra payload (float64) holding this batch's fresh tied gradients (``fresh``: by
        ``id(param)``, one for every tied parameter), in :attr:`ties` order; :meth:`unfold` reads its sum back."""
        self._folded = [(id(param), fresh[id(param)]) for param, _ in self.ties]
        # one float64 buffer, each gradient widened straight into its slice: one copy per gradient, where
        # torch.cat of .double() views would widen each into a temporary and copy that again
        payload = torch.empty(sum(grad.numel() for _, grad in self._folded), dtype=torch.float64,
                              device=self._folded[0][1].device)
        offset = 0
        for _, grad in self._folded:
            n = grad.numel()
            payload[offset:offset + n].copy_(grad.reshape(-1))
            offset += n
        return payload

    def unfold(self, summed: Tensor) -> None:
        """Each fresh tied gradient of :meth:`fold_payload` becomes its slice of the world's sum (then reported by
        :meth:`finish_early_ties` as summed)."""
        offset = 0
        for key, grad in self._folded:
            n = grad.numel()
            grad.copy_(summed[offset:offset + n].view(grad.shape))
            offset += n
            self._launched[key] = None

    def finish_early_ties(self) -> set[int]:
        """Wait for the sums :meth:`sum_ties_early` launched (done by now: every rank has met at the agreement since);
        the ``id`` of each parameter whose fresh gradient is now the tie sum (those :meth:`unfold` summed too)."""
        done = set(self._launched)
        for work in self._launched.values():
            if work is not None:
                work.wait()
        self._launched, self._folded = {}, []
        return done

    def add_tied(self, param: nn.Parameter, fresh: Tensor, fresh_summed: bool) -> None:
        """``param.grad += fresh`` for a parameter tied across ranks (in :attr:`tie_of`), keeping track of which
        ``.grad`` holds the tie sum."""
        group = self.tie_of[id(param)]
        grad = param.grad
        if grad is None:
            param.grad = fresh
            if fresh_summed:
                self._summed[id(param)] = fresh
            else:
                self._summed.pop(id(param), None)
            return
        known = self._summed.get(id(param)) is grad
        if known and not fresh_summed:
            dist.all_reduce(fresh, group=group)
            fresh_summed = True
        elif fresh_summed and not known:
            dist.all_reduce(grad, group=group)
            known = True
        grad.add_(fresh)
        if known and fresh_summed:
            self._summed[id(param)] = grad
        else:
            self._summed.pop(id(param), None)

    def norm_excluded(self) -> set[int]:
        """Tied copies that another rank already counts in the global norm."""
        return {id(param) for param, tie_group in self.ties if not tie_group.owner}

    def broadcast_initial_state(self, tensors: Sequence[Tensor]) -> None:
        """Start identical: replicas from data-parallel rank 0 (as DDP does), tied copies from their owner."""
        expert_ids = {id(p) for p in self.experts}
        replicas = self.groups.experts.replicas if self.experts else None
        for t in tensors:
            if id(t) in expert_ids:  # the same experts are held by their replicas only
                if replicas is not None:
                    dist.broadcast(t.data, group=replicas, group_src=0)
            elif self.groups.dp is not None:
                dist.broadcast(local_part(t.data), group=self.groups.dp, group_src=0)
        for param, tie_group in self.ties:  # (sharded copies: the same shard of each)
            dist.broadcast(local_part(param.data), group=tie_group.group, group_src=0)

    def clip_grad_norm_(self, parameters: Sequence[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                        over_pipeline: bool = True) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the norm taken over every stage of the pipeline and every part
        of a sharded or split gradient, each element once ([Note: counting sharded gradients]);
        ``over_pipeline=False``: over this rank's stages only, their shards and tensor ranks included (PipeDream's
        per-stage clipping, where the stages update at different times)."""
        total = self.global_norm(parameters, norm_type, over_pipeline)
        grads = [local_part(p.grad) for p in parameters if p.grad is not None]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def global_norm(self, parameters: Sequence[nn.Parameter], norm_type: float = 2.0,
                    over_pipeline: bool = True) -> Tensor:
        """The ``norm_type``-norm of the gradients of ``parameters`` over every stage (a collective over the
        pipeline, shards and tensor ranks; every rank calls it, with its own parameters), each element once, a tied
        weight once ([Note: counting sharded gradients])."""
        excluded = self.norm_excluded()
        # Each element once: [Note: counting sharded gradients]
        topology = self.groups.topology
        coords = {SHARD: topology.shard_rank, TENSOR: topology.tp_rank}
        # Sharded experts: each expert group holds every expert once, so their part is summed over the group
        # ([Note: expert parallelism] in experts.py).
        expert_ids = {id(p) for p in self.experts}
        counted = [local_part(p.grad) for p in parameters if p.grad is not None and id(p) not in excluded
                   and id(p) not in expert_ids and counts_here(p.grad, coords)]
        expert_grads = [p.grad for p in parameters if p.grad is not None and id(p) in expert_ids]
        exchange = self.groups.experts.exchange if self.experts else None
        tensor = self.groups.tensor
        norm_type = float(norm_type)
        pp, many = self.groups.pp, over_pipeline and self.groups.topology.pipeline_size > 1
        zero = torch.zeros((), device=self.device)
        if norm_type == math.inf:
            maxima = [g.detach().abs().max().float() for g in counted if g.numel()]  # (a shard may be empty)
            local = torch.stack(maxima).max() if maxima else zero
            if exchange is not None:
                part = torch.stack([g.detach().abs().max().float() for g in expert_grads if g.numel()] or [zero])
                part = part.max()
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=exchange)
                local = torch.maximum(local, part)
            if many:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pp)
            for group in (self.groups.shard, tensor):
                if group is not None:
                    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            total = local
        else:
            local = (torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type
                                  for g in counted]).sum() if counted else zero)
            if exchange is not None:
                part = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type
                                    for g in expert_grads] or [zero]).sum()
                dist.all_reduce(part, group=exchange)
                local = local + part
            if many:
                dist.all_reduce(local, group=pp)
            for group in (self.groups.shard, tensor):
                if group is not None:
                    dist.all_reduce(local, group=group)
            total = local ** (1.0 / norm_type)
        return total

    @staticmethod
    def clip_grad_value_(parameters: Sequence[nn.Parameter], clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` on each rank's local parts: the clamp is elementwise, so clamping a
        split gradient's parts clamps it whole; torch's foreach clamp refuses a list that mixes DTensor and plain
        gradients, which is what a tensor-parallel stage holds ([Note: tensor parallel stages])."""
        for p in parameters:
            if p.grad is not None:
                local_part(p.grad).clamp_(-clip_value, clip_value)


def all_reduce_coalesced(tensors: list[Tensor], group: Any, average: bool, bucket_bytes: int = 64 * 2**20) -> None:
    """All-reduce many tensors as a few flat buckets (one per dtype and ~64 MiB)."""
    world = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        start = 0
        while start < len(same):
            bucket: list[Tensor] = []
            size = 0
            while start < len(same) and (not bucket or size < bucket_bytes):
                bucket.append(same[start])
                size += same[start].numel() * same[start].element_size()
                start += 1
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            if average:
                flat.div_(world)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
