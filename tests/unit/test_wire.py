"""[Note: contiguous on the wire] and [Note: naming a failed P2P op] (lightning_pipe/runtime/wire.py), in one process:
a 1-rank gloo group stands in for the pipeline's (gloo checks a send's tensor before it needs a peer)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pipe.runtime import wire


@pytest.fixture
def group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_view_output_becomes_a_contiguous_tensor_of_its_own_and_a_plain_one_passes() -> None:
    h = torch.randn(4, 3, requires_grad=True)
    plain = h * 2
    assert wire.own_outputs(torch.nn.Identity(), (), (plain, plain)) is None  # nothing to do: no copy
    out = wire.own_outputs(torch.nn.Identity(), (), (plain.t().contiguous().t(), plain[:, :2], plain))
    assert all(t.is_contiguous() and t._base is None for t in out) and out[2] is plain
    out[0].sum().backward()  # still inside the graph
    torch.testing.assert_close(h.grad, torch.full((4, 3), 2.0))


def test_sends_go_contiguous_receives_get_a_contiguous_buffer_torch_reads(group: None) -> None:
    strided = torch.randn(3, 4).t()
    send = dist.P2POp(dist.isend, strided, 0)
    wire.tag_sends([send], stage=1, microbatch=2, kind="forward send", positions=[1], peers=[2])
    assert send.tensor.is_contiguous() and torch.equal(send.tensor, strided)
    buffer = torch.empty_strided((4, 3), (1, 4)).requires_grad_(True)  # as torch >= 2.12 allocates from metadata
    info = SimpleNamespace(buffer=buffer, source=0)
    recv = dist.P2POp(dist.irecv, buffer, 0)
    wire.tag_receives([recv], (SimpleNamespace(), info), stage=1, microbatch=2, kind="forward receive")
    assert recv.tensor is info.buffer and info.buffer.is_contiguous() and info.buffer.requires_grad
    assert "stage 1, micro-batch 2, forward receive of input 1 from stage 0: shape (4, 3)" in wire.describe_op(recv)


def test_a_failed_send_names_stage_microbatch_position_shape_dtype_and_layout(group: None) -> None:
    op = dist.P2POp(dist.isend, torch.ones(3, 4, dtype=torch.float64).t(), 0)
    wire.tag_sends([op], stage=0, microbatch=3, kind="backward send", positions=[0], peers=[1])
    op.tensor = torch.ones(3, 4).t()  # what a send without the fix would post
    with pytest.raises(wire.P2PError) as failed, wire.named_p2p_failures():
        torch_schedules._batch_p2p([op], desc="test")
    message = str(failed.value)
    assert ("global rank 0 while posting 1 op(s): stage 0, micro-batch 3, backward send of the gradient of input 0 "
            "to stage 1: shape (4, 3), torch.float32, not contiguous (stride (1, 4)), on cpu") in message, message
    assert "torch said: RuntimeError" in message and "contiguous" in message.split("torch said:")[1]
    assert torch_schedules._batch_p2p.__name__ == "_batch_p2p"  # the wrap ends with the context


def test_a_send_of_another_shape_than_its_receiver_expects_is_refused() -> None:
    """[Note: sends of the receiver's shape]: a layer whose output shape follows its input's values (a data-dependent
    selection) sends a size the next stage does not receive into; refused with the rule, before the send."""

    from lightning_pipe.layers.stages import LayerContractError
    from lightning_pipe.runtime.stage import PipelineStage

    def stage(expected: list[tuple[int, ...] | None] | None) -> Any:
        return SimpleNamespace(stage_index=0, expected_sends=lambda st, mb: expected)

    ops = [SimpleNamespace(tensor=torch.zeros(8, 8)), SimpleNamespace(tensor=torch.zeros(8, 2))]
    check = PipelineStage._check_send_shapes
    check(stage([(8, 8), (8, 2)]), ops, [0, 1], 0)  # type: ignore[arg-type]
    check(stage(None), ops, [0, 1], 0)  # type: ignore[arg-type]  # nothing known: nothing checked
    check(stage([(8, 8), None]), ops, [0, 1], 0)  # type: ignore[arg-type]  # a non-tensor output slot
    with pytest.raises(LayerContractError, match=r"micro-batch 3: output 1 has shape \(8, 2\), but the next stage "
                                                 r"receives it into \(8, 16\).*not from their values"):
        check(stage([(8, 8), (8, 16)]), ops, [0, 1], 3)  # type: ignore[arg-type]
