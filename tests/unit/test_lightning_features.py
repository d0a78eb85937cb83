"""The plain-data parts of the everyday-feature support (docs/features.md), on one process: what a stand-in layer
says, ragged batches' cuts and weights, a training step's kept outputs, the saving rule's text, the penalty hook and
``return_outputs`` on one device, ``load_from_checkpoint`` of a sharded directory, the model summary's rows."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from lightning_pipe.checkpoint import shard
from lightning_pipe.checkpoint.format import CheckpointError
from lightning_pipe.config import PipelineConfigError
from lightning_pipe.layers.stages import RemoteLayer, RemoteLayerError
from lightning_pipe.lightning import grad_norms, same_call
from lightning_pipe.lightning.summary import LayerTable, ModuleRow, PipelineSummary
from lightning_pipe.runtime.microbatches import Microbatches
from lightning_pipe.runtime.ragged import refusal, row_weights, split_ragged, why_ragged_cannot_run
from lightning_pipe.runtime.step_outputs import StepOutputs
from tests.models import ToyRegressor


def test_a_stand_in_layer_names_where_its_layer_lives_and_how_to_read_it() -> None:
    layer = RemoteLayer(6, 1, 1)
    with pytest.raises(RemoteLayerError, match=r"Layer 6 has no attribute 'weight' here: it lives on pipeline stage "
                                               r"1 \(pipeline rank 1\).*self.layer_value\(6, lambda layer: "
                                               r"layer.weight.norm\(\)\)"):
        layer.weight  # noqa: B018
    assert getattr(layer, "fc", None) is None and not hasattr(layer, "weight")  # still an AttributeError
    assert "pipeline rank 2" in str(pytest.raises(RemoteLayerError, getattr, RemoteLayer(3, -1, 2), "w").value)
    assert list(layer.parameters()) == []


def test_ragged_batches_are_cut_as_tensor_split_and_weighted_by_rows() -> None:
    x, y = torch.arange(6.0).reshape(6, 1), torch.arange(6)
    mbs = split_ragged((x,), {"y": y}, 4, "M")
    assert [mb[0].shape[0] for mb in mbs.args] == [2, 2, 1, 1]
    assert [t["y"].tolist() for t in mbs.targets] == [[0, 1], [2, 3], [4], [5]]
    assert row_weights(mbs) == [4 * 2 / 6, 4 * 2 / 6, 4 / 6, 4 / 6]
    assert row_weights(Microbatches([(x[:2],), (x[2:4],)], [None, None])) == [1.0, 1.0]
    assert why_ragged_cannot_run(8, 4, "FSDP stages") is None
    assert why_ragged_cannot_run(6, 4, None) is None
    assert "cannot fill 4 micro-batches" in str(why_ragged_cannot_run(3, 4, None))
    assert "this run has not: FSDP stages" in str(why_ragged_cannot_run(6, 4, "FSDP stages"))
    error = refusal("batch_idx 3", 6, 4, "x")
    assert isinstance(error, PipelineConfigError) and "DataLoader(drop_last=True)" in str(error)
    with pytest.raises(TypeError, match=r"do not all hold the batch's 6 rows"):
        split_ragged((x,), y[:4], 4, "M")


def test_kept_outputs_join_in_batch_order() -> None:
    kept = StepOutputs()
    kept.add(0, torch.ones(1))  # not keeping: nothing
    kept.begin(True)
    kept.add(4, torch.full((2, 3), 2.0))
    kept.add(0, torch.full((4, 3), 1.0, requires_grad=True))
    joined = kept.joined()
    assert joined.shape == (6, 3) and joined[:4].eq(1).all() and not joined.requires_grad
    assert not kept.keeping and kept.joined() is None
    kept.begin(True)
    kept.add(1, torch.zeros(1, 5))
    kept.add(0, torch.zeros(1, 4))  # lengths differ (trim_microbatch): a list, as compute_output gives
    assert [t.shape[1] for t in kept.joined()] == [4, 5]


def test_the_saving_rule_names_every_rank_and_what_it_does() -> None:
    text = same_call.rule("save", {0: "save|Trainer.save_checkpoint('a.ckpt')", 1: same_call.EXITED})
    assert "every rank must call it" in text and "if trainer.is_global_zero" in text
    assert "rank 0: Trainer.save_checkpoint('a.ckpt'); rank 1: its script ended" in text
    assert same_call.meet("save", "x", 0, 1, lambda: False, 1.0)  # one process: nothing to meet


def test_a_rank_inside_a_step_while_a_peer_waits_to_save_stops_after_the_grace(monkeypatch) -> None:
    monkeypatch.setattr(same_call, "peer_waiting", lambda: True)
    posted = []
    monkeypatch.setattr(same_call, "post_elsewhere", lambda rank, label: posted.append(label))
    clock = [0.0]
    monkeypatch.setattr(same_call.time, "monotonic", lambda: clock[0])
    check = same_call.StuckInStep(1, lambda: "a training step (batch_idx 3)")
    assert check() is None  # first seen
    clock[0] = same_call.IN_STEP_GRACE_S / 2
    assert check() is None and not posted
    clock[0] = same_call.IN_STEP_GRACE_S + 0.1
    message = check()
    assert message is not None and message.startswith("rank 1: PipelineConfigError: another rank called")
    assert posted == ["step|a training step (batch_idx 3)"]
    assert same_call.StuckInStep(1, lambda: None)() is None  # between steps: a save is legitimate


class Penalized(ToyRegressor):
    def layer_penalty(self, index: int, layer: nn.Module) -> torch.Tensor:
        return 0.5 * sum(p.pow(2).sum() for p in layer.parameters())  # type: ignore[return-value]


def test_layer_penalty_and_return_outputs_on_one_device() -> None:
    torch.manual_seed(0)
    batch = (torch.randn(8, 4), torch.randn(8, 4))
    plain, penalized = ToyRegressor(), Penalized()
    loss, outputs = penalized.compute_loss(batch, return_outputs=True)
    want = plain.compute_loss(batch) + 0.5 * sum(p.pow(2).sum() for p in plain.parameters())
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(outputs, plain(batch[0]).detach())
    assert not outputs.requires_grad and loss.requires_grad
    assert float(penalized.aux_loss_values["penalty"]) > 0
    with torch.no_grad():  # evaluation: no term
        torch.testing.assert_close(penalized.compute_loss(batch), plain.compute_loss(batch))


def test_load_from_checkpoint_reads_a_sharded_directory(tmp_path: Path) -> None:
    model = ToyRegressor()
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    shard(tmp_path / "one.ckpt", tmp_path / "sharded.ckpt")
    loaded = ToyRegressor.load_from_checkpoint(tmp_path / "sharded.ckpt")
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match=r"is a directory but not a lightning_pipe checkpoint"):
        ToyRegressor.load_from_checkpoint(tmp_path / "plain")

    class Other(L.LightningModule):  # not a PipelineModule: Lightning's loader, whose error says what to do
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Linear(1, 1)

    with pytest.raises(IsADirectoryError) as caught:
        Other.load_from_checkpoint(tmp_path / "sharded.ckpt")
    assert "lightning_pipe.checkpoint.as_file(path)" in "".join(caught.value.__notes__)
    assert "python -m lightning_pipe.checkpoint consolidate" in "".join(caught.value.__notes__)


def test_the_summary_lists_every_layer_with_its_stage_and_rank() -> None:
    model = ToyRegressor(n_layers=3)
    model.layers[2] = RemoteLayer(2, 1, 1)
    rows = (ModuleRow("layers.0", "Linear", 40, 40, True, 0, 0), ModuleRow("layers.1", "Block", 72, 72, True, 0, 0),
            ModuleRow("layers.1.fc", "Linear", 72, 72, True, 0, 0), ModuleRow("layers.2", "Linear", 36, 36, True, 1, 1))
    table = LayerTable(rows, {"layers.0.weight": (32, True), "layers.0.bias": (8, True), "layers.1.fc.weight": (64, True),
                              "layers.1.fc.bias": (8, True), "layers.2.weight": (32, False), "layers.2.bias": (4, True)})
    summary = PipelineSummary(model, table, "layers", max_depth=1)
    names = summary._get_summary_data()[1][1]
    assert names == ["layers", "layers.0", "layers.1", "layers.2"]  # the layers one by one even at depth 1
    assert summary._get_summary_data()[5][1] == ["", "0", "0", "1"]
    assert summary.total_parameters == 148 and summary.trainable_parameters == 116
    assert "layers.1.fc" in str(PipelineSummary(model, table, "layers", max_depth=-1))


def test_lightnings_grad_norm_total_warns_once_and_ours_does_not() -> None:
    class Engine:
        stage_modules = [type("S", (), {"layer_indices": range(0, 3)})()]
        groups = type("G", (), {"topology": type("T", (), {"pp_rank": 0})()})()

    grad_norms._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad_norms.check_logged("grad_2.0_norm_total", torch.tensor(1.0), Engine())
        grad_norms.check_logged("grad_2.0_norm_total", torch.tensor(1.0), Engine())
        grad_norms.check_logged("grad_2.0_norm/layers.0.weight", torch.tensor(1.0), Engine())
    assert len(caught) == 1 and "layers 0-2 on pipeline rank 0" in str(caught[0].message)
    assert "lightning_pipe.grad_norm(self, 2)" in str(caught[0].message)
