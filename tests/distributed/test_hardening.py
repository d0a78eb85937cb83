"""Issue 14: no silent wrong numbers. Variable sequence lengths, BatchNorm under torch's shape inference, tuple
outputs as positional arguments, token-weighted (sum, count) losses — each equal to one device (fp32, 1e-5, every
parameter), and the broken contracts fail naming the layer / the rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lightning_pipe._compat import stage_shapes
from tests.distributed.launcher import RanksFailed, launch
from tests.distributed.scenarios.hardening import HardeningCase, run_reference
from tests.torch_tiers import SPLIT_BACKWARD_SCHEDULES, refused

pytestmark = [pytest.mark.distributed]

ATOL = 1e-5
FP16_TOL = 2 * 2**-11  # 2 ulps of fp16 (see test_precision.py): fp16 compute rounds per micro-batch

LM = dict(model="lm", microbatches=4, batch=8)
VARLEN = dict(LM, loss="mean", pad_label=0, steps=4, validate=True, predict=True)  # every position counted
MASKED = dict(LM, loss="sum_count", pad_label=-100, mask_prob=0.3)  # -100 labels, uneven per micro-batch/replica

# schedule="custom": 1F1B written out as per-rank action lists (p = 2, m = 4)
ONE_F_ONE_B = (("0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"),
               ("1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"))

PP2_CASES = [
    # 1. variable sequence lengths: training, validation during fit, validate, predict (short last batch)
    HardeningCase(**VARLEN, schedule="1f1b"),
    HardeningCase(**VARLEN, schedule="zbv"),
    # 4. token-weighted loss with accumulation; ZB-V runs the split (input / weight) backward
    HardeningCase(**MASKED, schedule="1f1b", acc=2, validate=True),
    HardeningCase(**MASKED, schedule="zbv", acc=2, optimizer="adamw"),
    # fp16 loss scaling stays exact: the scaler is linear, and the sums are normalised like means
    HardeningCase(**MASKED, schedule="1f1b", precision="16-mixed"),
    # 2. BatchNorm: one micro-batch is exact (running statistics included); several warn
    HardeningCase(model="bn", schedule="gpipe", microbatches=1, validate=True),
    HardeningCase(model="bn", schedule="gpipe", microbatches=2, steps=1),
    # 3. (h, skip) tuples between layers and across stages, a pair of inputs into the first layer
    *(HardeningCase(model="skip", schedule=s, validate=s == "interleaved_1f1b", predict=s == "zbv")
      for s in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev")),
    HardeningCase(model="skip", schedule="custom", microbatches=4, actions=ONE_F_ONE_B),
    # non-contiguous inputs (a strided slice, an expanded mask carried across) and column-major layer outputs
    *(HardeningCase(model="views", schedule=s, stages_per_rank=2 if s == "interleaved_1f1b" else None)
      for s in ("1f1b", "zbv", "interleaved_1f1b")),
    # split_batch returning a dict: refused on every rank before any waits (on one device too: test_engine_contract)
    HardeningCase(model="dict_inputs", steps=1, expect_error=True),
    # a dict target: each micro-batch's loss gets its rows of every value, as one device does ([Note: structured
    # targets]); validation passes the whole dict
    HardeningCase(model="dict_target", schedule="1f1b", steps=2, optimizer="adamw", validate=True),
    # training_step's return: a changed loss or a second compute_loss stops the run on every rank (neither would
    # reach the gradients); {"loss": loss, ...} trains as on one device ([Note: the loss a training step returns])
    HardeningCase(model="scaled_loss", steps=1, expect_error=True),
    HardeningCase(model="loss_twice", steps=1, expect_error=True),
    HardeningCase(model="dict_loss", schedule="zbv", steps=2, acc=2, optimizer="adamw"),
    # sums across ranks (self.log's sync_dist, torchmetrics): counted once, not once per pipeline rank
    HardeningCase(model="metrics", schedule="1f1b", steps=2, validate=True),
    # a last layer's output flattened to [batch * 4]: trains, refused in validation on every rank, naming the shape
    HardeningCase(model="flat_out", schedule="1f1b", steps=2, validate=True, expect_error=True),
]
ERRORS = {"dict_inputs": "DictInputsRegressor.split_batch returned inputs that are a dict with keys ['x']",
          "scaled_loss": "TrainingStepLoss.training_step returned a loss other than the one compute_loss returned",
          "loss_twice": "TrainingStepLoss.training_step called compute_loss a second time (batch_idx 0)",
          "flat_out": "FlatOutRegressor's last layer returned an output of shape [32] for 8 rows (4 micro-batches of "
                      "2) in validation / test / predict. Rule: the pipeline joins the micro-batches' outputs along "
                      "dim 0"}
if refused("split_backward"):  # restricted torch tier: those schedules are refused (tests/unit/test_compat.py)
    PP2_CASES = [case for case in PP2_CASES if case.schedule not in SPLIT_BACKWARD_SCHEDULES]


def replica(results: Sequence[Sequence[dict[str, Any]]], i: int, dp_rank: int, key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rank in results:
        if rank[i]["topology"][0] == dp_rank:
            out.update(rank[i][key])
    return out


def assert_no_reinference(inferences: list[int], validate: bool) -> None:
    """Torch's shape inferences after each training batch (issue 24): none after the first batch's for a new
    length; with validation after batch 2, one more for the eval structure, none on the way back to training."""
    if not stage_shapes.SUPPORTED:  # torch 2.11: every new shape re-infers
        assert inferences[-1] >= 2, inferences
        return
    assert inferences[0] > 0 and inferences[1] == inferences[0], inferences
    assert len(set(inferences[2:] if validate else inferences)) == 1, inferences


def assert_parity(results: Sequence[Sequence[dict[str, Any]]], i: int, case: HardeningCase) -> dict[str, Any]:
    ref = run_reference(case)
    atol = FP16_TOL if case.precision == "16-mixed" else ATOL
    loss_atol = ATOL if case.precision == "32-true" else 4 * atol
    for dp_rank in range(case.dp * case.fsdp):
        for key in ("params", "buffers"):
            got = replica(results, i, dp_rank, key)
            assert sorted(got) == sorted(ref[key]), f"{case} {key}"
            for name, want in ref[key].items():
                torch.testing.assert_close(got[name], want, atol=atol, rtol=0, msg=lambda m, n=name: f"{case} {n}: {m}")
    if case.dp * case.fsdp == 1:  # else each data rank logs its own batch's loss
        for rank in results:
            for key in ("losses", "fit_val_losses", *(("val_loss",) if case.validate else ())):
                torch.testing.assert_close(torch.tensor(rank[i][key]), torch.tensor(ref[key]), atol=loss_atol, rtol=0,
                                           msg=lambda m, k=key: f"{case} {k}: {m}")
            assert rank[i]["scales"] == ref["scales"] and bool(ref["scales"]) == (case.precision == "16-mixed")
    if case.model == "metrics":  # [Note: what sync_dist reduces over]: sums over the data, once
        assert {"val_rows", "val_out_total", "val_out_max", "val_metric_sum", "val_metric_mean"} <= set(ref["val_metrics"])
        for rank in results:
            for key, want in ref["val_metrics"].items():
                if key != "val_loss" or case.dp == 1:
                    torch.testing.assert_close(rank[i]["val_metrics"][key], want, atol=ATOL, rtol=1e-5,
                                               msg=lambda m, k=key: f"{case} {k}: {m}")
    if case.predict:
        for rank in results:
            assert len(rank[i]["predictions"]) == len(ref["predictions"]) == 3
            for got, want in zip(rank[i]["predictions"], ref["predictions"]):
                if isinstance(got, list):  # trimmed micro-batches: each one's rows, up to its own length
                    for mb, rows in zip(got, torch.tensor_split(want, len(got)), strict=True):
                        torch.testing.assert_close(mb, rows[:, :mb.shape[1]], atol=ATOL, rtol=0)
                    continue
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    return ref


@pytest.mark.compact  # make test-torch: on every supported torch
@pytest.mark.timeout(900)
def test_pp2_variable_shapes_batchnorm_tuples_and_token_weighted_loss(tmp_path) -> None:
    results = launch("hardening", 2, PP2_CASES, tmp_path, timeout=600)
    for i, case in enumerate(PP2_CASES):
        if case.expect_error:
            for rank in results:
                assert not rank[i]["ok"]
                assert ERRORS[case.model] in rank[i]["error"], rank[i]["error"]
            continue
        if case.model == "bn" and case.microbatches > 1:  # per-micro-batch statistics: warned, not comparable
            warned = results[0][i]["warnings"]
            assert len(warned) == 1 and "layers.1 (BatchNorm1d), layers.4 (BatchNorm1d)" in warned[0], warned
            assert not results[1][i]["warnings"]  # once, on rank 0
            continue
        ref = assert_parity(results, i, case)
        if case.model == "lm":
            # several sequence lengths, planned without re-inference ([Note: shapes without re-inference])
            if case.predict:  # the data really varies: predict batches of several lengths
                assert len({p.shape[1] for p in ref["predictions"]}) >= 2
            for rank in results:
                assert_no_reinference(rank[i]["inferences"], case.validate)
        if case.model == "bn":
            bn = replica(results, i, 0, "buffers")
            assert int(bn["layers.4.num_batches_tracked"]) == case.steps and torch.isfinite(bn["layers.4.running_var"]).all()
            assert not results[0][i]["warnings"]  # one micro-batch: exact, nothing to warn about


@pytest.mark.timeout(900)
def test_pp2_dp2_token_weighted_loss_with_uneven_padding(tmp_path) -> None:
    # each replica pads its batch to its own longest sequence: different shapes and token counts per replica
    # and (issue 24) each micro-batch trimmed to its own length, with validation
    cases = [HardeningCase(**MASKED, schedule="1f1b", dp=2, acc=2),
             HardeningCase(model="metrics", schedule="1f1b", dp=2, steps=2, validate=True),
             *([HardeningCase(**{**MASKED, "model": "lm_trim"}, schedule="1f1b", dp=2, steps=4, validate=True)]
               if stage_shapes.SUPPORTED else [])]
    # FSDP: each shard's batch padded to its own length, so the shards' token counts and shapes differ; FSDP
    # averages in the schedule, before the count's factor ([Note: token-weighted loss])
    cases.append(HardeningCase(**MASKED, schedule="1f1b", fsdp=2, acc=2))
    results = launch("hardening", 4, cases, tmp_path, timeout=600)
    for i, case in enumerate(cases):
        assert_parity(results, i, case)
        if case.fsdp == 1:  # averaged during the schedule at every optimizer step (the accumulated batch carried)
            assert all(rank[i]["dp_sync"] == {"overlapped": case.steps, "after_schedule": 0} for rank in results)
    trimmed = [i for i, case in enumerate(cases) if case.model == "lm_trim"]
    for rank in results if trimmed else []:
        assert_no_reinference(rank[trimmed[0]]["inferences"], True)


@pytest.mark.timeout(300)
def test_a_dict_output_fails_naming_the_layer(tmp_path) -> None:
    with pytest.raises(RanksFailed) as failed:
        launch("hardening", 2, [HardeningCase(model="dict_out", steps=1)], tmp_path, timeout=120)
    assert "Layer 2 (DictOut) returned a dict with keys ['h']. Rule: every layer returns a tensor" in str(failed.value)
