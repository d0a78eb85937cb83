"""The seed schedules under the strategy vs one-process references of exactly their semantics.

PipeDream-2BW: ``W(b+1) = W(b) - update(mean_j grad f_{b,j}(W(b-1)))``, ``W(-1) = W(0)`` ([Note: PipeDream-2BW
semantics] in lightning_pipe/schedules/pipedream/spec.py). The reference below is a plain torch loop: gradients taken with
``torch.func.functional_call`` on the stashed weights, applied by the model's own optimizer (and scheduler) to the live
ones. The same loop with no delay is synchronous training: a 1F1B run must match it (so the harness is right) and a
2BW run must not (so the 2BW test can fail).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.func import functional_call

from tests.distributed.launcher import launch
from tests.distributed.scenarios import TrainingCase
from tests.distributed.scenarios.training import DATA, MODELS
from tests.models import loader, reference_train_loader, regression_data

pytestmark = [pytest.mark.parity, pytest.mark.distributed]


def delayed_reference(case: TrainingCase, delay: int) -> dict[str, torch.Tensor]:
    """Train ``case``'s model on one process, every batch's gradient taken on the weights of ``delay`` (0 or 1)
    optimizer steps earlier (``W(-1) = W(0)``); an optimizer step spans ``case.acc`` batches."""
    torch.manual_seed(1234)  # as run_training: the same initial weights
    model = MODELS[case.model](case)
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    params = dict(model.named_parameters())
    data = DATA.get(case.model, regression_data)(case.n_data)
    batches = iter(reference_train_loader(data, case.batch * case.dp))
    stash = {name: p.detach().clone() for name, p in params.items()}
    for _ in range(case.steps):
        optimizer.zero_grad()
        for _ in range(case.acc):
            x, y = model.split_batch(next(batches))
            version = {name: (stash[name] if delay else p.detach()).clone().requires_grad_()
                       for name, p in params.items()}
            loss = model.loss_fn(functional_call(model, version, (x,)), y) / case.acc
            for p, grad in zip(params.values(), torch.autograd.grad(loss, list(version.values()))):
                p.grad = grad if p.grad is None else p.grad + grad
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        stash = {name: p.detach().clone() for name, p in params.items()}  # W(b), before the update
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def stashed_weights(case: TrainingCase) -> dict[str, torch.Tensor]:
    """W(steps - 1): the weights the last batch trained on (``delayed_reference`` one step shorter)."""
    return delayed_reference(TrainingCase(**{**case.__dict__, "steps": case.steps - 1}), delay=1)


def validation_loss(case: TrainingCase, params: dict[str, torch.Tensor]) -> float:
    """What trainer.validate logs for these weights: the mean loss of the first 3 validation batches (equal sizes)."""
    torch.manual_seed(1234)
    model = MODELS[case.model](case)
    model.load_state_dict(params, strict=False)
    losses = []
    with torch.no_grad():
        for batch in itertools.islice(loader(regression_data(case.n_data), case.batch), 3):
            x, y = model.split_batch(batch)
            losses.append(float(model.loss_fn(model(x), y)))
    return sum(losses) / len(losses)


def max_difference(rank_params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((value - reference[name]).abs().max()) for name, value in rank_params.items())


def check(results: list[list[dict[str, Any]]], index: int, case: TrainingCase, delay: int) -> None:
    reference = delayed_reference(case, delay)
    control = delayed_reference(case, 1 - delay)
    seen = set()
    for rank_results in results:
        params = rank_results[index]["params"]
        seen |= set(params)
        for name, value in params.items():
            torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        # the other semantics is far away: the comparison above can fail
        assert max_difference(params, control) > 1e-4, f"case {index}: delay {delay} and {1 - delay} agree"
    assert seen == set(reference), f"case {index}: parameters held by no rank: {set(reference) - seen}"


@pytest.mark.timeout(420)
def test_pipedream_2bw_matches_its_one_process_reference(tmp_path) -> None:
    """2 stages, 3 batches of 4 micro-batches: SGD with momentum; AdamW with a per-step scheduler, clipping and 2
    accumulated batches per step (the stash is refreshed once per optimizer step); tied weights; the recipe's GPT.
    1F1B against the same loop with no delay checks the reference itself."""
    cases = [
        # validation during fit (after batch 2) and after it: evaluation runs on the live weights
        TrainingCase(schedule="pipedream_2bw", steps=3),
        TrainingCase(schedule="pipedream_2bw", steps=3, acc=2, clip=0.05, optimizer="adamw", validate=False),
        TrainingCase(schedule="1f1b", steps=3, validate=False),
        # a weight tied across the first and the last stage (two stashes, gradients summed before the step)
        TrainingCase(schedule="pipedream_2bw", steps=3, tied=True, optimizer="adamw", validate=False),
        # the GPT recipe's model: tied embedding/head, its own AdamW with warm-up
        TrainingCase(model="gpt", n_layers=5, schedule="pipedream_2bw", steps=3, tied=True, optimizer="adamw",
                     validate=False),
    ]
    results = launch("training", 2, cases, tmp_path, timeout=360)
    for index, case in enumerate(cases):
        check(results, index, case, delay=0 if case.schedule == "1f1b" else 1)
    expected = validation_loss(cases[0], delayed_reference(cases[0], delay=1))
    stale = validation_loss(cases[0], stashed_weights(cases[0]))
    for rank_results in results:
        assert rank_results[0]["val_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert abs(rank_results[0]["val_loss"] - stale) > 1e-4  # not the version the last batch trained on


@pytest.mark.timeout(420)
def test_pipedream_2bw_with_data_parallel_matches_its_reference(tmp_path) -> None:
    """2 replicas x 2 stages: the replicas average gradients taken on the same stashed version (AdamW, clipping)."""
    cases = [TrainingCase(schedule="pipedream_2bw", dp=2, steps=3, clip=0.05, optimizer="adamw", validate=False)]
    results = launch("training", 4, cases, tmp_path, timeout=360)
    check(results, 0, cases[0], delay=1)
    # averaged as each stage's last backward moved its gradients from the stash (lightning_pipe/parallel/dp_overlap.py)
    assert all(rank[0]["dp_sync"] == {"overlapped": 3, "after_schedule": 0} for rank in results)
