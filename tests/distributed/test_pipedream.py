"""PipeDream (weight stashing) under the strategy vs a one-process reference of exactly its semantics.

The reference is plain torch on the whole model cut into the same stage chunks, independent of the stage code: for
each micro-batch j of batch b it runs every stage's layers (``functional_call``) on that stage's weight version
``b * m + max(0, j - min(m, p - s) + 1)`` ([Note: PipeDream version formula] in lightning_pipe/schedules/pipedream/stages.py), takes the
gradient of micro-batch j's mean loss (averaged over replicas; tied uses summed), clips each stage's gradients by
that stage's own norm (a weight tied across stages by its own norm) or by value, and steps the model's own optimizer once; its scheduler steps once per batch. The ranks
record which version each of their forwards used: it must equal the formula. Control: the same loop without
staleness (every micro-batch on the latest weights) and synchronous mini-batch training must both be far away.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.func import functional_call

from lightning_pipe.layers.partition import partition_layers
from lightning_pipe.layers.stages import layer_args
from lightning_pipe.schedules.pipedream.stages import pipedream_max_stashes, pipedream_version
from tests.distributed.launcher import launch, launch_runs
from tests.distributed.scenarios import CheckpointCase, TrainingCase
from tests.distributed.scenarios.training import DATA, MODELS
from tests.distributed.test_checkpoint import STEP4
from tests.distributed.test_seed_schedules import delayed_reference, max_difference, validation_loss
from tests.models import reference_train_loader, regression_data

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

P = 2


def reference_setup(case: TrainingCase, p: int) -> tuple[Any, Any, Any, list[Any], list[range], list[list[Any]]]:
    """The one-process references' start: ``case``'s model with run_pipedream's initial weights, its optimizer and
    scheduler, its layers, the uniform split into ``p`` stages and each stage's parameters (a tie counted once)."""
    torch.manual_seed(1234)  # as run_pipedream: the same initial weights
    model = MODELS[case.model](case)
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    layers = list(model.layers)
    ranges = partition_layers(len(layers), p, "uniform")
    stage_params = [list({id(q): q for i in r for q in layers[i].parameters()}.values()) for r in ranges]
    return model, optimizer, scheduler, layers, ranges, stage_params


def pipedream_reference(case: TrainingCase, p: int = P, stale: bool = True) -> dict[str, torch.Tensor]:
    """Train ``case``'s model on one process with PipeDream's per-micro-batch updates (``stale=False``: every
    micro-batch on the latest weights, i.e. plain sequential per-micro-batch training)."""
    model, optimizer, scheduler, layers, ranges, stage_params = reference_setup(case, p)
    holders: dict[int, int] = {}
    for ps in stage_params:
        for q in ps:
            holders[id(q)] = holders.get(id(q), 0) + 1
    shared = {k for k, n in holders.items() if n > 1}  # tied across stages
    tied = [q for q in model.parameters() if id(q) in shared]
    history = [{id(q): q.detach().clone() for q in model.parameters()}]  # history[v]: the weights after v updates
    m, dp = case.microbatches, case.dp
    assert m is not None
    batches = iter(reference_train_loader(DATA.get(case.model, regression_data)(case.n_data), case.batch * dp))
    for b in range(case.steps):
        x, y = model.split_batch(next(batches))
        for j in range(m):
            grads: dict[int, torch.Tensor] = {}
            for d in range(dp):  # replica d reads rows d::dp (DistributedSampler), its micro-batch j
                hidden, target = x[d::dp].chunk(m)[j], y[d::dp].chunk(m)[j]
                leaves: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
                for s, r in enumerate(ranges):
                    version = history[pipedream_version(s, p, m, b, j) if stale else b * m + j]
                    for i in r:
                        named = list(layers[i].named_parameters(remove_duplicate=False))
                        tensors = {n: version[id(q)].clone().requires_grad_() for n, q in named}
                        leaves += [(q, tensors[n]) for n, q in named]
                        hidden = functional_call(layers[i], tensors, layer_args(hidden), tie_weights=False)
                loss = model.loss_fn(hidden, target)
                for (q, _), g in zip(leaves, torch.autograd.grad(loss, [t for _, t in leaves])):
                    grads[id(q)] = grads.get(id(q), 0) + g / dp
            for q in model.parameters():
                q.grad = grads.get(id(q))
            if case.clip is not None:
                # [Note: clipping a tied weight under PipeDream]: a weight of several stages by its own norm (once:
                # here it is one tensor; under the pipeline every holder clips its equal copy alike)
                for params in [[q for q in ps if id(q) not in shared] for ps in stage_params] + [[q] for q in tied]:
                    if case.clip_algo == "value":
                        torch.nn.utils.clip_grad_value_(params, case.clip)
                    else:
                        torch.nn.utils.clip_grad_norm_(params, case.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append({id(q): q.detach().clone() for q in model.parameters()})
        if scheduler is not None:
            scheduler.step()
    return {name: q.detach().clone() for name, q in model.named_parameters(remove_duplicate=False)}


def check(results: list[list[dict[str, Any]]], index: int, case: TrainingCase) -> None:
    reference = pipedream_reference(case)
    controls = {"no staleness": pipedream_reference(case, stale=False), "synchronous": delayed_reference(case, 0)}
    m = case.microbatches
    assert m is not None
    seen = set()
    for rank_results in results:
        out = rank_results[index]
        s = out["pp_rank"]
        expected = [[(j, pipedream_version(s, P, m, b, j)) for j in range(m)] for b in range(case.steps)]
        assert [[tuple(v) for v in batch] for batch in out["versions"]] == expected, f"case {index}, stage {s}"
        assert out["max_stashes"] == pipedream_max_stashes(s, P, m)
        assert out["global_step"] == case.steps  # batches, not updates
        for name, value in out["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-6,
                                       msg=lambda msg, name=name: f"case {index}, {name}: {msg}")
        seen |= set(out["params"])
        for what, control in controls.items():  # the comparison above can fail
            assert max_difference(out["params"], control) > 1e-4, f"case {index}: PipeDream equals {what} training"
    assert seen == set(reference), f"case {index}: parameters held by no rank: {set(reference) - seen}"


@pytest.mark.timeout(420)
def test_pipedream_matches_its_one_process_reference(tmp_path) -> None:
    """2 stages, 3 batches of 4 micro-batches: SGD with momentum (validation during and after fit sees the live
    weights); AdamW with a per-batch scheduler and per-stage clipping; the recipe's GPT (embedding tied to the head
    across the stages); a tied weight under per-stage clipping (by norm, by value). Then every setting the schedule refuses, with its message, on every rank; and an exact
    resume from a checkpoint written mid-run, also under PipeDream-2BW."""
    cases = [
        TrainingCase(schedule="pipedream", steps=3),
        TrainingCase(schedule="pipedream", steps=3, clip=0.05, optimizer="adamw", validate=False),
        TrainingCase(model="gpt", n_layers=5, schedule="pipedream", steps=3, tied=True, optimizer="adamw",
                     validate=False),
        TrainingCase(schedule="pipedream", steps=1, acc=2, validate=False, expect_error=True),
        # a weight tied across the stages, clipped by its own norm on both ([Note: clipping a tied weight under
        # PipeDream]); then by value (elementwise: alike on every copy)
        TrainingCase(schedule="pipedream", steps=2, tied=True, clip=0.05, optimizer="adamw", validate=False),
        TrainingCase(schedule="pipedream", steps=2, tied=True, clip=0.002, clip_algo="value", optimizer="adamw",
                     validate=False),
        TrainingCase(schedule="pipedream", steps=1, precision="16-mixed", validate=False, expect_error=True),
    ]
    # then, in the same processes: 8 batches with a checkpoint after 4, and a run resumed from it; the same under
    # PipeDream-2BW, whose next batch runs on the stash the checkpoint holds ([Note: stage state in checkpoints])
    resumes = [CheckpointCase(schedule=name, dir=str(tmp_path / name), resume_from=str(tmp_path / name / STEP4))
               for name in ("pipedream", "pipedream_2bw")]
    results = launch_runs(P, [*(("pipedream", case) for case in cases), *(("ckpt_train", r) for r in resumes)],
                          tmp_path / "out", timeout=360)
    for index in (0, 1, 2, 4, 5):
        check(results, index, cases[index])
    lrs = [rank_results[1]["lrs"] for rank_results in results]
    assert lrs[0] == lrs[1] and len(set(lrs[0])) == 3  # AdamW's StepLR: once per batch, not per update
    expected = validation_loss(cases[0], pipedream_reference(cases[0]))
    for rank_results in results:  # resumed == uninterrupted (PipeDream: between batches a stage holds no stash)
        for run in rank_results[len(cases):]:
            full, resumed = run["full"], run["resumed"]
            assert resumed["global_step"] == 8
            for name, value in resumed["params"].items():
                torch.testing.assert_close(value, full["params"][name], rtol=0, atol=1e-6)
    for rank_results in results:
        assert rank_results[0]["val_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        # Lightning's hooks around its (skipped) optimizer step: zero_grad and backward once per batch, no
        # on_before_optimizer_step ([Note: PipeDream in Lightning's loop])
        calls = rank_results[0]["calls"]
        assert (calls.get("on_before_zero_grad"), calls.get("on_after_backward")) == (3, 3), calls
        assert "on_before_optimizer_step" not in calls, calls
        refusals = [rank_results[i] for i in (3, 6)]
        assert all(not r["ok"] for r in refusals), refusals
        for refusal, words in zip(refusals, [("accumulate_grad_batches=2", "`accumulate_grad_batches`"),
                                             ("precision='16-mixed'", "trainer.precision", "bf16-mixed")]):
            for word in words:
                assert word in refusal["error"], refusal["error"]


@pytest.mark.timeout(420)
def test_pipedream_with_data_parallel_matches_its_reference(tmp_path) -> None:
    """2 replicas x 2 stages: every update averages micro-batch j's gradient over the replicas (AdamW, clipping)."""
    cases = [TrainingCase(schedule="pipedream", dp=2, steps=2, clip=0.05, optimizer="adamw", validate=False)]
    check(launch("pipedream", 4, cases, tmp_path, timeout=360), 0, cases[0])
