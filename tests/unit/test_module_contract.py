"""The module contract: a layer list, a loss, a batch split; the same module runs without the strategy."""

import copy

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from lightning_pipe import PipelineConfigError, PipelineModule
from lightning_pipe.layers.stages import (
    RemoteLayer,
    check_no_stray_parameters,
    find_layers,
    find_tied_parameters,
    localize_layers,
)
from lightning_pipe.lightning.module import default_split_batch
from tests.models import ToyRegressor, loader, regression_data


def test_default_split_batch():
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert default_split_batch((x, y)) == (x, y)
    assert default_split_batch(x) == (x, None)
    assert default_split_batch({"input": x, "target": y}) == (x, y)
    with pytest.raises(TypeError, match="override `split_batch"):
        default_split_batch((x, y, y))


def test_module_trains_unchanged_on_one_device():
    model = ToyRegressor()
    before = copy.deepcopy(model.state_dict())
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(regression_data(32), 8))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "train_loss" in trainer.callback_metrics


def test_missing_layer_list_says_how_to_provide_one():
    class NoLayers(PipelineModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 2)

    with pytest.raises(PipelineConfigError) as err:
        find_layers(NoLayers(), "layers")
    msg = str(err.value)
    assert "no attribute `layers`" in msg and "nn.Sequential" in msg and "strategy.layers_attr" in msg


def test_unordered_layer_list_is_refused():
    class DictLayers(PipelineModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(2, 2)})

    with pytest.raises(PipelineConfigError, match=r"ordered chain.*ModuleDict"):
        find_layers(DictLayers(), "layers")


def test_parameters_outside_the_layer_list_are_refused():
    model = ToyRegressor()
    model.extra = nn.Linear(2, 2)
    with pytest.raises(PipelineConfigError, match=r"extra.weight"):
        check_no_stray_parameters(model, "layers")


def test_tied_parameters_are_found():
    tied = find_tied_parameters(ToyRegressor(n_layers=4, tied=True), "layers")
    assert len(tied) == 1
    assert tied[0].names == ("layers.0.weight", "layers.3.weight") and tied[0].layer_indices == (0, 3)
    assert find_tied_parameters(ToyRegressor(n_layers=4), "layers") == []


def test_localize_keeps_original_names_and_drops_remote_parameters():
    model = ToyRegressor(n_layers=6)
    ranges = [range(0, 3), range(3, 6)]
    stages = localize_layers(model, "layers", ranges, [1], stage_to_rank=lambda s: s)
    names = [n for n, _ in model.named_parameters()]
    assert names and all(n.split(".")[1] in {"3", "4", "5"} for n in names)
    assert isinstance(model.layers[0], RemoteLayer) and len(model.layers) == 6
    assert [list(s.layer_indices) for s in stages] == [[3, 4, 5]]
    with pytest.raises(RuntimeError, match=r"Layer 0 lives on pipeline stage 0 .*compute_loss"):
        model(torch.zeros(1, 4))


def test_materialized_layers_keep_every_shared_parameter():
    """Layers built on meta are allocated with their shared parameters shared again: a tie between two layers of
    this rank and a weight shared inside one layer (``to_empty`` gives every module a Parameter of its own)."""
    from lightning_pipe.layers.stages import materialize

    with torch.device("meta"):
        model = ToyRegressor(n_layers=4, tied=True)
        inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        inner[1].weight = inner[0].weight
        model.layers[1] = inner
    stages = localize_layers(model, "layers", [range(0, 4)], [0], stage_to_rank=lambda s: s)
    assert materialize(model, stages, torch.device("cpu"))
    assert model.layers[0].weight is model.layers[3].weight and inner[0].weight is inner[1].weight
    assert not any(t.is_meta for t in model.parameters())


def test_manual_optimization_is_refused_only_where_it_cannot_run():
    from lightning_pipe.config import PipelineConfig, PipelineConfigError
    from lightning_pipe.lightning.manual import check_manual_optimization
    from lightning_pipe.lightning.preflight import check_module
    from lightning_pipe.schedules import plan_schedule

    model = ToyRegressor()
    model.automatic_optimization = False
    check_module(model)  # the contract holds: manual optimization runs (tests/distributed/test_features.py)
    check_manual_optimization(model, plan_schedule(PipelineConfig(schedule="zbv"), 2), PipelineConfig())
    with pytest.raises(PipelineConfigError, match=r"schedule='pipedream' has its own \(.*automatic optimization"):
        check_manual_optimization(model, plan_schedule(PipelineConfig(schedule="pipedream"), 2), PipelineConfig())
    with pytest.raises(PipelineConfigError, match=r"cannot rebalance.*rebalance_every_n_steps=None \(got 5\)"):
        check_manual_optimization(model, plan_schedule(PipelineConfig(), 2), PipelineConfig(rebalance_every_n_steps=5))


def test_module_without_the_contract_is_refused():
    from lightning_pipe.lightning.preflight import check_module

    class Plain(L.LightningModule):
        pass

    with pytest.raises(TypeError, match=r"lacks \['loss_fn', 'split_batch', 'compute_loss'\].*PipelineModule"):
        check_module(Plain())
