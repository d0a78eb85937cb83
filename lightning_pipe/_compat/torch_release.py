"""Which torch is installed, what it lacks or gets wrong, and how a private torch name is looked up.

The base of ``_compat``'s torch modules (:mod:`~lightning_pipe._compat.torch`, :mod:`.shape_inference`,
:mod:`.trace_api`, :mod:`.stage_shapes`). Policy (see the package docstring): a torch that lacks a private name fails
``import lightning_pipe`` with an ``ImportError`` naming the attribute and the versions checked, instead of a run
failing obscurely (or computing something else).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _release(torch.__version__)
"""The installed torch's (major, minor)."""
CHECKED_TORCH = ("2.11", "2.12", "2.13", "2.14", "2.15")
"""Releases this module was checked against (docs/versions.md says what ran on each)."""


def _resolve(owner: Any, name: str, where: str) -> Any:
    obj = getattr(owner, name, None)
    if obj is None:
        raise ImportError(
            f"torch {torch.__version__} has no {where}.{name}; lightning_pipe was checked on torch "
            f"{', '.join(CHECKED_TORCH)} and needs it. Install one of those or update lightning_pipe/_compat/."
        )
    return obj


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(f"torch {torch.__version__} has no module {name}; lightning_pipe was checked on torch "
                          f"{', '.join(CHECKED_TORCH)}. Update lightning_pipe/_compat/.") from err


def versions_checked() -> bool:
    """Whether the installed torch is a release this module was verified against."""
    return f"{TORCH_VERSION[0]}.{TORCH_VERSION[1]}" in CHECKED_TORCH


# ------------------------------------------------------------------------------------------- the restricted tier
# [Note: torch versions]
# ``import lightning_pipe`` works on every checked release. A feature that a release lacks *or computes wrongly* is
# refused where it is used (the strategy's constructor, before any process starts), naming the feature, the
# installed torch and the release that has it right; never an ImportError for the package, never a silent change
# of results. The gaps below were measured on each release's CPU build (docs/versions.md).
@dataclass(frozen=True)
class TorchGap:
    """A feature that torch releases before ``fixed_in`` lack or get wrong."""

    feature: str
    fixed_in: tuple[int, int]
    why: str

    def applies(self) -> bool:
        return TORCH_VERSION < self.fixed_in

    def message(self) -> str:
        return (f"{self.feature} needs torch >= {self.fixed_in[0]}.{self.fixed_in[1]}: {self.why}. "
                f"Installed: torch {torch.__version__}.")


TORCH_GAPS = {
    "split_backward": TorchGap(
        "A split input/weight backward (schedules zb_h1, zbv, dualpipev, v_half, v_min, custom lists with I/W actions)",
        (2, 13),
        "torch's stage_backward_weight computes wrong weight gradients when a weight is used more than once inside "
        "one stage (measured 17 % and 62 % off against autograd; torch 2.13 fixed it by clamping saved gradients)"),
    "strided_shard": TorchGap(
        "Tensor parallelism of a fused projection (FusedColwiseParallel, e.g. the GPT recipe's q|k|v)", (2, 12),
        "DTensor's _StridedShard redistribution raises a ValueError for it"),
}


def torch_gap(key: str) -> str | None:
    """The refusal message for feature ``key`` of :data:`TORCH_GAPS` on this torch, or ``None`` if it is fine."""
    gap = TORCH_GAPS[key]
    return gap.message() if gap.applies() else None


PRIVATE_TORCH_API: dict[str, Any] = {}
"""Every private torch name ``_compat`` resolved, by name; each module adds its own when imported
(``tests/unit/test_compat.py`` checks every entry)."""
