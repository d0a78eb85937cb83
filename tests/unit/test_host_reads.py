"""The loss kind is read from the device once, then checked on the host ([Note: the loss kind is read once])."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.layers.batches import LossParts
from lightning_pipe.runtime.host_reads import LossKind


def mean() -> LossParts:
    return LossParts(torch.tensor(1.0), None)


def pair() -> LossParts:
    return LossParts(torch.tensor(3.0), torch.tensor(2.0))


def test_the_kind_is_read_once_and_later_steps_check_host_data_only() -> None:
    kind = LossKind()
    kind.check([mean(), mean()], "M")  # nothing learned yet: nothing to compare
    assert kind.learn(torch.tensor(False), 2) is False
    assert kind.learn(torch.tensor(True), 2) is False  # not read again
    kind.check([mean(), mean()], "M")
    with pytest.raises(TypeError, match=r"M.loss_fn must return the same kind of loss .* first step's were means "
                                        r"\(2 on this rank\), this step's are \['mean', 'pair'\]"):
        kind.check([mean(), pair()], "M")
    with pytest.raises(TypeError, match="this step's are \\['mean'\\]"):
        kind.check([mean()], "M")


def test_a_pair_loss_run() -> None:
    kind = LossKind()
    assert kind.learn(torch.tensor(True), 0) is True  # a rank without a last stage records nothing
    kind.check([], "M")
    with pytest.raises(TypeError, match="first step's were pairs"):
        kind.check([pair()], "M")
