"""What the installed torch can run: tests of a feature that torch 2.11 / 2.12 lack or get wrong skip there (their
refusal is tested in ``tests/unit/test_compat.py``), or assert the refusal instead ([Note: torch versions])."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

from lightning_pipe._compat.torch import TORCH_GAPS, torch_gap

SPLIT_BACKWARD_SCHEDULES = frozenset({"zb_h1", "zbv", "dualpipev", "v_half", "v_min"})


def needs(feature: str) -> pytest.MarkDecorator:
    """Skip on a torch where ``feature`` of ``TORCH_GAPS`` is refused."""
    refusal = torch_gap(feature)
    return pytest.mark.skipif(refusal is not None, reason=f"refused on this torch (tested in test_compat): {refusal}")


def refused(feature: str) -> bool:
    return torch_gap(feature) is not None


@contextlib.contextmanager
def refused_here(feature: str, applies: bool = True) -> Iterator[None]:
    """The block runs normally, or, where this torch refuses ``feature`` (and ``applies``), raises the refusal."""
    if not applies or torch_gap(feature) is None:
        yield
        return
    with pytest.raises(Exception, match=re.escape(TORCH_GAPS[feature].feature)):
        yield
