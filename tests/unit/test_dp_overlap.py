"""The overlapped data-parallel sync on one process (a gloo group of one): when buckets launch, in which order, and
how earlier batches' gradients are settled. Parity with replicas is proven by the multi-rank tests
(test_parity_core pp2xdp2, test_parity_schedules zero-bubble x dp, test_hardening token-weighted x dp)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.parallel import dp_overlap
from lightning_pipe.parallel.dp_handoff import settle
from lightning_pipe.parallel.dp_overlap import Carry, DataParallelOverlap
from lightning_pipe.runtime.stage import CallHooks


@pytest.fixture
def group(tmp_path) -> Iterator[Any]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class FakeStage(CallHooks):
    """What the overlap touches on a torch stage: its index, module, the two backward entry points and the call
    hooks of lightning_pipe's stage."""

    def __init__(self, index: int, submod: nn.Module, log: list[str]) -> None:
        self.stage_index, self.submod, self.log = index, submod, log

    def backward_one_chunk(self, mb: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self.log.append(f"B{self.stage_index}:{mb}")
        self.submod(torch.ones(2, 4)).sum().backward()
        self.log.append("end")

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        self.log.append(f"W{self.stage_index}:{mb}")


def test_buckets_launch_during_the_last_backward_in_reverse_layer_order(group, monkeypatch) -> None:
    log: list[str] = []
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    stage = FakeStage(0, layers, log)
    params = list(layers.parameters())
    overlap = DataParallelOverlap([stage], params, group)
    overlap.bucket_bytes = 2 * 4 * 4 * 4  # two weights per bucket (the first bucket is capped the same)
    launched: list[list[int]] = []
    real_launch = overlap._launch

    def launch(bucket: Any) -> None:
        launched.append(list(bucket.indices))
        log.append(f"launch {bucket.indices}")
        real_launch(bucket)

    monkeypatch.setattr(overlap, "_launch", launch)
    overlap.begin(microbatches=2)
    stage.backward_one_chunk(0)
    assert launched == []  # gradients are not final before the last micro-batch
    stage.backward_one_chunk(1)
    # reverse parameter order (the backward's order); every bucket launched by the hooks, inside autograd's backward
    assert [i for b in launched for i in b] == list(reversed(range(len(params))))
    assert len(launched) == 2 and log[-1] == "end" and log[-4] == "B0:1"
    overlap.end_schedule()
    averaged, carry = overlap.wait()
    assert carry is None
    for p, avg in zip(params, averaged):
        assert avg is not None and torch.equal(avg, p.grad)  # one replica: the average is the gradient


def test_a_parameter_of_two_local_stages_waits_for_both_and_w_completes_a_stage(group) -> None:
    log: list[str] = []
    shared = nn.Linear(4, 4)
    first, last = nn.Sequential(shared, nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), shared)
    stages = [FakeStage(0, first, log), FakeStage(3, last, log)]
    params = list({id(p): p for s in stages for p in s.submod.parameters()}.values())
    overlap = DataParallelOverlap(stages, params, group)
    overlap.begin(microbatches=1)
    stages[1].backward_one_chunk(0, full_backward=False)  # I: not counted
    assert not any(b.launched for q in overlap._queues.values() for b in q.buckets)
    stages[1].backward_weight_one_chunk(0)  # W: stage 3 is done, the shared weight is not
    assert all(b.launched for b in overlap._queues[3].buckets)
    assert not any(b.launched for b in overlap._queues[None].buckets)
    stages[0].backward_one_chunk(0)
    assert all(b.launched for q in overlap._queues.values() for b in q.buckets)
    overlap.end_schedule()
    overlap.wait()


def test_settle_uses_the_carry_only_for_gradients_nothing_touched(monkeypatch) -> None:
    params = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    saved = [torch.ones(3), torch.ones(3), None]
    carry = Carry(saved, [dp_overlap._compat.tensor_version(t) if t is not None else -1 for t in saved])
    carry.averaged = [torch.full((3,), 2.0), torch.full((3,), 2.0), None]
    params[0].grad = saved[0]  # untouched: replaced by the average
    params[1].grad = saved[1]
    saved[1].zero_()  # touched in place by a zero_grad: local, not averaged
    params[2].grad = None
    assert settle(params, carry, averaged=False) is False
    assert torch.equal(params[0].grad, torch.full((3,), 2.0)) and params[1].grad is saved[1]
    params[0].grad = params[1].grad = None  # set_to_none: nothing local left
    assert settle(params, carry, averaged=False) is True
    assert settle(params, None, averaged=True) is True
