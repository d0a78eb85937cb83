"""The module's move at teardown (``release_to_cpu``): only where a tensor lives on an accelerator, and never in
place of the error that ended the run (tests/distributed/test_tensor_parallel.py: a failed step under tensor
parallelism reports its own error)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pipe.lightning.setup import release_to_cpu

SWAP_ERROR = "_apply(): Couldn't swap Linear.weight"


class RefusesToMove(nn.Linear):
    """Fails the move as torch's swap of a held DTensor does; ``device`` is what its tensors report (a machine
    without an accelerator can still name one)."""

    def __init__(self, device: str = "cpu", fails: bool = True) -> None:
        super().__init__(2, 2)
        self.reported, self.fails, self.moves = torch.device(device), fails, 0

    def parameters(self, recurse: bool = True) -> Iterator[Any]:  # type: ignore[override]
        yield SimpleNamespace(device=self.reported)

    def cpu(self) -> RefusesToMove:
        self.moves += 1
        if self.fails:
            raise RuntimeError(SWAP_ERROR)
        return self


def test_a_cpu_or_meta_module_is_not_moved() -> None:
    release_to_cpu(RefusesToMove("cpu"))  # nothing to free: no move, so no swap to fail
    release_to_cpu(nn.Linear(2, 2, device="meta"))  # a setup that failed before allocation: cannot move


def test_an_accelerator_module_is_moved() -> None:
    module = RefusesToMove("cuda", fails=False)
    release_to_cpu(module)
    assert module.moves == 1


def test_a_failed_move_after_a_failed_run_warns_and_keeps_the_runs_error() -> None:
    module = RefusesToMove("cuda")
    with pytest.raises(ValueError, match="the step's own error"):
        try:
            raise ValueError("the step's own error")
        except ValueError:
            with pytest.warns(UserWarning, match=r"could not move the module to CPU .*Couldn't swap.*\['cuda'\]"):
                release_to_cpu(module)  # as Lightning's teardown runs, inside its handler of the run's exception
            raise
    assert module.moves == 1


def test_a_failed_move_after_a_good_run_raises() -> None:
    with pytest.raises(RuntimeError, match="Couldn't swap"):
        release_to_cpu(RefusesToMove("cuda"))
