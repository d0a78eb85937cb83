"""The private torch / Lightning APIs lightning_pipe relies on (all reached through lightning_pipe._compat) still
exist and still behave as we use them. When one moves, this fails here, naming it, instead of a run failing later."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import lightning
import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pipe._compat import lightning as _lightning_compat
from lightning_pipe._compat import torch as _compat


def test_installed_versions_are_the_checked_ones() -> None:
    if not _compat.versions_checked():
        pytest.fail(f"torch {torch.__version__} is not a version lightning_pipe._compat.torch was checked on "
                    f"({_compat.CHECKED_TORCH}): re-run this file's checks and update CHECKED_TORCH.")
    if not _lightning_compat.versions_checked():
        pytest.fail(f"lightning {lightning.__version__} is not a version lightning_pipe._compat.lightning was "
                    f"checked on ({_lightning_compat.CHECKED_LIGHTNING}): re-run this file and update it.")


@pytest.mark.parametrize("name", sorted(_compat.PRIVATE_TORCH_API))
def test_private_api_exists(name: str) -> None:
    assert _compat.PRIVATE_TORCH_API[name] is not None, (
        f"torch {torch.__version__}: torch.distributed.pipelining.schedules.{name} is gone; update _compat")


def test_private_signatures_are_the_ones_we_call() -> None:
    assert list(inspect.signature(torch_schedules._validate_schedule).parameters) == [
        "actions", "pp_group_size", "num_stages", "num_microbatches"]
    assert list(inspect.signature(torch_schedules._add_send_recv).parameters) == [
        "compute_actions", "stage_to_rank", "num_stages"]
    runtime = torch_schedules._PipelineScheduleRuntime
    assert callable(getattr(runtime, "_prepare_schedule_with_comms", None))
    assert "scale_grads" in inspect.signature(torch_schedules.PipelineScheduleMulti.__init__).parameters


def test_action_strings_round_trip() -> None:
    for text in ("0F0", "3B12", "2I1", "2W1", "(0F3;3B1)OVERLAP_F_B"):
        action = _compat.parse_action(text)
        assert str(action) == text
    a = _compat.parse_action("1I2")
    assert (a.stage_index, a.computation_type.value, a.microbatch_index) == (1, "I", 2)
    assert _compat.is_compute(a) and not _compat.is_compute(_compat.parse_action("1SEND_F2"))
    assert {t.value for t in _compat.ComputationType} >= {"F", "B", "I", "W", "OVERLAP_F_B", "SEND_F", "RECV_F",
                                                         "SEND_B", "RECV_B"}


def _fake_stages(ids: list[int], num_stages: int, p: int = 2) -> list[SimpleNamespace]:
    return [SimpleNamespace(stage_index=s, num_stages=num_stages, group_size=p, group_rank=0, is_first=s == 0,
                            is_last=s == num_stages - 1, submod=None) for s in ids]


@pytest.mark.parametrize("cls,multi,stages", [
    (torch_schedules.ScheduleGPipe, False, [[0], [1]]),
    (torch_schedules.ScheduleInterleaved1F1B, True, [[0, 2], [1, 3]]),
    (torch_schedules.ScheduleLoopedBFS, True, [[0, 2], [1, 3]]),
    (torch_schedules.ScheduleInterleavedZeroBubble, True, [[0, 2], [1, 3]]),
    (torch_schedules.ScheduleZBVZeroBubble, True, [[0, 3], [1, 2]]),
    (torch_schedules.ScheduleDualPipeV, True, [[0, 3], [1, 2]]),
])
def test_torch_computes_orders_without_a_process_group(cls: type, multi: bool, stages: list[list[int]]) -> None:
    n = sum(len(s) for s in stages)
    order = _compat.torch_pipeline_order(cls, multi, 2, n, stages, 4)
    assert sorted(order) == [0, 1]
    forwards = [a for acts in order.values() for a in acts if a is not None and a.computation_type.value == "F"]
    assert len(forwards) + sum(len(a.sub_actions) // 2 for acts in order.values() for a in acts
                               if a is not None and a.sub_actions) == n * 4


def test_action_list_schedule_lowers_to_sends_and_receives_and_forward_only_filter() -> None:
    acts = {0: [_compat.parse_action(a) for a in ["0F0", "0F1", "0B0", "0B1"]],
            1: [_compat.parse_action(a) for a in ["1F0", "1B0", "1F1", "1B1"]]}
    stages = _fake_stages([0], 2)
    schedule = _compat.action_list_schedule(stages, 2, lambda o, t: o, acts)
    assert isinstance(schedule, torch_schedules._PipelineScheduleRuntime)
    assert schedule.scale_grads is False
    lowered = schedule.pipeline_order_with_comms
    kinds0 = [a.computation_type.value for a in lowered[0]]
    assert "SEND_F" in kinds0 and "RECV_B" in kinds0 and "REDUCE_GRAD" in kinds0
    for flag in ("_stages_forward_initialized", "_stages_backward_initialized"):
        assert hasattr(schedule, flag)
    with _compat.forward_only_actions(schedule):
        fwd = schedule.pipeline_order_with_comms
        # (UNSHARD / RESHARD: FSDP stages gather their weights for the forwards too)
        assert {a.computation_type.value for r in fwd for a in fwd[r]} <= {"F", "SEND_F", "WAIT_SEND_F", "RECV_F",
                                                                          "UNSHARD", "RESHARD"}
        assert [str(a) for a in fwd[1] if a.computation_type.value == "F"] == ["1F0", "1F1"]
    assert schedule.pipeline_order_with_comms is lowered  # restored
    _compat.reset_schedule_shapes(schedule)
    assert schedule._stages_forward_initialized is False


def test_forward_only_keeps_forward_halves_of_overlapped_actions() -> None:
    overlap = _compat.parse_action("(2F2;1B0)OVERLAP_F_B")
    kept = _compat._forward_part([overlap, None, _compat.parse_action("1W0"), _compat.parse_action("2RECV_F3")])
    assert [str(a) for a in kept] == ["2F2", "2RECV_F3"]


def test_torch_refuses_what_our_validator_refuses() -> None:
    bad = {0: [_compat.parse_action(a) for a in ["0F0", "0F1", "0B0"]],
           1: [_compat.parse_action(a) for a in ["1F0", "1B0", "1F1", "1B1"]]}
    with pytest.raises(AssertionError, match="expected 2 total backwards"):
        _compat.torch_check_actions(bad, 2, 2, 2)


@pytest.mark.parametrize("cls,method", _lightning_compat.PRIVATE_LIGHTNING_METHODS,
                         ids=[f"{c.__name__}.{m}" for c, m in _lightning_compat.PRIVATE_LIGHTNING_METHODS])
def test_private_lightning_methods_we_override_or_call_exist(cls: type, method: str) -> None:
    assert callable(getattr(cls, method, None)), (
        f"lightning {lightning.__version__}: {cls.__name__}.{method} is gone; lightning_pipe relies on it")


def test_missing_lightning_internal_fails_at_import_naming_it() -> None:
    with pytest.raises(ImportError, match=r"lightning\.fabric\.strategies\._NoSuchThing.*_compat/lightning\.py"):
        _lightning_compat._resolve("lightning.fabric.strategies", "_NoSuchThing")


def test_missing_torch_internal_fails_at_import_naming_it() -> None:
    with pytest.raises(ImportError, match=r"torch\.distributed\.pipelining\.schedules\._NoSuchThing.*2\.11.*2\.15"):
        _compat._resolve(torch_schedules, "_NoSuchThing", "torch.distributed.pipelining.schedules")


def test_optimizer_unwrap_reaches_the_torch_optimizer() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert _lightning_compat.unwrap_optimizer(LightningOptimizer(sgd)) is sgd
    assert _lightning_compat.unwrap_optimizer(sgd) is sgd


def test_dcp_private_loader_exists() -> None:
    from torch.distributed.checkpoint import default_planner, state_dict_loader

    assert hasattr(default_planner, "_EmptyStateDictLoadPlanner"), "used by _compat.dcp_load_everything"
    assert "no_dist" in inspect.signature(state_dict_loader._load_state_dict).parameters


# ----------------------------------------------------------------------------- per-release paths ([Note: torch versions])
def test_release_parsing_and_tier() -> None:
    assert _compat._release("2.11.0+cu130") == (2, 11) and _compat._release("2.15.0") == (2, 15)
    assert _compat.TORCH_VERSION == _compat._release(torch.__version__)
    # the metadata-inference generation is a fact of the release, not a guess from its number
    assert _compat.METADATA_INFERENCE == hasattr(torch.distributed.pipelining.PipelineStage,
                                                 "_forward_metadata_inference")
    assert _compat.METADATA_INFERENCE == (_compat.TORCH_VERSION >= (2, 12))
    for gap in _compat.TORCH_GAPS.values():
        assert gap.applies() == (_compat.TORCH_VERSION < gap.fixed_in)


def test_forward_only_lists_keep_every_send_with_its_wait() -> None:
    """torch 2.15 pairs each SEND_F with a WAIT_SEND_F and refuses a step that leaves one unwaited; the forward-only
    filter keeps both (before 2.15 there is no wait action, and nothing changes)."""
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.schedules import compute_order, plan_schedule

    for name, v in (("interleaved_1f1b", 2), ("zbv", 2), ("dualpipev", 2), ("looped_bfs", 2), ("zb_h1", 2)):
        plan = plan_schedule(PipelineConfig(schedule=name, stages_per_rank=v, microbatches=4), 2)
        order = compute_order(plan)
        stages = [[s for s in plan.stages_of_rank(r)] for r in range(2)]
        schedule = _compat.action_list_schedule(_fake_stages(stages[0], plan.num_stages), 4, lambda o, t: o, order)
        with _compat.forward_only_actions(schedule):
            for rank, actions in schedule.pipeline_order_with_comms.items():
                kinds = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions]
                sends = [(s, m) for k, s, m in kinds if k == "SEND_F"]
                waits = [(s, m) for k, s, m in kinds if k == "WAIT_SEND_F"]
                has_waits = any(t.value == "WAIT_SEND_F" for t in _compat.ComputationType)
                assert sorted(waits) == (sorted(sends) if has_waits else []), (name, rank, kinds)
                for s, m in waits:  # each wait after its send
                    assert kinds.index(("SEND_F", s, m)) < kinds.index(("WAIT_SEND_F", s, m))


def test_split_backward_is_refused_exactly_where_torch_gets_it_wrong() -> None:
    """On 2.11 / 2.12 torch's split backward double-counts a weight used twice in a stage: refused in the strategy's
    constructor (by name) and once the plan is resolved (by its actions: custom lists, extensions); planning and
    simulating the same schedules as data work on every torch."""
    from lightning_pipe import PipelineStrategy
    from lightning_pipe.config import PipelineConfig, PipelineConfigError
    from lightning_pipe.schedules import check_torch_runs, plan_schedule

    wrong = _compat.TORCH_VERSION < (2, 13)
    assert (_compat.torch_gap("split_backward") is not None) == wrong
    zbv = plan_schedule(PipelineConfig(schedule="zbv", stages_per_rank=2, microbatches=4), 2)  # data: always fine
    custom = plan_schedule(PipelineConfig(schedule="custom", schedule_options={"actions": [
        ["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"]]}), 2)
    plain = plan_schedule(PipelineConfig(schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4), 2)
    check_torch_runs(plain)
    for plan in (zbv, custom):
        if wrong:
            with pytest.raises(PipelineConfigError, match=r"needs torch >= 2\.13.*wrong weight gradients.*Installed"):
                check_torch_runs(plan)
        else:
            check_torch_runs(plan)
    for name in ("zb_h1", "zbv", "dualpipev"):
        if wrong:
            with pytest.raises(PipelineConfigError, match=rf"needs torch >= 2\.13.*schedule='{name}'.*`schedule`"):
                PipelineStrategy(schedule=name)
        else:
            PipelineStrategy(schedule=name)
    PipelineStrategy(schedule="interleaved_1f1b")


def test_fused_projection_split_is_refused_where_torch_raises() -> None:
    if _compat.TORCH_VERSION < (2, 12):
        with pytest.raises(NotImplementedError, match=r"FusedColwiseParallel.*needs torch >= 2\.12.*separate"):
            _compat.strided_shard(0, 3)
    else:
        assert _compat.is_strided_shard(_compat.strided_shard(0, 3))


def test_private_names_per_release() -> None:
    """What this torch makes us touch (docs/versions.md lists the count per release)."""
    names = set(_compat.PRIVATE_TORCH_API) | set(_compat.TRACE_TORCH_API) | set(_compat.PRIVATE_TORCH_STATE)
    # the forward half of the inference guard: 2.11's _shape_inference, 2.12-2.14's override, 2.15's public hook
    assert ("PipelineStage._shape_inference" in names) == (not _compat.METADATA_INFERENCE)
    assert ("PipelineStage._forward_metadata_inference" in names) == (
        _compat.METADATA_INFERENCE and not _compat.FORWARD_CONTEXT)
    assert _compat.FORWARD_CONTEXT == (_compat.TORCH_VERSION >= (2, 15))
    assert ("PipelineStage.bwd_cache" in names) == (_compat.TORCH_VERSION < (2, 13))
    assert ("PipelineStage.inputs_meta" in names) == (not _compat.METADATA_INFERENCE)


def _split_backward_error(block: torch.nn.Module, x: torch.Tensor) -> float:
    """Max relative error of torch's split backward (input, then weight) against plain autograd on ``block``."""
    want_x = x.clone().requires_grad_(True)
    block(want_x).sum().backward()
    want = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    got_x = x.clone().requires_grad_(True)
    out = block(got_x)
    _, groups = _compat.stage_backward_input([out], [torch.ones_like(out)], [got_x], iter(block.parameters()))
    _compat.stage_backward_weight(iter(block.parameters()), groups)
    return max(float((p.grad - w).abs().max() / w.abs().max()) for p, w in zip(block.parameters(), want))


def test_split_backward_gap_is_real_and_closed_from_2_13() -> None:
    """The refusal's reason, measured on the installed torch: a weight used twice inside one stage
    (``lin(tanh(lin(x)))``) gets a wrong gradient from torch's split backward before 2.13, the right one after."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    block = torch.nn.Sequential(lin, torch.nn.Tanh(), lin)
    error = _split_backward_error(block, torch.randn(4, 6))
    if _compat.torch_gap("split_backward") is not None:
        assert error > 0.05, error  # what the gap says: wrong numbers, not rounding
    else:
        assert error < 1e-5, error


def test_a_training_step_asks_for_no_outputs_where_the_schedule_takes_the_argument() -> None:
    # [Note: no outputs kept by a training step]: torch's own schedules take return_outputs in every checked release
    for cls in (torch_schedules.Schedule1F1B, torch_schedules.ScheduleGPipe, torch_schedules.ScheduleInterleaved1F1B,
                torch_schedules.ScheduleZBVZeroBubble, torch_schedules._PipelineScheduleRuntime):
        assert _compat.train_step_kwargs(object.__new__(cls)) == {"return_outputs": False}, cls

    class Other:  # another runtime's step: called without return_outputs
        def step(self, *args: object, target: object = None, **kwargs: object) -> None: ...

    assert _compat.train_step_kwargs(Other()) == {}


def _split_backward_of_saved_output(alias: bool) -> torch.Tensor:
    """fc's weight gradient from torch's split backward of a stage returning ``(fc(f), f)``: ``f`` is an output and
    what fc saved for its weight gradient."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(6, 6)
    x = torch.randn(4, 6).requires_grad_(True)
    f = x * 2
    outputs = [fc(f), f]
    if alias:
        outputs = [_compat.detachable_alias(t) for t in outputs]
    _, groups = _compat.stage_backward_input(outputs, [torch.ones_like(t) for t in outputs], [x],
                                             iter(fc.parameters()))
    _compat.stage_backward_weight(iter(fc.parameters()), groups)
    assert fc.weight.grad is not None
    return fc.weight.grad


def test_a_split_backward_keeps_what_the_stage_saved_when_its_outputs_are_aliases() -> None:
    """[Note: split backward detaches stage outputs]: torch's input half detaches the outputs in place, so the
    weight half fails on a saved output; handed aliases, it gets the plain autograd gradient (no copy made)."""
    with pytest.raises(RuntimeError, match="detached in-place"):
        _split_backward_of_saved_output(alias=False)
    got = _split_backward_of_saved_output(alias=True)
    torch.manual_seed(0)
    fc = torch.nn.Linear(6, 6)
    f = torch.randn(4, 6) * 2
    fc(f).sum().backward()
    torch.testing.assert_close(got, fc.weight.grad, rtol=0, atol=0)
    t = torch.randn(3, 4, requires_grad=True) * 1
    alias = _compat.detachable_alias(t)
    assert alias._base is None and alias.data_ptr() == t.data_ptr() and alias.grad_fn is not None


def test_split_backward_is_read_from_the_schedules_actions() -> None:
    def order(*texts: str) -> SimpleNamespace:
        return SimpleNamespace(pipeline_order={0: [_compat.parse_action(t) for t in texts], 1: [None]})

    assert _compat.runs_split_backward(order("0F0", "0I0", "0W0"))
    assert _compat.runs_split_backward(order("0F0", "(0F1;1I0)OVERLAP_F_B"))
    assert not _compat.runs_split_backward(order("0F0", "0B0"))
    assert not _compat.runs_split_backward(SimpleNamespace())  # a single-stage schedule: no action lists
