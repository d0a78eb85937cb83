"""FSDP2 per stage (``fsdp_size``): parity with one device, HSDP, a V schedule, checkpoints across layouts.

One 4-rank launch (pipeline 2 x FSDP 2) runs the training cases, then writes sharded-stage checkpoints and resumes
them under pipeline 2 x replicas 2 in the same processes; the test process resumes them on one device. An 8-rank
launch runs pipeline 2 x replicas 2 x FSDP 2 (HSDP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pipe import checkpoint as ckpt_lib
from tests.distributed.launcher import launch_runs
from tests.distributed.parity import assert_case_parity, assert_same, merge_replica, reference
from tests.distributed.scenarios import CheckpointCase, TrainingCase
from tests.distributed.scenarios.checkpoint import optimizer_by_name, run_reference
from tests.distributed.scenarios.fsdp import FsdpCountCase
from tests.models import ToyRegressor

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

EXACT, RESHARD = 1e-6, 1e-5  # as tests/distributed/test_checkpoint.py
# checkpoints: 2 epochs of 2 steps, resumed after the first (as test_tensor_parallel.py's FSDP_CKPT; the 8-step
# default trained 8 + 4 + 4 + 4 steps across the two launches for the same checks)
SHORT = {"steps": 4, "steps_per_epoch": 2}
STEP2 = "epoch=0-step=2.ckpt"

# Every case accumulates gradients and clips (by the global norm: each shard counted once).
TRAINING = [
    TrainingCase(schedule="1f1b", fsdp=2, acc=2, clip=0.05, optimizer="adamw"),
    # zero-bubble V: two stages per rank, split input/weight backward, FSDP unshard/reshard actions
    TrainingCase(schedule="zbv", fsdp=2, acc=2, clip=0.05, optimizer="adamw"),
    # weights tied across the two pipeline ranks (each shards its copy), gathered again after every forward, and a
    # second Trainer on the already sharded module (predict, validate)
    TrainingCase(schedule="gpipe", fsdp=2, fsdp_reshard=True, tied=True, acc=2, clip=0.05, predict=True,
                 check_grad_norms=False),
    # validation (every 2 batches) in the middle of a 3-batch accumulation: torch's shape inference for an FSDP
    # stage clears .grad, the engine keeps them; elementwise clipping of sharded gradients
    TrainingCase(schedule="1f1b", fsdp=2, acc=3, steps=2, clip=0.002, clip_algo="value"),
    # layers built on the meta device, allocated and sharded layer by layer; the head's tied weight is left to its
    # owner (the embedding, on the other rank): its shards come from there
    TrainingCase(model="meta", tied=True, schedule="1f1b", fsdp=2, acc=2, clip=0.05, check_grad_norms=False,
                 validate=False),
    # every layer's activations offloaded while FSDP gathers the weights again for each backward: the gathered
    # weights autograd saves are left alone ([Note: activation offload]), the activations make the round trip
    TrainingCase(schedule="1f1b", fsdp=2, fsdp_reshard=True, offload="all", acc=2, optimizer="adamw",
                 validate=False),
    # packed rows: a token-weighted loss whose counts differ per shard; FSDP averages the shards' gradients before
    # the count's factor, so N must be the shards' mean (each shard once scaled its slice by its own count)
    TrainingCase(model="gpt_packed", n_layers=6, tied=True, n_data=64, schedule="1f1b", fsdp=2, acc=2,
                 check_grad_norms=False, validate=False),
]


# FSDP gathers in bf16 and reduces in fp32 (MixedPrecisionPolicy); fp16: an overflow in one shard of the last stage
# only, at the second step: every rank skips it. Tolerances as tests/distributed/test_precision.py (2 ulps).
PRECISION = [
    (TrainingCase(precision="bf16-mixed", schedule="1f1b", fsdp=2, acc=2, clip=0.05, validate=False), 2 * 2**-8),
    (TrainingCase(precision="16-mixed", schedule="1f1b", fsdp=2, clip=0.05, inf_grad_at_step=1, steps=4,
                  validate=False), 2 * 2**-11),
]
# two batches each (1 step x 2 accumulated, or 2 steps), 4 micro-batches
COUNTS = [FsdpCountCase(schedule="1f1b", steps=1, acc=2), FsdpCountCase(schedule="zbv"),
          FsdpCountCase(schedule="1f1b", reshard_after_forward=True)]


@pytest.fixture(scope="module")
def pp2_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp")
    saved = root / "pp2_fsdp2"
    runs: list[tuple[str, Any]] = [("training", case) for case in TRAINING]
    runs.append(("ckpt_train", CheckpointCase(fsdp=2, dir=str(saved), resume_from=str(saved / STEP2), **SHORT)))
    runs.append(("ckpt_resume", CheckpointCase(dp=2, resume_from=str(saved / STEP2), **SHORT)))
    runs += [("fsdp_counts", case) for case in COUNTS]
    runs += [("training", case) for case, _ in PRECISION]
    return {"root": root, "saved": saved, "results": launch_runs(4, runs, root / "out", timeout=500)}


@pytest.mark.timeout(600)
def test_pipeline2_x_fsdp2_matches_single_device(pp2_fsdp2: dict[str, Any]) -> None:
    for i, case in enumerate(TRAINING):
        assert_case_parity(pp2_fsdp2["results"], i, case)


@pytest.mark.timeout(600)
def test_fsdp_gathers_and_reduces_once_per_batch(pp2_fsdp2: dict[str, Any]) -> None:
    """[Note: FSDP under the pipeline schedule]: one reduce-scatter per FSDP unit per batch (not per micro-batch), and
    by default one all-gather per unit per batch (plus one for the first batch's shape inference)."""
    first = len(TRAINING) + 2
    for i, case in enumerate(COUNTS):
        for rank in pp2_fsdp2["results"]:
            got = rank[first + i]
            units, batches = got["units"], got["batches"]
            assert got["reduce"] == units * batches, (case, got)
            if case.reshard_after_forward:  # gathered again for every micro-batch's backward
                assert got["all_gather"] > units * (batches + 1), (case, got)
            else:
                assert got["all_gather"] == units * (batches + 1), (case, got)


@pytest.mark.timeout(600)
def test_fsdp_mixed_precision_matches_single_device(pp2_fsdp2: dict[str, Any]) -> None:
    first = len(TRAINING) + 2 + len(COUNTS)
    res = pp2_fsdp2["results"]
    for i, (case, tol) in enumerate(PRECISION, start=first):
        ref = reference(case)
        for dp_rank in range(2):
            got = merge_replica(res, i, dp_rank)
            for name, want in ref["params"].items():
                assert got[name].dtype == want.dtype
                torch.testing.assert_close(got[name].float(), want.float(), atol=tol, rtol=0,
                                           msg=lambda m, case=case, name=name: f"{case} {name}: {m}")
        # each data-parallel rank logs its half of the batch: their mean is the batch loss
        mean = torch.stack([torch.tensor(res[r][i]["losses"]) for r in (0, 1)]).mean(0)  # ranks 0, 1: shards 0, 1
        torch.testing.assert_close(mean, torch.tensor(ref["losses"]), atol=tol * 4, rtol=0)
        for rank in res:
            assert rank[i]["scales"] == ref["scales"]
    assert res[0][first + 1]["scales"][:2] == [2.0**16, 2.0**15]  # the overflow step backed off, once


@pytest.mark.timeout(600)
def test_checkpoint_pp2_fsdp2_resumes_same_layout_replicas_and_one_device(pp2_fsdp2: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    res, saved, n = pp2_fsdp2["results"], pp2_fsdp2["saved"], len(TRAINING)
    train, resume = n, n + 1
    # the same layout: stopped at step 2 and resumed == uninterrupted (every rank's gathered parameters)
    for rank in res:
        full, resumed = rank[train]["full"], rank[train]["resumed"]
        assert resumed["global_step"] == 4
        assert_same(resumed["params"], full["params"], EXACT, "pp2 x fsdp2 resumed")
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][2:]), atol=EXACT,
                                   rtol=0)
    # the checkpoint holds whole tensors (the layout-free format): what pp2 x dp2 starts from is the plain module's
    params, optim = consolidated_state(saved / STEP2)
    for dp_rank in range(2):
        assert_same(merge_replica(res, resume, dp_rank, key="start_params"), params, 0, "pp2 x dp2 loaded params")
        assert_same(merge_replica(res, resume, dp_rank, key="start_optim"), optim, 0,
                    "pp2 x dp2 loaded optimizer state")
    # ... and trains on exactly as the uninterrupted pp2 x fsdp2 run
    uninterrupted = merge_replica(res, train, run="full")
    assert_same(merge_replica(res, resume), uninterrupted, RESHARD, "pp2 x fsdp2 -> pp2 x dp2")
    # one device, from the consolidated file
    ref, _, _ = run_reference(CheckpointCase(fsdp=2, **SHORT), ckpt_lib.consolidate(saved / STEP2, tmp_path / "one.ckpt"),
                              steps=SHORT["steps"])
    assert_same(ref["params"], uninterrupted, RESHARD, "pp2 x fsdp2 -> one device")


def consolidated_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The plain module's parameters and name-keyed optimizer state, from a checkpoint through consolidate."""
    model = ToyRegressor(optimizer="adamw")
    ckpt = ckpt_lib.consolidated(path)
    model.load_state_dict(ckpt["state_dict"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    opt.load_state_dict(ckpt["optimizer_states"][0])
    return {k: p.detach() for k, p in model.named_parameters()}, optimizer_by_name(model, opt)


@pytest.mark.timeout(600)
def test_pipeline2_x_replicas2_x_fsdp2_matches_single_device(pp2_fsdp2: dict[str, Any], tmp_path: Path) -> None:
    """HSDP on 8 ranks: reduce-scatter over the shard dimension, all-reduce over replicas. Its checkpoints (whole
    tensors gathered over the 2-D mesh) resume exactly, and a pipeline 2 x FSDP 2 checkpoint loads into it."""
    case = TrainingCase(schedule="1f1b", dp=2, fsdp=2, acc=2, clip=0.05, optimizer="adamw", validate=False)
    saved = tmp_path / "hsdp"
    runs: list[tuple[str, Any]] = [
        ("training", case),
        ("ckpt_train", CheckpointCase(dp=2, fsdp=2, steps=4, steps_per_epoch=2, dir=str(saved),
                                      resume_from=str(saved / STEP2))),
        ("ckpt_resume", CheckpointCase(dp=2, fsdp=2, resume_from=str(pp2_fsdp2["saved"] / STEP2), **SHORT)),
    ]
    res = launch_runs(8, runs, tmp_path / "out", timeout=400)
    assert_case_parity(res, 0, case)
    for rank in res:
        assert_same(rank[1]["resumed"]["params"], rank[1]["full"]["params"], EXACT, "HSDP resumed")
    params, optim = consolidated_state(pp2_fsdp2["saved"] / STEP2)
    for dp_rank in range(4):
        assert_same(merge_replica(res, 2, dp_rank, key="start_params"), params, 0, "pp2 x fsdp2 -> HSDP params")
        assert_same(merge_replica(res, 2, dp_rank, key="start_optim"), optim, 0, "pp2 x fsdp2 -> HSDP optimizer")
