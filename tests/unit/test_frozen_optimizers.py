"""Optimizers of a stage with nothing to train ([Note: stages with nothing to train]), without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.config import PipelineConfigError
from lightning_pipe.lightning.optimizers import check_optimizers_agree, empty_parameter_lists_allowed, has_parameters


def test_an_empty_parameter_list_builds_an_optimizer_with_one_empty_group_that_steps_nothing() -> None:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with empty_parameter_lists_allowed():
        adamw = torch.optim.AdamW((p for p in frozen.parameters() if p.requires_grad), lr=0.1, weight_decay=0.1)
        sgd = torch.optim.SGD([], lr=0.5, momentum=0.9)
        groups = torch.optim.AdamW([{"params": []}, {"params": list(nn.Linear(1, 1).parameters())}], lr=0.2)
    assert [g["params"] for g in adamw.param_groups] == [[]] and adamw.param_groups[0]["weight_decay"] == 0.1
    assert not has_parameters(adamw) and not has_parameters(sgd) and has_parameters(groups)
    scheduler = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    before = [p.clone() for p in frozen.parameters()]
    for _ in range(2):
        adamw.step()
        sgd.step()
        scheduler.step()
    assert adamw.param_groups[0]["lr"] == pytest.approx(0.025)
    assert all(torch.equal(a, b) for a, b in zip(before, frozen.parameters()))
    state = adamw.state_dict()
    assert state["state"] == {} and state["param_groups"][0]["params"] == []
    adamw.load_state_dict(state)
    # outside the scope torch's own rule holds again, and a tensor is still refused as torch refuses it
    with pytest.raises(ValueError, match="empty parameter list"):
        torch.optim.SGD([], lr=0.1)
    with empty_parameter_lists_allowed(), pytest.raises(TypeError, match="iterable of Tensors"):
        torch.optim.SGD(torch.zeros(2), lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        torch.optim.SGD([], lr=0.1)


def test_one_process_refuses_a_fit_with_nothing_to_train_and_accepts_one_trainable_parameter() -> None:
    frozen = list(nn.Linear(2, 2).requires_grad_(False).parameters())
    with pytest.raises(PipelineConfigError, match=r"requires_grad=True.*rank 0: stage 0, layers 0-0"):
        check_optimizers_agree([object()], 0, frozen, "stage 0, layers 0-0")
    check_optimizers_agree([object()], 1, [*frozen, nn.Parameter(torch.zeros(1))], "stage 0, layers 0-0")
