"""Issue 14 on plain data: the layer I/O contract, the loss contract, batch signatures and the BatchNorm warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.layers.batches import (
    LossParts,
    Signature,
    check_target,
    input_args,
    loss_parts,
    pad_rows,
    signature,
)
from lightning_pipe.layers.stages import LayerContractError, StageModule, run_layers, warn_batch_norm
from tests.models import BNRegressor, DictOutRegressor, SkipRegressor, TinyLM, pad_collate, varlen_tokens


def run_cut(layers: nn.Module, inputs: tuple[torch.Tensor, ...], cuts: list[int]) -> torch.Tensor:
    """Stage modules chained the way torch does it: each stage's output tuple becomes the next stage's *args."""
    bounds = [0, *cuts, len(layers)]
    args: tuple = inputs
    out = None
    for start, stop in zip(bounds, bounds[1:]):
        out = StageModule(list(layers)[start:stop], range(start, stop))(*args)
        args = out if isinstance(out, tuple) else (out,)
    return out


def test_a_tuple_is_the_next_layers_positional_arguments_everywhere() -> None:
    model = SkipRegressor()
    x = torch.randn(6, 4)
    inputs, _ = model.split_batch((x, None))
    whole = model(inputs)  # one device
    for cuts in ([1], [3], [7], [2, 5], [1, 2, 3, 4, 5, 6, 7]):
        torch.testing.assert_close(run_cut(model.layers, inputs, cuts), whole, atol=0, rtol=0)
    # recomputation keeps the contract
    stage = StageModule(list(model.layers), range(8), recompute_every=2)
    torch.testing.assert_close(stage(*inputs), whole, atol=0, rtol=0)


def test_a_dict_output_names_the_layer_on_one_device_and_in_a_stage() -> None:
    model = DictOutRegressor()
    with pytest.raises(LayerContractError, match=r"Layer 2 \(DictOut\) returned a dict with keys \['h'\]\. Rule: "
                                                 r"every layer returns a tensor or a tuple of tensors"):
        model(torch.randn(2, 4))
    with pytest.raises(LayerContractError, match=r"Layer 2 \(DictOut\) returned a dict"):
        StageModule(list(model.layers)[1:4], range(1, 4))(torch.randn(2, 8))


def test_none_in_a_tuple_and_dict_inputs_are_refused() -> None:
    class NoneOut(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple:
            return x, None

    with pytest.raises(LayerContractError, match=r"Layer 0 \(NoneOut\) returned a tuple whose element 1 is NoneType"):
        run_layers(nn.Sequential(NoneOut(), nn.Identity()), torch.ones(2))
    with pytest.raises(LayerContractError, match=r"M\.split_batch returned inputs that are a dict with keys \['x'\]"):
        input_args({"x": torch.ones(2, 3)}, "M")
    with pytest.raises(LayerContractError, match=r"inputs of shapes \[\(2, 3\), \(3, 3\)\]. Rule: every input holds "
                                                 r"the batch in dim 0"):
        input_args((torch.ones(2, 3), torch.ones(3, 3)), "M")
    with pytest.raises(LayerContractError, match=r"training target that is a tuple of \['tensor\(2,\)'\], with "
                                                 r"microbatches=2\. Rule"):
        check_target((torch.ones(2),), 2, "M")
    with pytest.raises(LayerContractError, match=r"target that is a tensor of shape \(3,\), with microbatches=2"):
        check_target(torch.ones(3), 2, "M")
    assert input_args([torch.ones(2, 3), torch.ones(2)], "M")[1].shape == (2,)


def test_split_batch_dicts_agree_on_one_device_and_the_pipeline() -> None:
    """Dict inputs: refused on one device as under the pipeline, even with a forward that would take them. A dict
    target: accepted by both; the pipeline gives each micro-batch's loss its rows ([Note: structured targets])."""
    from lightning_pipe.layers.batches import select_rows
    from tests.models import DictTargetRegressor, OwnForwardDictInputsRegressor

    batch = (torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(LayerContractError, match=r"OwnForwardDictInputsRegressor\.split_batch returned inputs that "
                                                 r"are a dict with keys \['x'\]"):
        OwnForwardDictInputsRegressor().compute_loss(batch)
    model = DictTargetRegressor()
    x, target = model.split_batch(batch)
    whole = model.compute_loss(batch)
    assert check_target(target, 2, "M", rows=4) is target
    rows = torch.arange(4).tensor_split(2)  # what torch gives each micro-batch's loss instead of the target
    halves = [model.loss_fn(model(x[r]), select_rows(target, r)) for r in rows]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, whole)
    with pytest.raises(LayerContractError, match=r"a dict with keys \['y'\] \(values \['tensor\(3, 4\)'\]\), with "
                                                 r"microbatches=2 and 4 input rows"):
        check_target({"y": torch.ones(3, 4)}, 2, "M", rows=4)


def test_loss_fn_results_are_read_or_refused_naming_the_rule() -> None:
    value = torch.tensor(2.0, requires_grad=True)
    assert loss_parts(value, "M").count is None and loss_parts(value, "M").reduced() is not None
    pair = loss_parts((value * 3, torch.tensor(4)), "M")
    assert pair.count is not None and float(pair.reduced().detach()) == 1.5 and pair.reduced().requires_grad
    assert float(loss_parts((value, 0), "M").reduced().detach()) == 2.0  # no counted item: sum / max(count, 1)
    with pytest.raises(TypeError, match=r"M\.loss_fn returned its loss as a torch\.float32 tensor of shape \(8,\)\. "
                                        r"Rule: loss_fn returns a scalar tensor .* `losses\.mean\(\)`"):
        loss_parts(torch.ones(8), "M")
    with pytest.raises(TypeError, match=r"M\.loss_fn returned its loss as a Python float \(0\.5\)\. .*no gradient"):
        loss_parts(0.5, "M")
    with pytest.raises(TypeError, match=r"count is a str"):
        loss_parts((value, "4"), "M")
    with pytest.raises(TypeError, match=r"returned a tuple of 3"):
        loss_parts((value, value, value), "M")


def test_one_device_compute_loss_is_sum_over_count() -> None:
    model = TinyLM(loss="sum_count")
    x, y = pad_collate(-100)(varlen_tokens(6, mask_prob=0.3))
    want = F.cross_entropy(model(x).reshape(-1, 32), y.reshape(-1))  # mean over the counted tokens
    torch.testing.assert_close(model.compute_loss((x, y)), want)


def test_the_signature_changes_with_any_shape_or_dtype() -> None:
    a = (torch.zeros(8, 16, dtype=torch.long), torch.ones(8, 16))
    base = signature("train", a, 2, torch.zeros(8, 16))
    assert base == signature("train", (a[0].clone(), a[1].clone()), 2, torch.zeros(8, 16))
    assert isinstance(base, Signature) and base.with_rows(4).rows == 4
    assert base != signature("train", (a[0][:, :8], a[1][:, :8]), 2, torch.zeros(8, 8))  # sequence length
    assert base != signature("train", (a[0].int(), a[1]), 2, torch.zeros(8, 16))  # dtype
    assert base != signature("train", a, 2, torch.zeros(8, 16, 2))  # target shape
    assert base != signature("eval", a, 2)
    assert pad_rows(a, 10)[0].shape == (10, 16)


def test_batchnorm_warning_names_the_layers_only_with_several_microbatches() -> None:
    layers = BNRegressor().layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_batch_norm(layers, "layers", 1)
        warn_batch_norm(SkipRegressor().layers, "layers", 4)
        assert not caught
        warn_batch_norm(layers, "layers", 4)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "microbatches=4" in message and "layers.1 (BatchNorm1d), layers.4 (BatchNorm1d)" in message


def test_loss_parts_detach_keeps_the_count() -> None:
    parts = LossParts(torch.tensor(3.0, requires_grad=True), torch.tensor(2.0, dtype=torch.float64)).detached()
    assert not parts.value.requires_grad and float(parts.reduced()) == 1.5


def test_a_dtensor_output_is_refused_with_the_tensor_parallel_rule(tmp_path) -> None:
    """A parallelize_layer hook that leaves a layer's output a DTensor (use_local_output=False): named at the layer,
    before it reaches a stage boundary. (A one-rank gloo group: DTensors need a mesh.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layers = nn.Sequential(nn.Linear(4, 4), nn.Identity())
        parallelize_module(layers[0], init_device_mesh("cpu", (1,)),
                           ColwiseParallel(output_layouts=Replicate(), use_local_output=False))
        with pytest.raises(LayerContractError, match=r"Layer 0 \(Linear\) returned a DTensor\. Rule: .*"
                                                     r"use_local_output=True"):
            run_layers(layers, torch.randn(2, 4))
    finally:
        dist.destroy_process_group()


def test_a_failed_loss_on_rows_the_first_stage_did_not_send_names_the_batches() -> None:
    """Ranks of one pipeline that read batches of different sizes: the last stage's loss fails on an output of the
    first stage's rows and a target of its own; the error says so (only on failure: a layer may reshape rows)."""
    from lightning_pipe.config import PipelineConfigError
    from lightning_pipe.layers.batches import rows_mismatch

    err = RuntimeError("The size of tensor a (4) must match the size of tensor b (2)")
    found = rows_mismatch("Model", torch.zeros(4, 3), (torch.zeros(2, 3),), err, 2, 3)
    assert isinstance(found, PipelineConfigError)
    for words in ("output from the first stage has 4 rows while this rank's target has 2", "same batches",
                  "this rank's batch of 4 rows (microbatches=2, batch_idx 3)", "batch_size", "The size of tensor a"):
        assert words in str(found), str(found)
    assert rows_mismatch("Model", torch.zeros(2, 3), torch.zeros(2), err, 2, 3) is None
    assert rows_mismatch("Model", torch.zeros(()), torch.zeros(2), err, 2, 3) is None
