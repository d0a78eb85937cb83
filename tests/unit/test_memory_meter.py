"""ActivationMeter counts what autograd saves, live: all-forwards-then-backwards holds more than 1F1B order."""

import torch
from torch import nn

from lightning_pipe.trace.memory import ActivationMeter


def _run(order: str, m: int = 4) -> int:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    meter = ActivationMeter(list(net.parameters()))
    xs = [torch.randn(16, 64) for _ in range(m)]
    with meter.measure():
        if order == "gpipe":
            losses = [net(x).sum() for x in xs]
            for loss in losses:
                loss.backward()
        else:
            for x in xs:
                net(x).sum().backward()
    assert meter.live_bytes == 0  # everything saved was released after backward
    return meter.peak_bytes


def test_meter_sees_gpipe_hold_all_microbatches():
    gpipe, one_at_a_time = _run("gpipe"), _run("1f1b")
    assert one_at_a_time > 0
    assert gpipe == 4 * one_at_a_time


def test_parameters_are_not_counted():
    lin = nn.Linear(8, 8, bias=False)
    meter = ActivationMeter(list(lin.parameters()))
    x = torch.randn(2, 8, requires_grad=True)  # autograd saves x (for dW) and the weight (for dx)
    with meter.measure():
        lin(x).sum().backward()
    assert meter.peak_bytes == x.numel() * x.element_size()


def test_split_backward_releases_everything_at_the_weight_pass():
    """torch's input pass keeps the graph (retain_graph=True) for the weight pass; a saved output (tanh's) held by the
    meter with its grad_fn was a cycle autograd never freed: 38 % of a GPT block's bytes stayed counted forever."""
    from lightning_pipe._compat.torch import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    meter = ActivationMeter(list(net.parameters()))
    x = torch.randn(16, 64, requires_grad=True)
    with meter.measure():
        out = net(x)
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], net.parameters())
        assert meter.live_bytes > 0  # W still needs what it saved
        stage_backward_weight(net.parameters(), groups)
    assert meter.live_bytes == 0
