"""Compiled layers without a process group: the setting, the refusals, and what a stage module calls
([Note: compiled layers] in lightning_pipe/layers/compile.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_pipe.config import PipelineConfig, PipelineConfigError
from lightning_pipe.layers.compile import compiled_by_user
from lightning_pipe.layers.stages import StageModule
from lightning_pipe.lightning.preflight import check_compiled_plan, resolve_settings
from lightning_pipe.schedules import plan_schedule

EAGER = {"backend": "eager"}  # Dynamo without inductor: the wiring, in a fraction of the time


@pytest.mark.parametrize("value,want", [(False, None), (None, None), ("false", None), (True, {}), ("true", {}),
                                        ({"mode": "max-autotune"}, {"mode": "max-autotune"}),
                                        ({"options": {"x": 1}, "dynamic": None}, {"options": {"x": 1}, "dynamic": None})])
def test_compile_setting(value: object, want: object) -> None:
    assert PipelineConfig(compile=value).compile_options == want


@pytest.mark.parametrize("value,seen", [(3, "compile=3"), ({"fullgrph": True}, "unknown: ['fullgrph']"),
                                        ({"fullgraph": "yes"}, "fullgraph='yes'"), ({"mode": 3}, "mode=3"),
                                        ({"mode": "max-autotune", "options": {"x": 1}}, "not both")])
def test_bad_compile_setting_names_the_key(value: object, seen: str) -> None:
    with pytest.raises(PipelineConfigError, match="strategy.compile") as err:
        PipelineConfig(compile=value)
    assert seen in str(err.value)


@pytest.mark.parametrize("other", [{"fsdp_size": 2}, {"tensor_parallel_size": 2}, {"rebalance_every_n_steps": 5},
                                   {"rebalance_every_n_steps": 1},
                                   {"expert_parallel_size": 2, "data_parallel_size": 2}])
def test_compile_refuses_what_it_does_not_compose_with(other: dict[str, int]) -> None:
    (key, value), *_ = other.items()
    with pytest.raises(PipelineConfigError, match=f"compile=True with {key}={value}.*strategy.compile"):
        PipelineConfig(compile=True, **other)


def test_an_unknown_compile_mode_is_refused_at_setup_naming_the_modes() -> None:
    config = PipelineConfig(compile={"mode": "fastest"})
    with pytest.raises(PipelineConfigError, match=r"one of torch.compile's: default.*max-autotune.*mode': 'fastest'.*"
                                                  r"strategy.compile"):
        check_compiled_plan(config, plan_schedule(config, 2))
    eager = PipelineConfig(compile={"mode": "fastest", "backend": "eager"})  # not inductor's to check
    check_compiled_plan(eager, plan_schedule(eager, 2))


def test_compile_refuses_schedule_auto() -> None:
    with pytest.raises(PipelineConfigError, match="schedule='auto'.*strategy.compile"):
        resolve_settings("auto", None, 1, "uniform", None, "layers", "none", None, None, None, compile=True)


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv", "dualpipev", "v_half", "v_min"])
def test_split_backward_schedules_refuse_compile(schedule: str) -> None:
    config = PipelineConfig(schedule=schedule, compile=True, microbatches=4)
    with pytest.raises(PipelineConfigError, match=f"schedule='{schedule}'.*strategy.compile.*schedule=<name>"):
        check_compiled_plan(config, plan_schedule(config, 2))


@pytest.mark.parametrize("schedule,cls", [("pipedream", "StashingPipelineStage"), ("pipemare", "PipeMareStage"),
                                          ("chimera", "ChimeraEngine")])
def test_schedules_with_their_own_stage_or_engine_refuse_compile(schedule: str, cls: str) -> None:
    config = PipelineConfig(schedule=schedule, compile=True, microbatches=4)
    with pytest.raises(PipelineConfigError, match=f"schedule='{schedule}' \\({cls}\\).*strategy.compile"):
        check_compiled_plan(config, plan_schedule(config, 2))


def test_custom_lists_with_weight_actions_refuse_compile() -> None:
    split = [["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"]]
    config = PipelineConfig(schedule="custom", compile=True, schedule_options={"actions": split})
    with pytest.raises(PipelineConfigError, match="whose actions include .*W"):
        check_compiled_plan(config, plan_schedule(config, 2))
    full = [["0F0", "0B0"], ["1F0", "1B0"]]
    config = PipelineConfig(schedule="custom", compile=True, schedule_options={"actions": full})
    check_compiled_plan(config, plan_schedule(config, 2))  # F/B only: runs
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
        config = PipelineConfig(schedule=schedule, compile=True)
        check_compiled_plan(config, plan_schedule(config, 2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def test_stage_compiles_each_layer_keeping_names_and_values() -> None:
    torch.manual_seed(0)
    layers = [Block(), nn.Linear(4, 4), Block()]
    mine = torch.compile(layers[2], **EAGER)  # compiled by the user: kept as it is
    eager = StageModule(copy.deepcopy(layers[:2]), range(0, 2))
    stage = StageModule([layers[0], layers[1], mine], range(0, 3), compile_options=EAGER)
    assert [n for n, _ in stage.named_parameters()] == [
        "layers.0.fc.weight", "layers.0.fc.bias", "layers.1.weight", "layers.1.bias",
        "layers.2._orig_mod.fc.weight", "layers.2._orig_mod.fc.bias"]  # only the user's own wrapper renames
    x = torch.randn(2, 4)
    out = stage(x)
    calls = stage.compiled.calls(list(stage.layers))
    assert all(compiled_by_user(c) for c in calls) and calls[2] is mine  # wrapped once, the user's not again
    wrapped = [m for m in stage.modules() if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)]
    assert wrapped == [mine], "our wrappers stay outside the module tree"
    torch.testing.assert_close(out, layers[2](eager(x)))
    # derived state: a pickled or copied stage compiles its own on first use, with the same options
    for copied in (pickle.loads(pickle.dumps(StageModule(layers[:2], range(2), compile_options=EAGER))),
                   copy.deepcopy(stage)):
        assert copied.compiled._calls is None and copied.compiled.options == EAGER
        copied(x)
        assert copied.compiled._calls is not None


def test_in_place_compiled_layer_counts_as_compiled() -> None:
    layer = Block()
    assert not compiled_by_user(layer)
    layer.compile(**EAGER)
    assert compiled_by_user(layer)
    assert StageModule([layer], range(1), compile_options=EAGER).compiled.calls([layer])[0] is layer
