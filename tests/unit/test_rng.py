"""[Note: random streams per stage] (lightning_pipe/runtime/rng.py) without a process group."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from lightning_pipe.runtime.rng import StageStream

CPU = torch.device("cpu")


def draw(stream: StageStream, n: int = 8) -> torch.Tensor:
    with stream.active():
        return torch.rand(n)


def test_each_stage_has_its_own_stream_derived_from_the_seed_and_the_base_is_not_advanced() -> None:
    torch.manual_seed(7)
    streams = [StageStream(s, CPU) for s in range(3)]
    base = torch.get_rng_state()
    drawn = [draw(s) for s in streams]
    assert torch.equal(torch.get_rng_state(), base)  # code outside the stages draws what it would have drawn
    assert not any(torch.equal(a, b) for i, a in enumerate(drawn) for b in drawn[i + 1:])
    torch.manual_seed(7)
    again = StageStream(1, CPU)  # same seed, same stage: the same stream (data-parallel replicas, tensor ranks)
    assert torch.equal(draw(again), drawn[1])
    assert not torch.equal(draw(again), drawn[1])  # and it advances
    torch.manual_seed(8)
    assert not torch.equal(draw(StageStream(1, CPU)), drawn[1])  # another seed, another stream


def test_peek_draws_what_the_next_forward_draws_and_recomputation_replays() -> None:
    torch.manual_seed(0)
    stream = StageStream(0, CPU)
    with stream.peek():  # torch's shape inference
        peeked = torch.rand(4)
    assert torch.equal(draw(stream, 4), peeked)
    x = torch.randn(16, requires_grad=True)
    masks: list[torch.Tensor] = []

    def dropout(t: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(t.shape) >= 0.5
        masks.append(keep)
        return t * keep

    with stream.active():
        y = checkpoint(dropout, x, use_reentrant=False)
    y.sum().backward()  # recomputes outside the stream's context: the checkpoint restores the forward's state
    assert len(masks) == 2 and torch.equal(masks[0], masks[1]) and torch.equal(x.grad, masks[0].float())


def test_a_held_stream_draws_what_per_action_entering_draws() -> None:
    """A rank with one stage holds its stream for the whole step (two swaps, not four per micro-batch): the stage's
    draws, peeks included, are the same, and the base generator is untouched afterwards."""
    torch.manual_seed(3)
    swapped, held = StageStream(0, CPU), StageStream(0, CPU)
    base = torch.get_rng_state()
    expected = [draw(swapped, 4) for _ in range(3)]
    saved = held.hold()
    with held.peek():  # shape inference inside a held step: no side effect
        peeked = torch.rand(4)
    got = [torch.rand(4) for _ in range(3)]
    held.release(saved)
    assert torch.equal(peeked, expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(torch.get_rng_state(), base)
    assert torch.equal(draw(held, 4), draw(swapped, 4))  # and both continue alike
