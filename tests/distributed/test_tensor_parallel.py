"""Tensor parallelism per stage (``tensor_parallel_size``): pipeline 2 x tensor 2 equals one device.

One 4-rank launch: each stage's layers split by the module's ``parallelize_layer`` hook (column-wise input
projection, column-wise / row-wise MLPs; LayerNorms, a row-wise bias and the head replicated), with gradient
accumulation and global-norm clipping (split gradients summed over the tensor group, replicated ones counted once),
then a checkpoint (whole tensors gathered per stage) that resumes exactly and loads on one device, then what
is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pipe import checkpoint as ckpt_lib
from tests.distributed.launcher import launch_runs
from tests.distributed.parity import assert_case_parity, assert_same, merge_replica
from tests.distributed.scenarios import CheckpointCase, TrainingCase
from tests.distributed.scenarios.checkpoint import run_reference

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

TRAINING = [
    TrainingCase(model="tp", schedule="1f1b", tp=2, acc=2, clip=0.05, optimizer="adamw"),
    # a second Trainer (predict, validate) on the already split module; a tiny clip: every step is clipped
    TrainingCase(model="tp", schedule="gpipe", tp=2, acc=3, steps=2, clip=0.01, predict=True),
    # two stages per rank: each tensor rank's P2P partner is the same tensor rank of the next stage; every layer
    # recomputed in the backward (its tensor-parallel all-reduces run again, in the same order on both ranks)
    TrainingCase(model="tp", schedule="interleaved_1f1b", stages_per_rank=2, tp=2, acc=2, clip=0.05,
                 recompute="all", validate=False),
    # the recipe's GPT by its own hook: attention split by heads (fused q|k|v), MLP column- then row-wise; the
    # embedding and the head stay whole and tied across the first and the last stage (summed per tensor rank)
    TrainingCase(model="gpt", n_layers=6, tied=True, optimizer="adamw", schedule="1f1b", tp=2, acc=2, clip=0.5,
                 n_data=64, check_grad_norms=False),
    # the Llama recipe (meta-built): one of the 2 key/value heads per tensor rank, SwiGLU gate/up column-wise
    TrainingCase(model="llama", n_layers=6, optimizer="adamw", schedule="gpipe", tp=2, acc=2, clip=0.5, n_data=64,
                 validate=False),
]
ERRORS = [
    # no parallelize_layer hook
    (TrainingCase(model="toy", tp=2, steps=1, validate=False, expect_error=True), "parallelize_layer"),
    # a hook that splits the head but not the embedding tied to it: the copies would train apart
    (TrainingCase(model="gpt_split_head", n_layers=5, tied=True, optimizer="adamw", tp=2, steps=1, n_data=64,
                  validate=False, check_grad_norms=False, expect_error=True), "copies of a tied parameter"),
]


# Dropout in the whole parts of a layer (embedding, residual branches) with a different seed on every rank: the
# strategy starts the tensor ranks from one random state, so they drop the same elements (not a parity case: one
# device draws other masks).
DROPOUT = TrainingCase(model="gpt", n_layers=5, tied=True, optimizer="adamw", tp=2, dropout=0.3, seed_per_rank=True,
                       n_data=64, validate=False, check_grad_norms=False)

STEP4 = "epoch=0-step=4.ckpt"
# the toy model's plain column-/row-wise splits; the GPT's strided q|k|v split (gathered back to the fused layout)
CHECKPOINT_MODELS = ("toy", "gpt")


@pytest.fixture(scope="module")
def pp2_tp2_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp")
    runs: list[tuple[str, Any]] = [("training", case) for case in TRAINING]
    runs += [("training", case) for case, _ in ERRORS]
    runs += [("ckpt_train", CheckpointCase(tp=2, model=model, dir=str(root / model),
                                           resume_from=str(root / model / STEP4))) for model in CHECKPOINT_MODELS]
    runs.append(("training", DROPOUT))
    return {"root": root, "results": launch_runs(4, runs, root / "out", timeout=420)}


@pytest.fixture(scope="module")
def pp2_tp2(pp2_tp2_run: dict[str, Any]) -> list[list[dict[str, Any]]]:
    results: list[list[dict[str, Any]]] = pp2_tp2_run["results"]
    return results


@pytest.mark.timeout(400)
def test_pipeline2_x_tensor2_matches_single_device(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    for i, case in enumerate(TRAINING):
        for rank, res in enumerate(pp2_tp2):
            r = res[i]
            assert r["tp_rank"] == rank % 2 and r["topology"] == (0, rank // 2)  # [Note: rank order]
            assert r["sharded_params"] > 0, "the hook split this rank's layers"
        assert_case_parity(pp2_tp2, i, case)


@pytest.mark.timeout(400)
def test_tensor_parallel_refuses_what_it_cannot_do(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    for i, (_, needle) in enumerate(ERRORS, start=len(TRAINING)):
        for res in pp2_tp2:
            assert not res[i]["ok"] and needle in res[i]["error"], res[i]
            assert "tensor_parallel_size" in res[i]["error"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", CHECKPOINT_MODELS)
def test_checkpoint_pp2_tp2_resumes_and_loads_on_one_device(pp2_tp2_run: dict[str, Any], tmp_path: Path,
                                                           model: str) -> None:
    res, saved = pp2_tp2_run["results"], pp2_tp2_run["root"] / model
    i = len(TRAINING) + len(ERRORS) + CHECKPOINT_MODELS.index(model)
    for rank in res:  # stopped at step 4 and resumed == uninterrupted (every rank's gathered parameters)
        full, resumed = rank[i]["full"], rank[i]["resumed"]
        assert resumed["global_step"] == 8
        assert_same(resumed["params"], full["params"], 1e-6, "pp2 x tp2 resumed")
    # the checkpoint holds whole tensors: one device resumes from the consolidated file and trains on the same
    uninterrupted = merge_replica(res, i, run="full")
    case = CheckpointCase(tp=2, model=model)
    ref, _, _ = run_reference(case, ckpt_lib.consolidate(saved / STEP4, tmp_path / "one.ckpt"))
    assert_same(ref["params"], uninterrupted, 1e-5, "pp2 x tp2 -> one device")


@pytest.mark.skipif(os.environ.get("LIGHTNING_PIPE_8_RANKS") != "1",
                    reason="8 processes (~70 s on 2 loaded cores): set LIGHTNING_PIPE_8_RANKS=1 to run")
@pytest.mark.timeout(600)
def test_pipeline2_x_replicas2_x_tensor2_matches_single_device(tmp_path: Path) -> None:
    """Replicas average each tensor rank's parts with the same tensor rank of the other replica."""
    case = TrainingCase(model="tp", schedule="1f1b", dp=2, tp=2, acc=2, clip=0.05, optimizer="adamw", validate=False)
    res = launch_runs(8, [("training", case)], tmp_path / "out", timeout=500)
    for rank in res:
        assert rank[0]["sharded_params"] > 0
    assert_case_parity(res, 0, case)


@pytest.mark.timeout(400)
def test_tensor_ranks_draw_the_same_dropout(pp2_tp2: list[list[dict[str, Any]]]) -> None:
    i = len(TRAINING) + len(ERRORS) + len(CHECKPOINT_MODELS)
    for first, second in ((0, 1), (2, 3)):  # the two tensor ranks of each stage
        a, b = pp2_tp2[first][i], pp2_tp2[second][i]
        assert a["losses"] == b["losses"] and len(a["losses"]) == DROPOUT.steps
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            torch.testing.assert_close(a["params"][name], b["params"][name], atol=0, rtol=0)
