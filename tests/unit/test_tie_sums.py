"""The bookkeeping of [Note: tied copies summed at the schedule's end] (parallel/grads.py), on plain data.

Two ranks holding identical copies of a tied weight are modelled by a stand-in all-reduce that doubles its tensor (the
sum of two equal parts): whatever mix of early and late sums, cleared and kept ``.grad`` a sequence of batches takes,
the gradient the optimizer sees must be that sum of everything accumulated since the last clear — each part summed
exactly once. The real collective is proven by the multi-rank parity tests (tied GPT, accumulation, clipping)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.parallel import grads as grads_module
from lightning_pipe.parallel.grads import GradientSync
from lightning_pipe.parallel.topology import TieGroup


class _Done:
    def wait(self) -> None:
        pass


@pytest.fixture
def doubled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def all_reduce(tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        calls.append(1)
        tensor.mul_(2)
        return _Done() if async_op else None

    monkeypatch.setattr(grads_module.dist, "all_reduce", all_reduce)
    return calls


def _sync() -> tuple[GradientSync, nn.Parameter]:
    module = nn.Linear(2, 2, bias=False)
    tie = TieGroup(tie=SimpleNamespace(names=("weight",)), group="ties", owner=True)  # type: ignore[arg-type]
    groups = SimpleNamespace(tied=[tie], shard=None, tensor=None, dp=None, experts=None, ties_span_world=False)
    return GradientSync(module, list(module.parameters()), groups, torch.device("cpu")), module.weight  # type: ignore[arg-type]


@pytest.mark.parametrize("ops", [
    ["clear", "early", "sync"],  # accumulate_grad_batches=1: the sum runs early, the sync skips it
    ["clear", "late", "late", "early", "sync"],  # accumulation: local parts, then a step batch
    ["zeros", "early", "sync"],  # zero_grad(set_to_none=False)
    ["zeros", "late", "early", "sync"],
    ["zeros", "early", "late", "sync"],  # a hint said "step follows" and none did
    ["clear", "early", "early", "sync", "sync"],  # no clear between two early batches; a second sync
    ["clear", "early", "sync", "late", "sync"],  # no clear after the step (a user's zero_grad override)
])
def test_every_part_is_summed_once(ops: list[str], doubled: list[int]) -> None:
    sync, param = _sync()
    accumulated = torch.zeros(2, 2)
    for i, op in enumerate(ops):
        if op == "clear":
            param.grad, accumulated = None, torch.zeros(2, 2)
        elif op == "zeros":
            param.grad = torch.zeros(2, 2) if param.grad is None else param.grad.zero_()
            accumulated = torch.zeros(2, 2)
        elif op in ("early", "late"):
            fresh = torch.full((2, 2), float(i + 1))
            accumulated += fresh
            if op == "early":
                sync.sum_ties_early({id(param): fresh})
            summed = sync.finish_early_ties()
            sync.add_tied(param, fresh, id(param) in summed)
        else:
            sync.sync(replicas=False)
            torch.testing.assert_close(param.grad, 2 * accumulated)


def test_one_collective_per_step_without_accumulation(doubled: list[int]) -> None:
    """The common case costs what it did: one sum per tied weight per step, launched early, none at the sync."""
    sync, param = _sync()
    for _ in range(3):
        param.grad = None
        fresh = torch.ones(2, 2)
        sync.sum_ties_early({id(param): fresh})
        sync.add_tied(param, fresh, id(param) in sync.finish_early_ties())
        sync.sync(replicas=False)
    assert len(doubled) == 3


def test_folded_sums_count_as_summed(doubled: list[int]) -> None:
    """[Note: tie sums in the agreement]: a fresh gradient whose sum came back in the agreement's payload is summed
    once and never again (no collective of its own at the sync)."""
    sync, param = _sync()
    for _ in range(2):
        param.grad = None
        fresh = torch.full((2, 2), 3.0)
        payload = sync.fold_payload({id(param): fresh})
        assert payload.dtype == torch.float64 and payload.numel() == 4
        sync.unfold(payload * 2)  # the world's sum of two equal copies
        sync.add_tied(param, fresh, id(param) in sync.finish_early_ties())
        sync.sync(replicas=False)
        torch.testing.assert_close(param.grad, torch.full((2, 2), 6.0))
    assert doubled == []


def test_ties_fold_only_where_every_tie_group_is_the_world() -> None:
    sync, _ = _sync()
    assert not sync.fold_ties  # the stand-in groups' ties do not span the world
    sync.groups.ties_span_world = True
    module = nn.Linear(2, 2, bias=False)
    folding = GradientSync(module, list(module.parameters()), sync.groups, torch.device("cpu"))
    assert folding.fold_ties
    folding.early_ties = False  # Chimera, FSDP, tensor parallel: the sums run in the sync
    assert not folding.fold_ties
    big = nn.Linear(grads_module.FOLD_MAX_ELEMENTS, 2, bias=False)  # above the size where the transfer dominates
    assert not GradientSync(big, list(big.parameters()), sync.groups, torch.device("cpu")).fold_ties


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_pair_summed_in_float64_rounds_as_the_pair_summed_in_its_dtype(dtype: torch.dtype) -> None:
    """Double rounding is innocuous for addition when the wide format has >= 2p + 2 bits: two copies summed through
    the float64 payload give the gradient a float32 / bfloat16 all-reduce would, bit for bit."""
    g = torch.Generator().manual_seed(0)
    span = 8 if dtype == torch.float16 else 40  # exponents apart, within the dtype's range
    scale = torch.exp2(torch.randint(-span, span, (200_000,), generator=g).float())
    a = (torch.randn(200_000, generator=g) * scale).to(dtype)
    b = (torch.randn(200_000, generator=g) * scale.flip(0)).to(dtype)
    assert torch.equal((a.double() + b.double()).to(dtype), a + b)


def test_a_copy_without_gradient_sends_zeros_and_receives_the_sum() -> None:
    """Every rank's payload has the same layout: a tied copy that got no gradient this batch (a layer that skipped
    its weight) contributes zeros, and the sum it gets back is pending like any other gradient."""
    from lightning_pipe.runtime.engine import PipelineEngine

    tied, other = nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(4))
    engine = SimpleNamespace(parameters=[other, tied], _pending_grads=[torch.ones(4), None],
                             grads=SimpleNamespace(tie_of={id(tied): "ties"}))
    fresh = PipelineEngine._fresh_ties(engine)  # type: ignore[arg-type]
    assert list(fresh) == [id(tied)] and torch.equal(fresh[id(tied)], torch.zeros(2, 3))
    assert engine._pending_grads[1] is fresh[id(tied)]  # the sum lands where apply_pending_grads reads it
