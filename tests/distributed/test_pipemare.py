"""PipeMare under the strategy vs a one-process reference of exactly its rule ([Note: PipeMare] in
lightning_pipe/schedules/pipemare/rule.py).

The reference is plain torch on the whole model cut into the same stage chunks, independent of the stage code: for
micro-batch j of batch b it runs every stage's layers (``functional_call``) on clones of that stage's forward
version ``b*m + max(0, j - min(m, p - s) + 1)``, then, before differentiating, overwrites those clones in place
through ``.data`` (no autograd version bump) with the backward's weights: the current ones, ``b*m + j`` updates,
minus ``tau * delta_s`` with discrepancy correction. It applies each stage's gradient with the model's own
optimizer at that stage's learning-rate factor (the other stages' gradients set to ``None``, so the step skips
them), updates ``delta_s`` (``gamma*delta - (1-gamma)*W(k)`` before the step, ``+ (1-gamma)*W(k+1)`` after it: the
EMA in the stage's order of float operations, which AdamW's normalisation of near-zero gradients would otherwise
amplify past 1e-6), and steps the scheduler once per batch. Three ranks, so stage 0's delay reaches 2 and
the learning-rate factor acts. Controls: PipeDream's reference (the backward on the forward's weights, the same
plain learning rate), synchronous training, and the same rule with the techniques off must all be far away.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.func import functional_call

from lightning_pipe.layers.stages import layer_args
from lightning_pipe.schedules.pipemare.rule import (
    PipeMareRule,
    backward_version,
    forward_version,
    rule_from_options,
    stage_delay,
)
from tests.distributed.launcher import launch_runs
from tests.distributed.scenarios import CheckpointCase, TrainingCase
from tests.distributed.scenarios.training import DATA
from tests.distributed.test_checkpoint import STEP4
from tests.distributed.test_pipedream import pipedream_reference, reference_setup
from tests.distributed.test_seed_schedules import delayed_reference, max_difference, validation_loss
from tests.models import reference_train_loader, regression_data

pytestmark = [pytest.mark.parity, pytest.mark.distributed]

P = 3


def pipemare_reference(case: TrainingCase, rule: PipeMareRule, p: int = P) -> dict[str, torch.Tensor]:
    """Train ``case``'s model on one process with PipeMare's rule (one replica)."""
    model, optimizer, scheduler, layers, ranges, stage_params = reference_setup(case, p)
    owner: dict[int, int] = {}  # a weight tied across stages is stepped once (the copies stay equal)
    for s, params in enumerate(stage_params):
        for q in params:
            owner.setdefault(id(q), s)
    delta = [{id(q): torch.zeros_like(q) for q in params} for params in stage_params]
    history = [{id(q): q.detach().clone() for q in model.parameters()}]  # history[v]: the weights after v updates
    m = case.microbatches
    assert m is not None and case.dp == 1
    batches = iter(reference_train_loader(DATA.get(case.model, regression_data)(case.n_data), case.batch))
    for b in range(case.steps):
        x, y = model.split_batch(next(batches))
        for j in range(m):
            hidden, target = x.chunk(m)[j], y.chunk(m)[j]
            leaves: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
            later: list[tuple[torch.Tensor, torch.Tensor]] = []  # (forward clone, the backward's weights)
            vb = backward_version(m, b, j)
            for s, r in enumerate(ranges):
                vf = forward_version(s, p, m, b, j)
                tau = vb - vf
                for i in r:
                    named = list(layers[i].named_parameters(remove_duplicate=False))
                    tensors = {n: history[vf][id(q)].clone().requires_grad_() for n, q in named}
                    leaves += [(q, tensors[n]) for n, q in named]
                    for n, q in named:
                        current = history[vb][id(q)]
                        corrected = current if rule.decay is None or tau == 0 else torch.add(
                            current, delta[s][id(q)], alpha=-tau)
                        later.append((tensors[n], corrected))
                    hidden = functional_call(layers[i], tensors, layer_args(hidden), tie_weights=False)
            loss = model.loss_fn(hidden, target)
            for clone, weights in later:  # the backward reads the weights in memory now, not the forward's
                clone.data.copy_(weights)
            grads: dict[int, torch.Tensor] = {}
            for (q, _), g in zip(leaves, torch.autograd.grad(loss, [t for _, t in leaves])):
                grads[id(q)] = grads.get(id(q), 0) + g
            for s, params in enumerate(stage_params):
                gamma = rule.gamma(stage_delay(s, p, m))
                if gamma is not None:  # delta's EMA step, in the stage's order of float operations
                    for q in params:
                        delta[s][id(q)].mul_(gamma).sub_(q.detach(), alpha=1 - gamma)
                for q in model.parameters():
                    q.grad = grads.get(id(q)) if owner.get(id(q)) == s else None
                if case.clip is not None:
                    torch.nn.utils.clip_grad_norm_([q for q in params if owner[id(q)] == s], case.clip)
                tau = vb - forward_version(s, p, m, b, j)
                rates = [group["lr"] for group in optimizer.param_groups]
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * rule.lr_factor(tau, vb)
                optimizer.step()
                for group, rate in zip(optimizer.param_groups, rates):
                    group["lr"] = rate
                optimizer.zero_grad(set_to_none=True)
                if gamma is not None:  # = gamma * delta + (1 - gamma) * (W(k+1) - W(k))
                    for q in params:
                        delta[s][id(q)].add_(q.detach(), alpha=1 - gamma)
            history.append({id(q): q.detach().clone() for q in model.parameters()})
        if scheduler is not None:
            scheduler.step()
    return {name: q.detach().clone() for name, q in model.named_parameters(remove_duplicate=False)}


def check(results: list[list[dict[str, Any]]], index: int, case: TrainingCase) -> None:
    rule = rule_from_options(case.schedule_options or {})
    reference = pipemare_reference(case, rule)
    controls = {"PipeDream": pipedream_reference(case, p=P), "synchronous": delayed_reference(case, 0)}
    if rule != PipeMareRule(None, None):
        controls["PipeMare without its techniques"] = pipemare_reference(case, PipeMareRule(None, None))
    m = case.microbatches
    assert m is not None
    seen = set()
    for rank_results in results:
        out = rank_results[index]
        assert out["ok"], out
        s = out["pp_rank"]
        expected = [[(j, forward_version(s, P, m, b, j), backward_version(m, b, j)) for j in range(m)]
                    for b in range(case.steps)]
        assert [sorted(tuple(v) for v in batch) for batch in out["versions"]] == expected, f"case {index}, stage {s}"
        factors = [rule.lr_factor(backward_version(m, b, j) - forward_version(s, P, m, b, j), b * m + j)
                   for b in range(case.steps) for j in range(m)]
        assert out["lr_factors"] == pytest.approx(factors, rel=1e-12), f"case {index}, stage {s}"
        assert out["global_step"] == case.steps  # batches, not updates
        for name, value in out["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-6,
                                       msg=lambda msg, name=name: f"case {index}, {name}: {msg}")
        seen |= set(out["params"])
        for what, control in controls.items():  # the comparison above can fail
            assert max_difference(out["params"], control) > 1e-4, f"case {index}: PipeMare equals {what} training"
    assert seen == set(reference), f"case {index}: parameters held by no rank: {set(reference) - seen}"


CASES = [
    # SGD with momentum, both techniques, a short warm-up (12 updates: the factor anneals within the run)
    TrainingCase(schedule="pipemare", steps=3, schedule_options={"lr_reschedule": 8, "discrepancy_correction": True}),
    # AdamW + per-batch StepLR + per-stage clipping, both techniques off: the bare asynchronous rule
    TrainingCase(schedule="pipemare", steps=3, clip=0.05, optimizer="adamw", validate=False,
                 schedule_options={"lr_reschedule": False, "discrepancy_correction": False}),
    # AdamW, each technique alone
    TrainingCase(schedule="pipemare", steps=3, optimizer="adamw", validate=False,
                 schedule_options={"lr_reschedule": 6, "discrepancy_correction": False}),
    TrainingCase(schedule="pipemare", steps=3, optimizer="adamw", validate=False,
                 schedule_options={"lr_reschedule": False, "discrepancy_correction": 0.5}),
    # the recipe's GPT, its embedding tied to the head across stages 0 and 2, correction on
    TrainingCase(model="gpt", n_layers=5, schedule="pipemare", steps=2, tied=True, optimizer="adamw", validate=False,
                 schedule_options={"lr_reschedule": False}),
]
REFUSED = [
    (TrainingCase(schedule="pipemare", steps=1, precision="bf16-mixed", validate=False, expect_error=True),
     ("precision='bf16-mixed'", "cast copies", "trainer.precision")),
    (TrainingCase(model="gpt", n_layers=5, schedule="pipemare", steps=1, tied=True, optimizer="adamw",
                  validate=False, expect_error=True),  # lr_reschedule on by default: the tied copies' rates differ
     ("lr_reschedule", "tied", "schedule.options")),
]
# PipeDream on the same model: its stashes, against PipeMare's weight copies
STASHING = TrainingCase(schedule="pipedream", steps=1, validate=False)


@pytest.mark.timeout(420)
def test_pipemare_matches_its_one_process_reference(tmp_path) -> None:
    """3 stages, 3 batches of 4 micro-batches: the cases above, then the settings the schedule refuses (each with its
    message, on every rank), PipeDream's stashes on the same model against PipeMare's copies, and a resume."""
    # resumed after 4 of 8 batches == uninterrupted: the learning-rate annealing continues from global_step * m,
    # the correction from the checkpoint's delta ([Note: stage state in checkpoints])
    resume = CheckpointCase(schedule="pipemare", microbatches=4, dir=str(tmp_path / "ckpt"),
                            resume_from=str(tmp_path / "ckpt" / STEP4),
                            schedule_options={"lr_reschedule": 40, "discrepancy_correction": True})
    runs = [*(("pipedream", case) for case in CASES), *(("pipedream", case) for case, _ in REFUSED),
            ("pipedream", STASHING), ("ckpt_train", resume)]
    results = launch_runs(P, runs, tmp_path / "out", timeout=360)
    for index, case in enumerate(CASES):
        check(results, index, case)
    expected = validation_loss(CASES[0], pipemare_reference(CASES[0], rule_from_options(CASES[0].schedule_options or {})))
    for rank_results in results:
        assert rank_results[0]["val_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)  # the live weights
        for offset, (_, words) in enumerate(REFUSED):
            refusal = rank_results[len(CASES) + offset]
            assert not refusal["ok"], refusal
            for word in words:
                assert word in refusal["error"], refusal["error"]
        # memory: one weight version. PipeMare's only copy is delta (correction on, not on the last stage);
        # PipeDream keeps min(w, m - w + 1) stashes of the stage
        full, resumed = rank_results[-1]["full"], rank_results[-1]["resumed"]
        assert resumed["global_step"] == 8
        for name, value in resumed["params"].items():
            torch.testing.assert_close(value, full["params"][name], rtol=0, atol=1e-6)
        plain, corrected, stashing = rank_results[1], rank_results[0], rank_results[-2]
        s, stage_bytes = plain["pp_rank"], plain["stage_bytes"]
        assert plain["copy_bytes"] == 0
        assert corrected["copy_bytes"] == (stage_bytes if s < P - 1 else 0)
        assert stashing["max_stashes"] == min(min(4, P - s), 4 - min(4, P - s) + 1)
        print(f"stage {s}: parameters {stage_bytes} B; PipeMare copies {plain['copy_bytes']} B (correction: "
              f"{corrected['copy_bytes']} B); PipeDream stashes "
              f"{stashing['max_stashes'] * stage_bytes} B")
