"""Frozen layers and stages with nothing to train (issue 23): a LoRA Llama through ``HFCausalLM`` (base frozen,
adapters on q/v, the optimizer over ``requires_grad`` parameters only) against the same module on one device:
every parameter after several AdamW steps, the frozen ones bit-identical to their initial values."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.launcher import launch
from tests.distributed.parity import ATOL, merge_replica
from tests.distributed.scenarios.frozen import FrozenCase, run_frozen
from tests.distributed.test_precision import FP16_TOL

pytest.importorskip("transformers")

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


def check_parity(results: list[list[dict[str, Any]]], index: int, case: FrozenCase) -> None:
    tol = FP16_TOL if case.precision == "16-mixed" else ATOL  # fp16 compute, fp32 master weights (test_precision)
    ref = run_frozen(case, pipeline=False)
    assert not ref["frozen_changed"]
    for rank, rank_results in enumerate(results):
        got = rank_results[index]
        assert got["ok"], (case, rank, got)
        assert got["frozen_changed"] == [], f"{case} rank {rank}: frozen parameters moved: {got['frozen_changed']}"
        if case.dp == 1:  # (a replica logs its own token-weighted loss, not the global batch's)
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=tol, rtol=0)
        assert got["lrs"] == ref["lrs"], (case, rank, got["lrs"], ref["lrs"])
    for dp_rank in range(case.dp * case.fsdp):
        params = merge_replica(results, index, dp_rank)
        assert sorted(params) == sorted(ref["params"]), f"{case}: {set(params) ^ set(ref['params'])}"
        for name, want in ref["params"].items():
            torch.testing.assert_close(params[name], want, atol=tol, rtol=0,
                                       msg=lambda m, name=name: f"{case} replica {dp_rank} {name}: {m}")
    moved = [n for n in ref["params"] if "lora" in n]
    assert moved and ref["losses"][0] != ref["losses"][-1]


@pytest.mark.timeout(600)
def test_lora_llama_with_frozen_stages_matches_one_device(tmp_path) -> None:
    """4 ranks. GPipe p=4: the last stage holds only the frozen norm and head. 1F1B p=2 x dp 2: the first stage
    holds only the frozen embedding (its output needs no gradient)."""
    cases = [
        FrozenCase(),
        FrozenCase(schedule="1f1b", dp=2, partition=[1, 5], scheduler=True),
        FrozenCase(schedule="zbv", dp=2, stages_per_rank=2, lora_layers=(0,)),  # rank 1: decoders 1, 2, frozen
        # param groups empty on some ranks, an LR scheduler, clipping by the global norm (SGD: clipping shows)
        FrozenCase(optimizer="groups", scheduler=True, clip=0.05),
        FrozenCase(optimizer="sgd", lr=0.2, clip=0.05),
        FrozenCase(schedule="1f1b", dp=2, partition=[1, 5], optimizer="sgd", lr=0.2, clip=0.002, clip_algo="value",
                   precision="16-mixed"),
    ]
    results = launch("frozen", 4, cases, tmp_path / "run", timeout=540)
    for rank_results in results:
        assert rank_results[0]["trainable"] == (0 if rank_results[0]["topology"][1] == 3 else 4)
    for i, case in enumerate(cases):
        check_parity(results, i, case)
