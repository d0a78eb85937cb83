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


def test_a_token_weighted_loss_without_loss_count_is_refused_naming_the_rule() -> None:
    from lightning_pipe.runtime.aux_step import AuxLossStep

    step = AuxLossStep(None, 1, "MyLM")
    context = step.begin(lambda: step.grad_scale(per_microbatch=False, loss_scale=0.25, loss_scaler=None,
                                                 count=lambda: None, elements=8.0, dp_group=None, dp_degree=1,
                                                 device=torch.device("cpu")))
    lin, x = _parts()
    with aux_loss_context(context):
        attach_aux_loss(lin(x), lin.weight.sum(), name="a")
    assert context.grad_scale() == 0.25 and step.uncompensated
    with pytest.raises(TypeError, match=r"MyLM.loss_fn returns a token-weighted.*loss_count\(self, target\)"):
        step.end(4, torch.tensor(5.0), torch.device("cpu"))


def test_the_token_weighted_scale_divides_out_the_engines_factor_in_advance() -> None:
    from lightning_pipe.runtime.aux_step import AuxLossStep

    step = AuxLossStep(None, 1, "MyLM")
    scale = step.grad_scale(per_microbatch=False, loss_scale=0.25, loss_scaler=lambda t: t * 8.0,
                            count=lambda: torch.tensor(30), elements=40.0, dp_group=None, dp_degree=1,
                            device=torch.device("cpu"))
    # the engine multiplies fresh gradients by elements * dp / count = 40 / 30 afterwards
    assert scale * 40.0 / 30.0 == pytest.approx(0.25 * 8.0)
    assert step.end(4, torch.tensor(30.0), torch.device("cpu")).item() == 0.0  # no term recorded: nothing logged
    step.predicted_count = torch.tensor(29.0)
    step.anywhere = None
    with pytest.raises(ValueError, match="gave 29 counted items.*loss_fn counted 30"):
        step.end(4, torch.tensor(30.0), torch.device("cpu"))


def test_a_recomputed_layer_logs_its_term_once_and_its_gradient_is_exact() -> None:
    from lightning_pipe.layers.stages import run_layers

    class WithAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # tanh saves its output: the recomputation runs through the attach (torch stops it early otherwise)
            return torch.tanh(attach_aux_loss(self.fc(x), self.fc.weight.square().sum(), name="w2"))

    torch.manual_seed(0)
    layers = nn.Sequential(WithAux(), nn.Linear(3, 3))
    x = torch.randn(4, 3)
    grads = []
    for every in (None, 1):
        layers.zero_grad()
        with aux_loss_context(AuxLossContext(0.5)) as ctx:
            run_layers(layers, x, recompute_every=every).sum().backward()
        grads.append(layers[0].fc.weight.grad.clone())
        assert float(ctx.values["w2"]) == pytest.approx(float(layers[0].fc.weight.detach().square().sum()))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "pipemare"])
def test_asynchronous_schedules_refuse_aux_terms_naming_the_schedule(schedule: str) -> None:
    from lightning_pipe.config import PipelineConfigError
    from lightning_pipe.runtime.aux_step import AuxLossStep

    step = AuxLossStep(None, 1, "MyLM", schedule)
    context = step.begin(lambda: 1.0)
    lin, x = _parts()
    with aux_loss_context(context):
        attach_aux_loss(lin(x), lin.weight.sum(), name="a")
    with pytest.raises(PipelineConfigError, match=f"schedule='{schedule}'.*Hydra: schedule="):
        step.end(2, None, torch.device("cpu"))
    quiet = AuxLossStep(None, 1, "MyLM", schedule)  # no aux terms: nothing to refuse
    quiet.begin(lambda: 1.0)
    assert float(quiet.end(2, None, torch.device("cpu"))) == 0.0
