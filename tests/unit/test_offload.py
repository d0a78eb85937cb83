"""Activation offload ([Note: activation offload]) without a process group: the setting, the hooks' exactness (real
host copies forced on the CPU), with recomputation and under torch's split backward, what stays on the device
(ActivationMeter) against what moved (OffloadStats), and the planner's memory model."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

import lightning_pipe.layers.stages as stages_module
from lightning_pipe._compat import torch as _compat
from lightning_pipe.config import LayerChoice, PipelineConfig, PipelineConfigError
from lightning_pipe.layers.offload import HostOffload, OffloadStats
from lightning_pipe.layers.stages import StageModule, localize_layers
from lightning_pipe.planner import LayerCost, ModelProfile, search
from lightning_pipe.planner.__main__ import main as cli
from lightning_pipe.planner.model import ActivationPolicy, CostModel, predict
from lightning_pipe.schedules import compute_order, plan_schedule
from lightning_pipe.schedules.simulate import compile_order
from lightning_pipe.trace.memory import ActivationMeter


@pytest.mark.parametrize("value,want,choice", [
    ("none", "none", LayerChoice()), (None, "none", LayerChoice()), (False, "none", LayerChoice()),
    ([], "none", LayerChoice()), (True, "all", LayerChoice(every=1)), ("ALL", "all", LayerChoice(every=1)),
    (2, 2, LayerChoice(every=2)), ("3", 3, LayerChoice(every=3)),
    ([5, 1, 1], (1, 5), LayerChoice(indices=frozenset({1, 5}))),
])
def test_offload_setting(value, want, choice) -> None:
    config = PipelineConfig(offload=value)
    assert config.offload == want and config.offload_layers == choice


@pytest.mark.parametrize("value", ["sometimes", 0, -1, [1, -2], [1.5], 2.0])
def test_bad_offload_is_refused_with_the_rule_and_the_key(value) -> None:
    with pytest.raises(PipelineConfigError, match=r"offload is 'none', 'all'.*Got offload=.*strategy\.offload"):
        PipelineConfig(offload=value)


def test_layer_choice_picks_by_position_in_stage_or_index() -> None:
    every2, listed = LayerChoice(every=2), LayerChoice(indices=frozenset({3}))
    assert [every2.picks(j, 10 + j) for j in range(4)] == [True, False, True, False]
    assert [listed.picks(0, i) for i in range(5)] == [False, False, False, True, False]
    assert not LayerChoice() and every2 and listed


def test_an_index_past_the_layer_list_is_refused_before_anything_is_cut() -> None:
    model = nn.Module()
    model.layers = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
    with pytest.raises(PipelineConfigError, match=r"offload=\[1, 4\] with 4 layers.*strategy\.offload"):
        localize_layers(model, "layers", [range(0, 2), range(2, 4)], [0], lambda s: s,
                        offload=PipelineConfig(offload=[1, 4]).offload_layers)
    assert all(isinstance(layer, nn.Linear) for layer in model.layers)  # nothing was replaced


class Block(nn.Module):
    """A block whose backward needs its input, an intermediate used twice (q, k, v from one norm), a buffer, a
    frozen weight and its own output (tanh saves its result)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.frozen = nn.Parameter(torch.randn(width), requires_grad=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        attn = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), dim=-1) @ self.v(h)
        return x + torch.tanh(attn * self.scale * self.frozen)


def _layers(n: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block() for _ in range(n)]


def _grads(stage: StageModule, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    stage(x).pow(2).sum().backward()
    out = [p.grad.clone() for p in stage.parameters() if p.grad is not None] + [x.grad.clone()]
    stage.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("recompute,offload", [(None, "all"), (None, [1, 2]), (2, [1, 2]), (1, "all"), (2, 2)])
def test_offloaded_layers_train_exactly_with_real_host_copies(monkeypatch, recompute, offload) -> None:
    """copy=True: what backward reads is only pack's copy, never the forward's tensor; bit-identical gradients."""
    monkeypatch.setattr(stages_module, "HostOffload", functools.partial(HostOffload, copy=True))
    layers, x = _layers(), torch.randn(2, 5, 8)
    want = _grads(StageModule(layers, range(4)), x)
    stage = StageModule(layers, range(4), recompute, PipelineConfig(offload=offload).offload_layers)
    got = _grads(stage, x)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert stage.offload_stats.tensors > 0 and stage.offload_stats.live_bytes == 0  # all released after backward


def test_pack_moves_activations_only_once_each() -> None:
    """Parameters (and views of them), the buffer, the frozen weight and the trainable input stay; the normalised
    input, saved by q, k and v, is copied once."""
    block, stats = _layers(1)[0], OffloadStats()
    x = torch.randn(2, 5, 8, requires_grad=True)
    seen: list[torch.Tensor] = []

    def spy(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(spy, lambda t: t):
        block(x)
    own = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), x)}
    unique = {(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()) for t in seen
              if t.untyped_storage().data_ptr() not in own}
    with HostOffload(block, stats, copy=True):
        out = block(x)
    assert stats.tensors == len(unique) < len(seen)
    out.sum().backward()
    assert stats.live_bytes == 0 and stats.peak_bytes == stats.bytes > 0


def test_split_backward_reads_offloaded_tensors_until_the_weight_step(monkeypatch) -> None:
    """torch's I then W (zero-bubble schedules): the host copies survive the input step and serve the weight step."""
    monkeypatch.setattr(stages_module, "HostOffload", functools.partial(HostOffload, copy=True))
    layers, x = _layers(2), torch.randn(2, 5, 8)
    want = _grads(StageModule(layers, range(2)), x)
    stage = StageModule(layers, range(2), 2, LayerChoice(every=1))  # layer 0 also recomputed
    inp = x.clone().requires_grad_(True)
    out = stage(inp)
    live = stage.offload_stats.live_bytes
    params = list(stage.parameters())
    (grad_x,), groups = _compat.stage_backward_input([out], [2 * out.detach()], [inp], iter(params))
    assert stage.offload_stats.live_bytes > 0 and live > 0  # the weight step still needs them
    _compat.stage_backward_weight(iter(params), groups)
    got = [p.grad for p in params if p.grad is not None] + [grad_x]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_meter_sees_only_what_stays_on_the_device() -> None:
    """On a CPU device nothing moves, but the accounting holds: what autograd keeps outside offloaded layers
    (ActivationMeter) plus what offload took (OffloadStats) is what autograd keeps without offload."""
    layers, x = _layers(), torch.randn(2, 5, 8)
    peaks = {}
    for offload in ("none", [0, 2], "all"):
        stage = StageModule(layers, range(4), offload=PipelineConfig(offload=offload).offload_layers)
        meter = ActivationMeter([*stage.parameters(), *stage.buffers()])  # the buffer is no activation either
        with meter.measure():
            stage(x).sum().backward()
        peaks[str(offload)] = (meter.peak_bytes, stage.offload_stats.peak_bytes)
    full = peaks["none"][0]
    assert peaks["none"][1] == 0 and peaks["all"] == (0, full)
    device, host = peaks["[0, 2]"]
    assert device + host == full and 0 < device < full


def _profile(n: int = 6) -> ModelProfile:
    return ModelProfile({2: [LayerCost(forward=1e-3, backward=2e-3, input_grad=1e-3, weight_grad=1e-3,
                                       saved_bytes=1000 * (i + 1), output_bytes=100, param_bytes=10)
                             for i in range(n)]})


def test_cost_model_counts_no_device_activations_for_offloaded_layers() -> None:
    profile, bounds = _profile(), [(0, 3), (3, 6)]

    def held(**settings) -> list[float]:
        return CostModel(profile, 2, [1.0, 1.0], activations=ActivationPolicy.of(PipelineConfig(**settings))).held(
            bounds)

    assert held() == [1000 + 2000 + 3000 + 100, 4000 + 5000 + 6000 + 100]
    assert held(offload="all") == [100, 100]  # the stage's output (sent on) stays
    assert held(offload=[1, 4]) == [1000 + 3000 + 100, 4000 + 6000 + 100]
    # recomputed: a layer keeps its input (the previous layer's output); a stage's first layer nothing more
    assert held(recompute="all") == [0 + 100 + 100 + 100, 0 + 100 + 100 + 100]
    assert held(recompute="all", offload=2) == [0 + 100 + 0 + 100, 0 + 100 + 0 + 100]


def test_predicted_peak_and_time_follow_recompute_and_offload() -> None:
    pl = plan_schedule(PipelineConfig(schedule="1f1b", microbatches=4), 2)
    compiled = compile_order(compute_order(pl), pl.num_stages)

    def run(**settings):
        model = CostModel(_profile(), 2, [1.0, 1.0], activations=ActivationPolicy.of(PipelineConfig(**settings)))
        return predict(model, compiled, (3, 3), 1)

    base, offloaded, recomputed = run(), run(offload="all"), run(recompute="all")
    assert all(o < b for o, b in zip(offloaded.peak_memory, base.peak_memory))
    assert all(r < b for r, b in zip(recomputed.peak_memory, base.peak_memory))
    assert offloaded.step_time == pytest.approx(base.step_time)  # host copies are not modelled
    assert recomputed.step_time > base.step_time  # a second forward in every backward


def test_backward_reads_the_host_copy_not_the_forward_tensor() -> None:
    """Change tanh's output (which its backward reuses) after the forward: with offload, backward still sees pack's
    copy and the gradient is right; without, it reads the changed tensor (the control)."""
    x = torch.randn(6, requires_grad=True)
    want = 1 - torch.tanh(x.detach()) ** 2
    for offload in (False, True):
        x.grad = None
        hooks = HostOffload(nn.Module(), copy=True) if offload else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)  # the same hooks path, keeping the tensor itself
        with hooks:
            y = torch.tanh(x)
        y.data.zero_()  # behind autograd's back
        y.backward(torch.ones(6))
        assert torch.allclose(x.grad, want, atol=1e-6, rtol=0) == offload


def test_a_budget_only_offload_fits_is_met_by_search_and_the_cli(tmp_path) -> None:
    profile = _profile()
    kept = search(profile, 2, 8, schedules=["1f1b"])
    offloaded = search(profile, 2, 8, schedules=["1f1b"], activations=ActivationPolicy.of(PipelineConfig(offload="all")))
    budget = max(offloaded.best[1].peak_memory) + 1
    assert budget < min(max(p.peak_memory) for _, p in kept.ranked)
    with pytest.raises(PipelineConfigError, match=r"memory budget.*strategy\.offload"):
        search(profile, 2, 8, budget, schedules=["1f1b"])
    path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    path.write_text(json.dumps(profile.to_json()))
    args = ["search", str(path), "--world", "2", "--batch-size", "8", "--schedules", "1f1b", "--memory-budget",
            str(budget), "-o", str(out)]
    assert cli([*args, "--offload", "[0,1,2,3,4,5]"]) == 0
    assert max(json.loads(out.read_text())["predicted_peak_memory_bytes"]) < budget
    assert cli(args) == 2  # without offload nothing fits


def test_a_forward_dropped_without_backward_frees_everything() -> None:
    """Shape inference runs forwards it never backpropagates: what pack kept must go with the graph (keeping a saved
    output itself would make a cycle through its grad_fn that no garbage collector sees)."""
    stage = StageModule(_layers(2), range(2), offload=LayerChoice(every=1))
    out = stage(torch.randn(2, 5, 8, requires_grad=True))
    assert stage.offload_stats.live_bytes > 0
    del out
    assert stage.offload_stats.live_bytes == 0
