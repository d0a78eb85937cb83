"""attach_aux_loss without a process group: the injected gradient, the one-device collecting mode, the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.layers.aux import AuxLossContext, attach_aux_loss, aux_loss_context


def _parts() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(3, 3), torch.randn(4, 3)


def test_the_term_gets_the_context_scale_as_its_gradient() -> None:
    lin, x = _parts()
    ref = lin.weight.detach().clone().requires_grad_(True)
    with aux_loss_context(AuxLossContext(lambda: 0.25)) as ctx:
        h = attach_aux_loss(lin(x), lin.weight.square().sum(), name="w2", coef=2.0)
        h.sum().backward()
    main = torch.autograd.grad((x @ ref.T + lin.bias.detach()).sum(), ref)[0]
    torch.testing.assert_close(lin.weight.grad, main + 0.25 * 2.0 * 2 * ref.detach())
    assert float(ctx.values["w2"]) == pytest.approx(2.0 * float(ref.square().sum()))


def test_one_device_collects_graph_terms_and_no_context_is_the_identity() -> None:
    lin, x = _parts()
    aux = lin.weight.square().sum()
    with aux_loss_context(AuxLossContext()) as ctx:
        h = attach_aux_loss(lin(x), aux, name="w2")
    assert h is not None and len(ctx.terms) == 1 and ctx.terms[0] is aux
    out = lin(x)
    assert attach_aux_loss(out, aux) is out  # no context: dropped
    with aux_loss_context(AuxLossContext(1.0)), torch.no_grad():
        assert attach_aux_loss(out, aux) is out  # evaluation: dropped


def test_a_non_scalar_loss_is_refused_by_name() -> None:
    lin, x = _parts()
    with aux_loss_context(AuxLossContext(1.0)), pytest.raises(ValueError, match="router.*0-dim.*shape \\(3, 3\\)"):
        attach_aux_loss(lin(x), lin.weight.square(), name="router")


def test_shape_inference_does_not_record_values() -> None:
    lin, x = _parts()
    with aux_loss_context(AuxLossContext(1.0)) as ctx:
        ctx.recording = False
        attach_aux_loss(lin(x), lin.weight.sum(), name="a")
    assert ctx.values == {}
