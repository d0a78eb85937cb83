"""Issue 45: Lightning's everyday features under the pipeline, each against one device: collectives over the ranks
that read different data, prediction writers, deployable checkpoints, global gradient norms in hooks, a penalty
over every stage's parameters, the model summary and errors that know the layout."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from tests.distributed import fault_script as fs
from tests.distributed.launcher import launch
from tests.distributed.scenarios.everyday import read_csv_column
from tests.distributed.scenarios.feature_model import FeatureNet
from tests.distributed.scenarios.features import MATRIX, REFUSED, FeatureCase, run_reference

pytestmark = [pytest.mark.distributed]

ATOL = 1e-5
Results = Sequence[Sequence[dict[str, Any]]]


def merged(results: Results, i: int, key: str = "params", dp_rank: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rank in results:
        if rank[i]["topology"][0] == dp_rank:
            out.update(rank[i][key])
    return out


def assert_params(results: Results, i: int, ref: dict[str, Any], case: FeatureCase) -> None:
    for dp_rank in range(case.dp):
        got = merged(results, i, dp_rank=dp_rank)
        assert sorted(got) == sorted(ref["params"])
        for name, value in ref["params"].items():
            torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{case} {n}: {m}")


def assert_close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                               atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def check_collectives(results: Results, i: int, ref: dict[str, Any], dp: int) -> None:
    """all_gather / reduce / sync_dist count each sample once; broadcast gives every rank one value; a layer's
    value reaches every rank."""
    for rank in results:
        got = rank[i]
        record, want = got["record"], ref["record"]
        n = len(want["all_gather_sum"])
        assert got["record"]["all_gather_shape"] == [(dp,)] * n, got["record"]["all_gather_shape"]
        assert got["record"]["world_gather_shape"] == [(len(results),)] * n
        assert_close(record["all_gather_sum"], want["all_gather_sum"], "all_gather(rows).sum()")
        assert_close(record["reduce_sum"], want["reduce_sum"], "strategy.reduce(rows, 'sum')")
        assert record["broadcast"] == ["from rank 0"] * n, record["broadcast"]
        assert_close(record["head_norm"], want["head_norm"], "layer_value(last, weight norm)")
        assert_close(got["logged"]["val_rows"], ref["logged"]["val_rows"], "self.log(sync_dist, reduce_fx=sum)")
        assert_close(got["validate"]["val_rows"], ref["validate"]["val_rows"], "validate's val_rows")
        assert_close(got["validate"]["val_acc"], ref["validate"]["val_acc"], "validate's val_acc")


def read_predictions(folder: Path, kind: str) -> tuple[int, torch.Tensor]:
    """(files, predictions in sample order) of what the writers wrote."""
    rows: dict[int, torch.Tensor] = {}
    files = sorted(folder.glob(f"{kind}-*.pt"))
    for path in files:
        prediction, indices = torch.load(path, weights_only=False)
        if kind == "epoch":  # lists per dataloader of per-batch lists
            prediction, indices = [p for p in prediction], [ix for ix in indices[0]]
        else:
            prediction, indices = [prediction], [indices]
        for pred, ix in zip(prediction, indices):
            for row, sample in zip(pred, ix):
                assert sample not in rows, f"sample {sample} written twice ({path.name})"
                rows[sample] = row
    return len(files), torch.stack([rows[k] for k in sorted(rows)])


def with_folders(cases: Sequence[FeatureCase], root: Path) -> list[FeatureCase]:
    """Each case its own folder; ``ckpt_resume`` reads the one of the ``ckpt_consolidated`` case before it."""
    out, last_ckpt = [], ""
    for i, case in enumerate(cases):
        folder = str(root / f"case{i}")
        if case.feature == "ckpt_consolidated":
            last_ckpt = folder
        out.append(FeatureCase(**{**case.__dict__, "out_dir": last_ckpt if case.feature == "ckpt_resume" else folder}))
    return out


@pytest.mark.timeout(900)
def test_feature_matrix_matches_one_device(tmp_path: Path) -> None:
    """Every everyday Lightning feature of docs/features.md at pipeline 2, one launch, each against one device (or
    refused / warning as the table says)."""
    run_and_check(MATRIX, 2, tmp_path)


# with replicas: the collectives' data group has 2 ranks, the writers write from 2 of the 4 ranks
REPLICAS = [
    FeatureCase("collectives", dp=2, steps=3),
    FeatureCase("prediction_writers", dp=2, steps=2),
    FeatureCase("clip_torch_norm", dp=2, tied=True, steps=3),
    FeatureCase("grad_norm_ours", dp=2, steps=3),
    FeatureCase("train_metrics", dp=2, steps=3),
    FeatureCase("manual_gan", dp=2, steps=3),
]


@pytest.mark.timeout(600)
def test_everyday_features_with_replicas_match_one_device(tmp_path: Path) -> None:
    run_and_check(REPLICAS, 4, tmp_path)


def run_and_check(cases: Sequence[FeatureCase], world: int, root: Path) -> None:
    cases = with_folders(cases, root)
    results = launch("features", world, cases, root / "launch", timeout=500)
    for i, case in enumerate(cases):
        if case.expect_error:
            for rank in results:
                assert not rank[i]["ok"] and REFUSED[case.feature] in rank[i]["error"], rank[i]
            continue
        ref = run_reference(case)
        assert_params(results, i, ref, case)
        # each replica logs its own batch's loss; their mean is the global batch's
        by_replica = [merged_losses(results, i, d) for d in range(case.dp)]
        assert_close(torch.stack(by_replica).mean(0), ref["losses"], f"{case.feature}: train_loss")
        check_case(results, i, case, ref)


def merged_losses(results: Results, i: int, dp_rank: int) -> torch.Tensor:
    losses = [torch.tensor(rank[i]["losses"]) for rank in results if rank[i]["topology"][0] == dp_rank]
    for other in losses[1:]:
        torch.testing.assert_close(other, losses[0], atol=0, rtol=0)  # every stage of a replica logs the same
    return losses[0]


def check_case(results: Results, i: int, case: FeatureCase, ref: dict[str, Any]) -> None:
    feature, first = case.feature, results[0][i]
    if feature == "collectives":
        check_collectives(results, i, ref, case.dp)
    elif feature == "prediction_writers":
        for kind in ("batch", "epoch"):
            n_files, got = read_predictions(Path(case.out_dir) / "pipeline", kind)
            n_ref, want = read_predictions(Path(case.out_dir) / "reference", kind)
            # one file per batch (per replica) or per epoch (per replica), as DDP writes them; each sample once
            assert got.shape == want.shape == (22, 4) and (n_files == n_ref or case.dp > 1), (kind, n_files, n_ref)
            assert_close(got, want, f"{kind} writer")
    elif feature == "ckpt_sharded":
        path = Path(first["path"])
        assert path.is_dir()
        with pytest.raises(IsADirectoryError):  # torch.load reads files; the docs name the ways (test_docs)
            torch.load(path, weights_only=True)
        loaded = FeatureNet.load_from_checkpoint(path)  # a sharded directory, on one process
        assert_close_params(loaded, merged(results, i))
    elif feature == "ckpt_consolidated":
        path = Path(first["path"])
        assert path.is_file()
        assert sorted(torch.load(path, weights_only=True)["state_dict"]) == sorted(ref["params"])
        assert_close_params(FeatureNet.load_from_checkpoint(path), merged(results, i))
    elif feature in ("clip_torch_norm", "grad_norm_lightning", "grad_norm_ours", "penalty"):
        check_gradients(results, i, case, ref)
    elif feature == "layout":
        check_layout(results, i, ref)
    elif feature == "train_metrics":
        # each replica's step value, as DDP logs a metric's forward (dist_sync_on_step=False); equal batches: their
        # mean is the global batch's
        by_replica = [torch.tensor(merged(results, i, "logged", d)["train_acc"]) for d in range(case.dp)]
        assert len(by_replica[0]) == case.steps
        assert_close(torch.stack(by_replica).mean(0), ref["logged"]["train_acc"], "train_acc")
    elif feature == "manual_gan":  # each replica logs its own batch's (as the train loss)
        by_replica = [torch.tensor(merged(results, i, "logged", d)["loss_d"]) for d in range(case.dp)]
        assert_close(torch.stack(by_replica).mean(0), ref["logged"]["loss_d"], "the second update's loss")
    elif feature == "manual_groups":
        for rank in results:
            assert_close(rank[i]["record"]["torch_norm"], ref["record"]["torch_norm"], "clip_grad_norm_ in a step")
    elif feature == "hf_everyday":
        for rank in results:
            for key in ("tokens", "layer2_norm", "grad_norm"):
                assert_close(rank[i]["record"][key], ref["record"][key], f"HFCausalLM: {key}")
            assert_close(rank[i]["logged"]["train_acc"], ref["logged"]["train_acc"], "HFCausalLM: token accuracy")
        assert len(ref["losses"]) == 4  # 30 rows in batches of 8: the last, of 6, trained too
        row = next(line for line in first["summary"].splitlines() if "| layers.2 " in line)
        assert "CausalLMDecoderLayer" in row and row.rstrip().endswith("| 0     | 0"), first["summary"]
        total = get_human_readable_count(sum(v.numel() for v in ref["params"].values()))
        assert f"{total:<10}Total params" in first["summary"]  # the whole model, as one device counts it
    elif feature == "ragged":
        assert len(ref["losses"]) == -(-case.n_data // case.batch)  # the short last batch trained too
    else:
        check_everyday(results, i, case, ref)


def check_gradients(results: Results, i: int, case: FeatureCase, ref: dict[str, Any]) -> None:
    """Norms a hook computes and the penalty: the model's, as one device computes them."""
    for rank in results:
        got = rank[i]
        if case.feature == "clip_torch_norm":
            assert_close(got["record"]["torch_norm"], ref["record"]["torch_norm"], "clip_grad_norm_'s norm")
        elif case.feature == "grad_norm_lightning":
            assert any("grad_2.0_norm_total" in w and "lightning_pipe.grad_norm(self, 2)" in w
                       for w in got["warnings"]), got["warnings"]
        elif case.feature == "grad_norm_ours":
            assert_close(got["record"]["grad_norm_total"], ref["record"]["grad_norm_total"], "grad_norm total")
            assert not got["warnings"]
        else:
            penalties, want = got["logged"]["train_aux_loss/penalty"], ref["logged"]["train_aux_loss/penalty"]
            assert len(penalties) == case.steps and penalties[0] > 0
            assert_close(penalties, want, "logged penalty")


def check_everyday(results: Results, i: int, case: FeatureCase, ref: dict[str, Any]) -> None:
    """What an everyday feature produced beside the parameters, as one device produced it."""
    feature, first = case.feature, results[0][i]
    for rank in results:
        got = rank[i]
        assert got.get("global_step") == ref.get("global_step"), (feature, got.get("global_step"), ref.get("global_step"))
        assert_close(got.get("val_losses", []), ref.get("val_losses", []), f"{feature}: val_loss during fit")
    if feature == "checkpoint_topk":
        assert first["kept"] == ref["kept"] and len(ref["kept"]) == 2, (first["kept"], ref["kept"])
        assert_close(first["best_score"], ref["best_score"], "best_model_score")
    elif feature == "early_stopping":
        assert ref["global_step"] < 30, "the case must stop early"
    elif feature == "loggers":  # rank 0 writes what one device writes
        for column in ("train_loss", "lr-SGD", "val_loss"):
            assert_close(read_csv_column(first["csv"], column), read_csv_column(ref["csv"], column), column)
        assert first["tb_files"] == ref["tb_files"] >= 1
    elif feature == "lr_find":
        for rank in results:
            assert_close(rank[i]["lr_losses"], ref["lr_losses"], "lr_find losses")
            assert rank[i]["suggestion"] == pytest.approx(ref["suggestion"], rel=1e-6)
    elif feature == "evaluate_and_predict":
        for rank in results:
            assert_close(rank[i]["test"]["test_loss"], ref["test"]["test_loss"], "trainer.test")
            assert_close(torch.cat(rank[i]["predictions"]), torch.cat(ref["predictions"]), "trainer.predict")


def assert_close_params(model: torch.nn.Module, want: dict[str, Any]) -> None:
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_close(got[name].detach(), value, f"loaded {name}")


def check_layout(results: Results, i: int, ref: dict[str, Any]) -> None:
    summary = results[0][i]["summary"]
    total = sum(v.numel() for v in ref["params"].values())
    assert f"{total}      Total params" in summary or f"{total / 1e3:.1f} K     Total params" in summary, summary
    for index, (stage, rank) in enumerate([(0, 0)] * 3 + [(1, 1)] * 3):
        row = next(line for line in summary.splitlines() if f"| layers.{index} " in line)
        assert row.rstrip().endswith(f"| {stage}     | {rank}"), row
    assert "layers.3.fc" in summary, summary  # max_depth=-1: the layers' own modules, from the ranks holding them
    assert "it lives on pipeline stage 1 (pipeline rank 1)" in results[0][i]["remote_error"]
    assert "self.layer_value(5, lambda layer: layer.fc.norm())" in results[0][i]["remote_error"]
    assert "remote_error" in results[1][i] and "pipeline stage 0 (pipeline rank 0)" in results[1][i]["remote_error"]
    for rank in results:
        assert_close(rank[i]["layer_value"], ref["layer_value"], "layer_value")


@pytest.mark.parametrize("then", ["end", "test", "in_fit"])
@pytest.mark.timeout(300)
def test_save_checkpoint_on_rank_zero_only_is_refused_on_every_rank_within_seconds(tmp_path: Path, then: str) -> None:
    """``if trainer.is_global_zero: trainer.save_checkpoint(path)`` in a script run as users run it: after fit (the
    script then ends, or every rank goes on to trainer.test), or from a callback mid-fit. Never gloo's error, never a
    hang: the rule, on every rank that is still there, seconds after the call."""
    proc = fs.start(tmp_path, "save_one_rank", then=then, max_steps=6, val_every=8)
    try:
        deadline = time.monotonic() + fs_startup()
        while not (tmp_path / "saving").exists():
            assert proc.poll() is None and time.monotonic() < deadline, fs.log_tail(tmp_path)
            time.sleep(0.05)
        seconds, codes = fs.time_to_exit(tmp_path, proc, time.monotonic(), 30)
    finally:
        fs.cleanup(proc)
    log = fs.log_tail(tmp_path, 80)
    assert seconds < 30 and codes[0] == 1, (seconds, codes, log)
    rule = "Trainer.save_checkpoint is a collective under PipelineStrategy: every rank must call it"
    error0 = (tmp_path / "error0").read_text()
    assert rule in error0, log
    assert "Connection reset" not in log and "Connection closed" not in log, log
    if then == "end":
        assert "rank 1: its script ended" in error0 and (tmp_path / "done1").exists(), log
    elif then == "test":
        assert "rank 1: trainer.test" in error0, log
        assert rule in (tmp_path / "error1").read_text() and "rank 0: Trainer.save_checkpoint(" in error0, log
    else:  # rank 1 waited in its next step: its watch stopped it with the rule
        assert "rank 1: a training step (batch_idx 3)" in error0, log
        assert "rank 1: PipelineConfigError: another rank called Trainer.save_checkpoint" in log, log


def fs_startup() -> float:
    return 180.0  # two Python processes importing Lightning on a busy 2-core machine, and a short fit
