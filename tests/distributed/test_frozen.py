"""Frozen layers and stages with nothing to train (issue 23): a LoRA Llama through ``HFCausalLM`` (base frozen,
adapters on q/v, the optimizer over ``requires_grad`` parameters only) against the same module on one device:
every parameter after several AdamW steps, the frozen ones bit-identical to their initial values."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pipe.checkpoint import consolidated
from tests.distributed.launcher import launch
from tests.distributed.parity import ATOL, merge_replica
from tests.distributed.scenarios.frozen import FrozenCase, LoRALlama, run_frozen
from tests.torch_tiers import refused

pytest.importorskip("transformers")

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

FP16_TOL = 2 * 2**-11  # fp16 compute, fp32 master weights: 2 ulps of fp16, as in test_precision.py


def check_parity(results: list[list[dict[str, Any]]], index: int, case: FrozenCase) -> None:
    tol = FP16_TOL if case.precision == "16-mixed" else ATOL
    ref = run_frozen(case, pipeline=False)
    assert not ref["frozen_changed"]
    for rank, rank_results in enumerate(results):
        got = rank_results[index]
        assert got["ok"], (case, rank, got)
        assert got["frozen_changed"] == [], f"{case} rank {rank}: frozen parameters moved: {got['frozen_changed']}"
        if case.dp * case.fsdp == 1:  # (a replica logs its own token-weighted loss, not the global batch's)
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][-len(got["losses"]):]),
                                       atol=tol, rtol=0)
        assert got["lrs"] == ref["lrs"][-len(got["lrs"]):], (case, rank, got["lrs"], ref["lrs"])  # (resumed: the last)
    for dp_rank in range(case.dp * case.fsdp):
        params = merge_replica(results, index, dp_rank)
        assert sorted(params) == sorted(ref["params"]), f"{case}: {set(params) ^ set(ref['params'])}"
        for name, want in ref["params"].items():
            torch.testing.assert_close(params[name], want, atol=tol, rtol=0,
                                       msg=lambda m, name=name, d=dp_rank: f"{case} replica {d} {name}: {m}")
    # requires_grad as built, wherever the layers went (rebalancing): q and v adapters, (a, b) each, per LoRA layer
    held = sum(r[index]["trainable"] for r in results if r[index]["topology"][0] == 0)
    assert held == 4 * len(case.lora_layers) * (2 if case.schedule == "chimera" else 1), (case, held)
    moved = [n for n in ref["params"] if "lora" in n]
    assert moved and ref["losses"][0] != ref["losses"][-1]


@pytest.mark.timeout(600)
def test_lora_llama_with_frozen_stages_matches_one_device(tmp_path) -> None:
    """One 4-rank launch. GPipe p=4: the last stage holds only the frozen norm and head (its optimizer over
    ``requires_grad`` parameters is empty). 1F1B p=2 x dp 2: the first stage holds only the frozen embedding (its
    output needs no gradient). ZB-V and Chimera with a rank of frozen layers; clipping, fp16, accumulation, empty
    param groups, an LR scheduler, FSDP2, a stage without parameters, a checkpoint saved and resumed into another
    split and consolidated, rebalancing into a rank whose optimizer was empty; PipeDream / 2BW; two refusals."""
    ckpt = str(tmp_path / "ckpt")
    cases = [
        FrozenCase(),
        FrozenCase(schedule="1f1b", dp=2, partition=[1, 5], scheduler=True),
        FrozenCase(schedule="1f1b", dp=2, partition=[4, 2]),  # a frozen last stage (norm, head) under 1F1B x dp 2
        # rank 1: decoders 1, 2, frozen (torch 2.11 / 2.12 refuse the split backward: tests/torch_tiers.py)
        *([] if refused("split_backward") else [
            FrozenCase(schedule="zbv", dp=2, stages_per_rank=2, lora_layers=(0,))]),
        # param groups empty on some ranks, an LR scheduler, clipping by the global norm (SGD: clipping shows)
        FrozenCase(optimizer="groups", scheduler=True, clip=0.05),
        FrozenCase(optimizer="sgd", lr=0.2, clip=0.05, acc=2),
        FrozenCase(schedule="1f1b", dp=2, partition=[1, 5], optimizer="sgd", lr=0.2, clip=0.002, clip_algo="value",
                   precision="16-mixed"),
        # FSDP2 over a stage of frozen layers (norm, head)
        FrozenCase(schedule="1f1b", fsdp=2, partition=[4, 2]),
        # saved with the last rank's optimizer empty (p=4), resumed where the first rank holds only the embedding
        FrozenCase(steps=4, scheduler=True, ckpt=ckpt, save=True),
        FrozenCase(steps=6, scheduler=True, ckpt=ckpt, resume=True, partition=[1, 2, 1, 2]),
        # rebalancing: the slow (frozen) head pulls layers to stage 0, whose optimizer was empty (only decoder 1
        # has adapters): frozen and trainable weights move, with their optimizer state
        FrozenCase(schedule="1f1b", dp=2, partition=[2, 4], lora_layers=(1,), slow_head_s=0.03, rebalance_every=2,
                   steps=4),
        # a last stage without any parameter: p=4, and p=2 under data parallelism and FSDP
        FrozenCase(tail=True, partition=[3, 1, 2, 1], clip=0.05, optimizer="sgd", lr=0.2),
        FrozenCase(schedule="1f1b", tail=True, dp=2, partition=[6, 1]),
        FrozenCase(schedule="1f1b", tail=True, fsdp=2, partition=[6, 1]),
        # Chimera (synchronous: parity): rank 1 holds stages 1 and 2 of both pipelines, decoders 1, 2, frozen
        FrozenCase(schedule="chimera", lora_layers=(0,)),
    ]
    # asynchronous schedules (their own optimizer handling): no one-device parity, but nothing frozen moves
    unsynced = [FrozenCase(schedule="pipedream", lr=1e-3), FrozenCase(schedule="pipedream_2bw", lr=1e-3)]
    # refused at setup, on every rank: no optimizer (None: nor its scheduler) on the frozen stage; nothing to train
    refusals = [FrozenCase(optimizer="none_if_empty", scheduler=True, steps=1, expect_error=True),
                FrozenCase(lora_layers=(), steps=1, expect_error=True)]
    results = launch("frozen", 4, cases + unsynced + refusals, tmp_path / "run", timeout=540)
    for rank_results in results:
        assert rank_results[0]["trainable"] == (0 if rank_results[0]["topology"][1] == 3 else 4)
    for i, case in enumerate(cases):
        check_parity(results, i, case)
    start = {n: p for n, p in LoRALlama(FrozenCase()).named_parameters()}
    for index in range(len(cases), len(cases) + len(unsynced)):
        for rank_results in results:
            got = rank_results[index]
            assert got["ok"] and got["frozen_changed"] == [], got
            assert all(not torch.equal(p, start[n]) for n, p in got["params"].items() if "lora" in n)
    for rank_results in results:
        counts, frozen = (rank_results[len(cases) + len(unsynced) + i] for i in range(2))
        assert not counts["ok"] and "rank 3 (stage 3, layers 4-5): 1 optimizer(s), 0 scheduler(s)" in counts[
            "error"] and "rank 0 (stage 0, layers 0-1): 1 optimizer(s), 1 scheduler(s)" in counts["error"], counts
        assert not frozen["ok"] and "requires_grad=True" in frozen["error"], frozen
    # the checkpoint, consolidated to one file: the frozen weights as they started, optimizer state for the adapters
    single = consolidated(f"{ckpt}/end.ckpt")
    assert sorted(single["state_dict"]) == sorted(start)
    for name, p in start.items():
        if not p.requires_grad:
            assert torch.equal(single["state_dict"][name], p), name
    lora = [n for n, p in start.items() if p.requires_grad]
    (opt,) = single["optimizer_states"]
    assert len(opt["state"]) == len(lora) == 12 and sum(len(g["params"]) for g in opt["param_groups"]) == 12
    # rebalancing moved layers (frozen ones and the adapters of decoder 1) to the stage whose optimizer was empty
    moves = results[0][next(i for i, c in enumerate(cases) if c.rebalance_every)]["moves"]
    assert moves and all(dst == 0 for _, _, dst in moves) and 2 in [layer for layer, _, _ in moves], moves
