"""Issue 24: planned shapes without a process group — the meta forward of a stage, the boundary message, the
structure that keys torch's state, the receive descriptors rewritten, and micro-batches of their own length."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe._compat import stage_shapes
from lightning_pipe.layers.batches import signature
from lightning_pipe.layers.stages import StageModule
from lightning_pipe.runtime.microbatches import explicit_microbatches, microbatch_loss
from lightning_pipe.runtime.shapes import PlanFailed, ShapePlanner, _decode, _encode, first_inputs, split_rows
from tests.models import CausalMix


class _Stage:
    """What the planner reads of a torch stage."""

    def __init__(self, module: nn.Module, index: int, num: int) -> None:
        self.submod, self.stage_index = module, index
        self.is_first, self.is_last = index == 0, index == num - 1


def _planner(*modules: nn.Module) -> ShapePlanner:
    stages = [_Stage(m, i, len(modules)) for i, m in enumerate(modules)]
    return ShapePlanner(stages, lambda s: 0, None, torch.device("cpu"), contextlib.nullcontext)


def test_a_plan_runs_each_stage_on_meta_tensors_once_per_shape() -> None:
    emb, mix, head = nn.Embedding(32, 16), CausalMix(16), nn.Linear(16, 32)
    before = [p.clone() for p in mix.parameters()]
    planner = _planner(nn.Sequential(emb, mix), head)
    mbs = [(((2, 7), torch.int64),), (((2, 5), torch.int64),), (((2, 7), torch.int64),)]
    plan = planner.plan("key", mbs)
    assert plan[0].outputs == ((((2, 7, 16), torch.float32),), (((2, 5, 16), torch.float32),),
                               (((2, 7, 16), torch.float32),))
    assert plan[1].inputs == plan[0].outputs and plan[1].outputs[1] == (((2, 5, 32), torch.float32),)
    assert planner.meta_forwards == 4  # two distinct shapes per stage
    assert planner.plan("key", mbs) is plan and planner.exchanges == 1  # cached: nothing runs again
    assert all(torch.equal(p, b) and p.device.type == "cpu" for p, b in zip(mix.parameters(), before))


def test_a_forward_that_reads_values_cannot_be_planned() -> None:
    class ReadsValues(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[: int(x.sum().item())]

    with pytest.raises(PlanFailed, match="meta tensors"):
        _planner(ReadsValues()).plan("key", [(((4, 3), torch.float32),)])


def test_a_failed_stage_fails_the_plan_of_the_next_one_on_the_same_rank() -> None:
    class ReadsValues(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x.sum().item()

    planner = _planner(ReadsValues(), nn.Linear(3, 3))  # both stages on this rank: nothing to receive
    with pytest.raises(PlanFailed, match="meta tensors"):
        planner.plan("key", [(((4, 3), torch.float32),)])
    assert planner.meta_forwards == 1


def test_boundary_messages_round_trip() -> None:
    tensors = (((2, 9, 16), torch.float32), ((2, 9), torch.int64), ((), torch.bool))
    assert _decode(_encode(tensors)) == tensors
    with pytest.raises(ValueError, match="too large"):
        _encode(tuple(((1,) * 8, torch.float32) for _ in range(8)))


def test_micro_batch_rows_follow_torch_tensor_split() -> None:
    assert split_rows(10, 4) == [len(c) for c in torch.tensor_split(torch.arange(10), 4)]
    x = torch.zeros(6, 5, dtype=torch.long)
    assert first_inputs((x,), 3) == [(((2, 5), torch.int64),)] * 3


def test_the_structure_ignores_lengths_only() -> None:
    a, b = torch.zeros(4, 7, dtype=torch.long), torch.zeros(4, 9, dtype=torch.long)
    assert signature("train", (a,), 2, a).structure() == signature("train", (b,), 1, b).structure()
    assert signature("train", (a,), 2, a).structure() != signature("eval", (a,), 2).structure()
    assert signature("train", (a,), 2).structure() != signature("train", (a.float(),), 2).structure()
    assert signature("train", (a,), 2).structure() != signature("train", (a[:, :, None],), 2).structure()


@pytest.mark.skipif(not stage_shapes.SUPPORTED, reason="torch 2.11 keeps shapes elsewhere (re-infers)")
def test_receive_descriptors_get_the_planned_shapes() -> None:
    meta = _tensor_meta((2, 5, 16))
    info = stage_shapes._RecvInfo("x", 0, tensor_meta=meta) if not stage_shapes._PERSISTENT_BUFFERS \
        else stage_shapes._RecvInfo("x", 0, torch.zeros(2, 5, 16).requires_grad_(True), tensor_meta=meta)
    stage_shapes.set_receive_shapes((info,), [(2, 9, 16)], torch.device("cpu"))
    assert tuple(info.tensor_meta.shape) == (2, 9, 16) and info.tensor_meta.stride == (144, 16, 1)
    assert info.tensor_meta.dtype == torch.float32 and info.tensor_meta.requires_grad
    if stage_shapes._PERSISTENT_BUFFERS:
        assert info.buffer.shape == (2, 9, 16) and info.buffer.requires_grad
    with pytest.raises(RuntimeError, match="2 planned"):
        stage_shapes.set_receive_shapes((info,), [(1,), (2,)], torch.device("cpu"))


def _tensor_meta(shape: tuple[int, ...]) -> object:  # torch's private class, built as torch builds it
    from torch.distributed.pipelining._utils import _TensorMeta as meta_class
    return meta_class.from_tensor(torch.zeros(shape).requires_grad_(True))


class _Trim:
    def trim_microbatch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = int((labels != -100).any(0).nonzero().max()) + 1
        return tokens[:, :length], labels[:, :length]


def test_trimmed_micro_batches_and_their_loss() -> None:
    tokens = torch.arange(24).reshape(4, 6)
    labels = torch.full((4, 6), -100)
    labels[0, :2], labels[1, :3], labels[2, :6], labels[3, :1] = 1, 1, 1, 1
    mbs = explicit_microbatches(_Trim(), tokens, (tokens,), labels, 2, "Owner")
    assert mbs is not None and [a[0].shape for a in mbs.args] == [(2, 3), (2, 6)]
    assert mbs.args[0][0].is_contiguous() and torch.equal(mbs.args[1][0], tokens[2:])

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum"), (y != -100).sum()

    logits = torch.randn(4, 6, 8)
    outs = [logits[:2, :3], logits[2:]]
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # one device: the untrimmed batch
    torch.testing.assert_close(microbatch_loss(loss_fn, outs, mbs, "Owner"), want)


def test_an_unchanged_or_absent_hook_leaves_the_cut_to_torch() -> None:
    class Same:
        def trim_microbatch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return tokens, labels

    x, y = torch.zeros(4, 6), torch.zeros(4, 6)
    assert explicit_microbatches(Same(), x, (x,), y, 2, "Owner") is None
    assert explicit_microbatches(object(), x, (x,), y, 2, "Owner") is None


def test_a_hook_that_changes_more_than_lengths_is_refused() -> None:
    class Casts:
        def trim_microbatch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (x.double() if y[0, 0] > 0 else x), y

    x, y = torch.zeros(4, 6), torch.zeros(4, 6)
    y[0] = 1
    with pytest.raises(ValueError, match=r"Owner.trim_microbatch .* may change lengths only"):
        explicit_microbatches(Casts(), x, (x,), y, 2, "Owner")


def test_stage_modules_plan_like_the_layers_run() -> None:
    layers = nn.Sequential(nn.Embedding(32, 16), CausalMix(16), nn.Linear(16, 32))
    stage = StageModule(layers, range(0, 3))
    planner = _planner(stage)
    plan = planner.plan("k", [(((3, 4), torch.int64),)])
    assert plan[0].outputs == ((((3, 4, 32), torch.float32),),)
    assert stage(torch.zeros(3, 4, dtype=torch.long)).shape == (3, 4, 32)


@pytest.mark.skipif(not stage_shapes.SUPPORTED, reason="torch 2.11: nothing rewritten")
def test_the_private_torch_names_rewritten_exist() -> None:
    from torch.distributed.pipelining import schedules, stage

    owners = {"PipelineScheduleSingle": schedules.PipelineScheduleSingle,
              "PipelineScheduleMulti": schedules.PipelineScheduleMulti,
              "_PipelineSchedule": schedules._PipelineSchedule, "PipelineStage": stage.PipelineStage}
    for name in stage_shapes.PRIVATE_NAMES:
        owner, _, attr = name.partition(".")
        if owner in owners and attr in ("_initialize_stage", "_initialize_stages", "_split_inputs",
                                        "_merge_outputs", "_get_grad_send_meta"):
            assert callable(getattr(owners[owner], attr, None)), name
    assert {"buffer", "tensor_meta", "is_root_arg"} <= set(vars(stage_shapes._RecvInfo("x", 0, tensor_meta=None))
                                                          if not stage_shapes._PERSISTENT_BUFFERS else
                                                          vars(stage_shapes._RecvInfo("x", 0, None, None)))


def test_a_module_shared_by_two_layers_of_a_stage_is_planned_and_left_as_it_was() -> None:
    shared = nn.Linear(6, 6)

    class Use(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x)) + x

    stage = StageModule([Use(), Use(), nn.Linear(6, 3)], range(3))
    before = {name: p for name, p in stage.named_parameters(remove_duplicate=False)}
    plan = _planner(stage).plan("key", [(((4, 6), torch.float32),)])
    assert plan[0].outputs == ((((4, 3), torch.float32),),)
    after = dict(stage.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is p and p.device.type == "cpu" for n, p in before.items())


def test_compiled_layers_are_planned_uncompiled() -> None:
    class Pair(nn.Module):  # returns a tuple: inductor could not compile it on meta tensors
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc(x)
            return h, h * 0.5

    class Join(nn.Module):
        def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
            return h + skip

    user_compiled = torch.compile(nn.Linear(6, 6), backend="eager")
    stage = StageModule([Pair(), Join(), user_compiled], range(3), compile_options={"backend": "eager"})
    seen: list[object] = []
    with stage.meta_forward_context():
        seen = list(stage.compiled.calls(list(stage.layers)))
    assert seen[0] is stage.layers[0] and seen[2] is user_compiled._orig_mod
    assert stage.compiled.calls(list(stage.layers))[0] is not stage.layers[0]  # compiled again outside
    plan = _planner(stage).plan("key", [(((4, 6), torch.float32),)])
    assert plan[0].outputs == ((((4, 6), torch.float32),),)


def test_routed_experts_are_planned_on_meta_tensors() -> None:
    from lightning_pipe.parallel.experts import RoutedExperts

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(6, 4)
            self.experts = RoutedExperts([nn.Linear(6, 6) for _ in range(4)])

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            weight, index = F.softmax(self.router(h), -1).topk(2, -1)
            return h + self.experts(h, index, weight)

    moe = MoE()
    x = torch.randn(5, 6)
    plan = _planner(moe).plan("key", [(((5, 6), torch.float32),)])
    assert plan[0].outputs == (((tuple(moe(x).shape), torch.float32),),)


@pytest.mark.parametrize("unplannable,name,want", [
    (("schedule 'pipedream', which updates the weights per micro-batch", ("schedule",)), "pipedream",
     r"Got schedule 'pipedream', which updates the weights per micro-batch\. Return the micro-batches unchanged .*"
     r"Or change `schedule`"),
    (("FSDP stages (fsdp_size > 1)", ("fsdp_size",)), "1f1b", r"Got FSDP stages.*Or change `fsdp_size`"),
    (None, "chimera", r"Got schedule 'chimera', which runs its own schedule class.*Or change `schedule`"),
])
def test_trimmed_micro_batches_where_shapes_cannot_be_planned_name_the_setting(unplannable, name, want) -> None:
    from lightning_pipe.config import PipelineConfigError
    from lightning_pipe.runtime.shape_book import ShapeBook

    if unplannable is None and not stage_shapes.SUPPORTED:
        pytest.skip("this torch plans no shapes at all (its own message)")
    book = ShapeBook([], object(), lambda s: 0, None, torch.device("cpu"), lambda: None, contextlib.nullcontext,
                     "Tok", unplannable, name)  # object(): not a torch schedule, as Chimera's runtime is not
    with pytest.raises(PipelineConfigError, match=r"Tok.trim_microbatch gave micro-batches of different shapes.*" + want):
        book.use(None, [], explicit=True)  # type: ignore[arg-type]
